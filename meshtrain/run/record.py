"""The bookkeeping of a step: which steps the loop logs, evaluates and saves (`Due`), and
the metrics record of a logged step, from its metrics, its times (run/clock.py), the MFU
and the device's memory."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Due:
    """What step `done` is due for beside training, by the config alone (a background
    save that finished also gets its step a record: the loop adds that)."""

    evaluate: bool
    save: bool
    log: bool

    @classmethod
    def at(cls, done: int, train, every: int, stop: int) -> Due:
        """`train`: the config's train section; `every`: checkpoint.every; `stop`: this start's last step."""
        evaluate = bool(train.eval_every and (done % train.eval_every == 0 or done == train.steps))
        save = done == stop or bool(every and done % every == 0)  # the last step always saves
        # An evaluation or a save without a record would leave its numbers nowhere.
        return cls(evaluate, save, done % train.log_every == 0 or done == stop or evaluate or save)


def mfu(flops_per_token: float, tokens_per_s: float | None, world: int, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: one rank's share of the model FLOPs per second over its
    device's peak; None where the peak (CPU, an unknown GPU) or the rate is unknown."""
    return flops_per_token * tokens_per_s / world / (peak_tflops * 1e12) if peak_tflops and tokens_per_s else None


def step_record(step: int, metrics: dict, timing: dict, mfu: float | None, memory_gib: float) -> dict:
    """The logged record of a step, in the column order of metrics.jsonl: the step's
    metrics, `timing` (StepClock.fields), and fp16's loss scale, the MoE router's and
    multi-token prediction's numbers where it has them."""
    return {"step": step, "loss": metrics["loss"], "lr": metrics["lr"], "grad_norm": metrics["grad_norm"],
            "tokens_per_s": timing["tokens_per_s"], "step_time_s": timing["step_time_s"], "mfu": mfu,
            "memory_gib": memory_gib, "elapsed_s": timing["elapsed_s"], "eta_s": timing["eta_s"],
            **{k: metrics[k] for k in ("loss_scale", "aux_loss", "expert_imbalance", "mtp_loss") if k in metrics}}


def evaluation(val_loss: float) -> dict:
    """A record's evaluation fields. The perplexity's exponent is capped: exp overflows a
    float past 709, and a diverged run still logs."""
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0))}
