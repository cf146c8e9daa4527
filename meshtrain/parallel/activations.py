"""Activation layouts: `constrain` redistributes an activation to the layout the plan gives
its logical axes (the layout changes are the tensor- and sequence-parallel collectives),
or slices a plain tensor to this rank's part (zigzag over cp)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from .param_gather import _gather, _recomputed
from .zigzag import zigzag_order


class _Constrain(torch.autograd.Function):
    """Redistribute to `placements`. The gradient goes back to the source layout with any
    pending partial sums resolved on the way (Partial -> Replicate is the all-reduce of a
    column-parallel input's gradient, Partial -> Shard(seq) the sequence-parallel
    reduce-scatter), so no Partial gradient ever leaves a layout boundary."""

    @staticmethod
    def forward(ctx, x: DTensor, placements):
        ctx.source = tuple(Replicate() if p.is_partial() else p for p in x.placements)
        return x.redistribute(x.device_mesh, placements)

    @staticmethod
    def backward(ctx, grad: DTensor):
        return grad.redistribute(grad.device_mesh, ctx.source), None


def _only_gathers(source, target) -> bool:
    """Does redistributing `source` to `target` placements only all-gather (no partial
    sum, no new split)?"""
    return source != target and all(
        s == t or (isinstance(s, Shard) and t.is_replicate()) for s, t in zip(source, target))


class ActivationLayouts:
    """ShardedContext's `constrain`. Reads the context's `plan`, `mesh`, `policy`,
    `_cp_dim`, and `_keep_shard` (parallel/regather.py)."""

    def constrain(self, x: torch.Tensor, axes: Sequence[str | None]) -> DTensor:
        placements = self.plan.activation(axes).placements
        if isinstance(x, DTensor):
            if not _only_gathers(tuple(x.placements), tuple(placements)):
                return _Constrain.apply(x, placements)
            if not torch.compiler.is_compiling():
                out = _Constrain.apply(x, placements)
                self._keep_shard(x, out, placements)
                return out
            # Traced: the gather under a checkpoint that recomputes it, so backward gathers
            # again from the shard (hooks cannot be traced); a checkpointed block
            # recomputes it anyway. (A pure gather's gradient needs no _Constrain.)
            if self.policy.checkpointing == "none":
                return _recomputed(_gather, x, placements, None)
            return _Constrain.apply(x, placements)
        # A plain tensor is the full value on every rank: keep this rank's slice, no comms.
        # A dim split over cp takes this rank's zigzag chunks (mesh dims run outer to inner,
        # so it is still whole here): that is the order every cp-sharded sequence is in.
        local = x
        for i, p in enumerate(placements):
            if isinstance(p, Shard):
                n, rank = self.mesh.size(i), self.mesh.get_local_rank(i)
                if i == self._cp_dim:
                    mine = zigzag_order(local.shape[p.dim], n).chunk(n)[rank].to(local.device)
                    local = local.index_select(p.dim, mine)
                else:
                    local = local.chunk(n, p.dim)[rank]
        return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=x.shape, stride=x.stride())
