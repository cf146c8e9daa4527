"""What a step does with fp16's loss scale (train/loss_scale.py holds the config and the
state, torch-free for the config's sake): the seed its backward starts from, the
gradients unscaled before the norm, the metrics."""

from __future__ import annotations

import torch

from .loss_scale import LossScaleConfig, ScaleState


def scale_config(policy, loss_scale: LossScaleConfig | None) -> LossScaleConfig | None:
    """The loss scale a step with compute `policy` runs under: fp16's (`loss_scale`, or
    GradScaler's defaults), else None (bf16 and fp32 need none)."""
    if policy.dtype != torch.float16:
        return None
    return loss_scale or LossScaleConfig()


def loss_seed(state, cfg: LossScaleConfig | None) -> float | None:
    """What this step's objective is multiplied by before backward (None: nothing); the
    state's scale, started from cfg at the run's first scaled step."""
    if cfg is None:
        return None
    if state.loss_scale is None:
        state.loss_scale = ScaleState.start(cfg)
    return state.loss_scale.scale


def seeded(x: torch.Tensor, seed: float | None) -> torch.Tensor:
    return x if seed is None else x * seed


def unscale(state, grads: list[torch.Tensor]) -> None:
    """Divide the step's gradients by the scale their objective was multiplied by (a power
    of two with the default factors: exact)."""
    torch._foreach_mul_(grads, 1.0 / state.loss_scale.scale)


def scale_metrics(state, cfg: LossScaleConfig | None) -> dict:
    """The step's loss_scale (the one the next step uses) and overflow fields; {} unscaled."""
    if cfg is None:
        return {}
    return {"loss_scale": state.loss_scale.scale, "overflow": state.loss_scale.overflow}
