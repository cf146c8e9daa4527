"""Learning-rate schedules: linear warmup, then cosine, linear or WSD (warmup-stable-decay)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

LR_SCHEDULES = ("cosine", "linear", "wsd", "constant")  # train.lr_schedule


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float = 0.0
    warmup_steps: int = 0
    total_steps: int = 1
    kind: str = "cosine"
    decay_fraction: float = 0.2  # WSD: share of the steps after warmup spent decaying

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ConfigError(f"train.lr_schedule={self.kind!r}: choose one of {', '.join(LR_SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} must be at least 0")

    def __call__(self, step: int) -> float:
        """LR for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        span = max(self.total_steps - self.warmup_steps, 1)
        t = min((step - self.warmup_steps) / span, 1.0)
        if self.kind == "cosine":
            return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * t))
        if self.kind == "linear":
            return self.lr + (self.min_lr - self.lr) * t
        decay_start = 1.0 - self.decay_fraction
        if t <= decay_start:
            return self.lr
        return self.lr + (self.min_lr - self.lr) * (t - decay_start) / self.decay_fraction
