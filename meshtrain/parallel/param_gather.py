"""One parameter gathered from its stored layout to its compute layout, and its gradient
reduced back: the autograd functions, and the recomputing checkpoint a traced step gathers
under (ZeRO-3 where saved-tensor hooks cannot run)."""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def _gather(p: DTensor, placements, dtype) -> DTensor:
    x = p if dtype is None else p.to(dtype)
    return x.redistribute(p.device_mesh, placements)


def _to_stored(grad: DTensor, placements, dtype) -> DTensor:
    """A gathered weight's gradient on its way back to the stored layout: in the
    parameter's dtype, so reductions are fp32, and reduce-scattered over the sharded axes
    first, so that what is left to all-reduce over the replicated ones (HSDP) is a shard,
    not the full gradient."""
    grad = grad.to(dtype)
    sharded_first = tuple(p if not p.is_replicate() else g for p, g in zip(placements, grad.placements))
    return grad.redistribute(grad.device_mesh, sharded_first)


class _UseParam(torch.autograd.Function):
    """Gather a stored parameter to its compute layout (optionally cast); the gradient
    goes back to the stored layout (_to_stored, then the replicated axes)."""

    @staticmethod
    def forward(ctx, p: DTensor, placements, dtype):
        ctx.placements, ctx.dtype = p.placements, p.dtype
        return _gather(p, placements, dtype)

    @staticmethod
    def backward(ctx, grad: DTensor):
        grad = _to_stored(grad, ctx.placements, ctx.dtype)
        return grad.redistribute(grad.device_mesh, ctx.placements), None, None


class _ReduceToStored(torch.autograd.Function):
    """Identity on a gathered weight whose gather autograd differentiates itself (a
    recomputed gather): its gradient leaves through _to_stored, and the gather's own
    backward does the rest."""

    @staticmethod
    def forward(ctx, x: DTensor, placements, dtype):
        ctx.placements, ctx.dtype = placements, dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: DTensor):
        return _to_stored(grad, ctx.placements, ctx.dtype), None, None


def _recompute(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


def _recomputed(fn, *args):
    """fn(*args) under a checkpoint whose policy recomputes every op: ZeRO-3 in a traced
    step, where the compiled backward then gathers a weight again where it needs it
    instead of keeping it from forward (SimpleFSDP's approach). Saved-tensor hooks,
    which do this in eager steps, cannot be traced."""
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, _recompute))


def _gathered_again_in_backward(p: DTensor, placements, dtype) -> DTensor:
    """One parameter's gather (and cast), recomputed in backward."""
    return _ReduceToStored.apply(_recomputed(_gather, p, placements, dtype), p.placements, p.dtype)
