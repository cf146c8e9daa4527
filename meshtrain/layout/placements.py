"""Placements as text, the activation layouts a plan shows beside its parameters, and a
maybe-DTensor's local part."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

# Activation layouts worth showing next to the parameters.
MARKED_ACTIVATIONS: dict[str, tuple[str | None, ...]] = {
    "tokens": ("batch", "seq"),
    "residual": ("batch", "seq_sp", None),
    "block_input": ("batch", "seq", None),
    "q": ("batch", "seq", "q_heads", None),
    "kv": ("batch", "seq", "kv_heads", None),
    "mlp_hidden": ("batch", "seq", "mlp"),
    "logits": ("batch", "seq", "vocab"),
}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor that may be a DTensor (not differentiable: the storage)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def placement_str(p: Placement) -> str:
    if isinstance(p, _StridedShard):
        return f"SS({p.dim},{p.split_factor})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    return str(p)
