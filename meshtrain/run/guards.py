"""train.nonfinite, train.max_skipped and train.spike_factor: what a run does about a
step whose loss is not finite or jumps."""

from __future__ import annotations

from ..errors import TrainingError


class LossGuard:
    """train.nonfinite and train.spike_factor, applied to each step's metrics on every rank
    alike (the loss and the gradient norm are global values)."""

    WINDOW = 20  # steps of the mean a spike is measured against

    def __init__(self, t):
        self.t, self.in_a_row, self.skipped, self.recent = t, 0, 0, []

    def advice(self) -> str:
        """What to change after non-finite steps, by the run's precision: fp32 is advised
        only to a run that is not in fp32 already."""
        t = self.t
        fixes = (f"Lower train.lr (now {t.lr:g}), lengthen train.warmup_steps (now {t.warmup_steps}) or set a "
                 f"smaller train.grad_clip (now {t.grad_clip})")
        if t.precision != "fp32":
            fixes += f", or train.precision fp32 (the run computes in {t.precision})"
        return fixes + ", and check the data the step read"

    def check(self, step: int, metrics: dict) -> str | None:
        """Raise TrainingError when the run must stop; return a warning line, or None."""
        t, loss = self.t, metrics["loss"]
        if metrics.get("overflow"):  # fp16's loss scale answers it: not a non-finite step
            return (f"step {step} skipped: the gradients overflowed in fp16; the loss scale backs off to "
                    f"{metrics['loss_scale']:g} (the parameters and optimizer state are unchanged)")
        if metrics.get("skipped"):
            what = f"the loss is {loss} and the gradient norm {metrics['grad_norm']} at step {step}"
            if t.nonfinite == "abort":
                raise TrainingError(f"{what} (train.nonfinite=abort); the weights were not updated with it. "
                                    f"{self.advice()}; or set train.nonfinite skip to skip such steps")
            self.in_a_row += 1
            self.skipped += 1
            if self.in_a_row > t.max_skipped:
                raise TrainingError(f"{what}: {self.in_a_row} steps in a row were not finite, more than "
                                    f"train.max_skipped={t.max_skipped}; the run diverged. Resume from the last "
                                    f"checkpoint after the fix: {self.advice()}; or raise train.max_skipped")
            return (f"step {step} skipped: {what}; the parameters and optimizer state are unchanged "
                    f"({self.in_a_row} in a row, {self.skipped} in this run; train.max_skipped={t.max_skipped})")
        self.in_a_row = 0
        note = None
        if t.spike_factor and len(self.recent) >= 5:
            mean = sum(self.recent) / len(self.recent)
            if loss > t.spike_factor * mean:
                note = (f"loss spike at step {step}: {loss:.4f} is {loss / mean:.2f} x the mean {mean:.4f} of the "
                        f"previous {len(self.recent)} steps (train.spike_factor={t.spike_factor:g})")
        self.recent = (self.recent + [loss])[-self.WINDOW:]
        return note
