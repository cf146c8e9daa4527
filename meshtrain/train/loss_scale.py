"""Dynamic loss scaling for fp16 (train.precision fp16, train.loss_scale).

fp16's 5 exponent bits lose small gradients to underflow, so the objective is multiplied
by a scale before backward and the gradients divided by it before the norm. A step whose
gradients overflowed (a non-finite global norm: every rank sees the same all-reduced
value) is skipped on every rank, parameters and optimizer state untouched, and the scale
multiplied by backoff_factor; after growth_interval finite steps in a row it grows by
growth_factor. The rule and the defaults are torch.amp.GradScaler's; min_scale is
Megatron's --min-loss-scale floor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError, check_float, check_int


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16's dynamic loss scale (torch.amp.GradScaler's rule and defaults)."""

    init_scale: float = 2.0**16
    """The scale of the first step (Megatron: --initial-loss-scale)."""
    growth_factor: float = 2.0
    """The scale is multiplied by this after growth_interval steps in a row with finite gradients."""
    backoff_factor: float = 0.5
    """The scale is multiplied by this after a step whose gradients overflowed (the step is skipped)."""
    growth_interval: int = 2000
    """Finite steps in a row before the scale grows (Megatron: --loss-scale-window)."""
    min_scale: float = 1.0
    """The scale never backs off below this (Megatron: --min-loss-scale); a step that overflows at it is a non-finite step for train.nonfinite: scaling no longer explains it."""

    def __post_init__(self) -> None:
        check_float(self.init_scale, "train.loss_scale.init_scale", positive=True)
        check_float(self.growth_factor, "train.loss_scale.growth_factor", minimum=1.0)
        check_float(self.backoff_factor, "train.loss_scale.backoff_factor", positive=True)
        if self.backoff_factor >= 1:
            raise ConfigError(f"train.loss_scale.backoff_factor={self.backoff_factor}: an overflow must lower the "
                              "scale, so the factor must be below 1 (GradScaler's default is 0.5)")
        check_int(self.growth_interval, "train.loss_scale.growth_interval", minimum=1)
        check_float(self.min_scale, "train.loss_scale.min_scale", positive=True)
        if self.min_scale > self.init_scale:
            raise ConfigError(f"train.loss_scale.min_scale={self.min_scale} exceeds init_scale={self.init_scale}: "
                              "the floor must be at or below the first scale")


@dataclass
class ScaleState:
    """The scale the next step multiplies its objective by, and the finite steps in a row
    since it last changed (GradScaler's growth tracker). Saved in checkpoints."""

    scale: float
    growth_tracker: int = 0
    # Whether the last step was skipped for its gradients' overflow above the floor: the
    # scale's business, not train.nonfinite's. Not saved.
    overflow: bool = field(default=False, compare=False)

    @staticmethod
    def start(cfg: LossScaleConfig) -> "ScaleState":
        return ScaleState(float(cfg.init_scale))

    def to_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    @staticmethod
    def from_dict(d: dict) -> "ScaleState":
        return ScaleState(float(d["scale"]), int(d["growth_tracker"]))

    def update(self, cfg: LossScaleConfig, finite_loss: bool, finite_grads: bool) -> None:
        """After a step: back off when the gradients of a finite loss overflowed, grow after
        growth_interval finite steps in a row. A non-finite loss leaves the scale as it is
        (the loss is computed before scaling: the scale is not the cause); so does an
        overflow at the floor (min_scale), where backing off can no longer help. Neither
        is an `overflow`: train.nonfinite rules them."""
        self.overflow = False
        if not finite_loss:
            return
        if not finite_grads:
            if self.scale > cfg.min_scale:
                self.overflow = True
                self.scale = max(self.scale * cfg.backoff_factor, cfg.min_scale)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == cfg.growth_interval:
            self.scale, self.growth_tracker = self.scale * cfg.growth_factor, 0

