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

    def check(self, step: int, metrics: dict) -> str | None:
        """Raise TrainingError when the run must stop; return a warning line, or None."""
        t, loss = self.t, metrics["loss"]
        if metrics.get("skipped"):
            what = f"the loss is {loss} and the gradient norm {metrics['grad_norm']} at step {step}"
            if t.nonfinite == "abort":
                raise TrainingError(f"{what} (train.nonfinite=abort); the weights were not updated with it. Lower "
                                    "train.lr, use train.precision fp32 or a smaller train.grad_clip, or set "
                                    "train.nonfinite skip to skip such steps")
            self.in_a_row += 1
            self.skipped += 1
            if self.in_a_row > t.max_skipped:
                raise TrainingError(f"{what}: {self.in_a_row} steps in a row were not finite, more than "
                                    f"train.max_skipped={t.max_skipped}; the run diverged. Resume from the last "
                                    "checkpoint with a lower train.lr, or raise train.max_skipped")
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
