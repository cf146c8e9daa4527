"""Gradient reductions a step asks of its ShardedContext: holding the replica-axis
reductions over micro-steps, reducing what compiled steps left partial, and summing a
token-split value (the loss) once."""

from __future__ import annotations

import collections
from typing import Mapping

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from .bucket_run import grad_layouts, held_partials


class Reductions:
    """ShardedContext's reductions. Reads the context's `_runs`, `_groups`, `mesh`,
    `prefetch`."""

    def gradient_layouts(self) -> dict[str, tuple]:
        """Each bucketed parameter's gradient layout as its gather takes it (Partial over
        the dims that split the tokens): what a `held` context leaves as local sums."""
        return {n: layout for run in self._runs for n, layout in zip(run.bucket.names, grad_layouts(run))}

    def hold_reductions(self, hold: bool) -> None:
        """Before a micro-step's backward: True on all but the step's last, so gradients
        partial over the replica dims (dp) accumulate locally and are reduced once."""
        for run in self._runs:
            run.hold = hold

    def reduce_held(self, params: Mapping[str, DTensor]) -> None:
        """After a compiled step's last backward: the gradients its buckets left partial
        (parallel/bucket_run.py `held_partials`: replica dims, tp for sequence-parallel norms),
        summed over every micro-step in .grad, all-reduced once, one collective per bucket
        and set of mesh dims as the eager step's last micro-step issues them, `prefetch`
        of them in flight. (An eager step has reduced them already: nothing is partial.)
        With parallel.fsdp_accumulate unsharded, the whole packed gradients the graphs
        summed are reduce-scattered first, once (`BucketRun.scatter_sinks`)."""
        pending: collections.deque = collections.deque()
        for run in self._runs:
            if not all(n in params for n in run.bucket.names):
                continue  # a pipeline stage's: held by another pp rank
            if run.unsharded:
                run.scatter_sinks([params[n] for n in run.bucket.names])
            for dims, js in held_partials(run).items():
                leaves = {j: params[run.bucket.names[j]] for j in js}
                grads = {j: leaf.grad for j, leaf in leaves.items()}
                if not all(isinstance(g, DTensor) and g.placements[dims[0]].is_partial() for g in grads.values()):
                    continue  # reduced already (an eager step)
                items = {j: g._local_tensor for j, g in grads.items()}
                run.all_reduce(items, dims)
                pending.append((leaves, items))
                while len(pending) > max(1, self.prefetch):
                    _set_grads(*pending.popleft())
        while pending:
            _set_grads(*pending.popleft())

    def reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The whole value of `x`, a partial sum over the ranks that split the tokens (a
        loss accumulated over micro-steps): one all-reduce over those ranks together."""
        if not isinstance(x, DTensor):
            return x
        dims = tuple(i for i, p in enumerate(x.placements) if p.is_partial() and self.mesh.size(i) > 1)
        if not dims:
            return x._local_tensor if all(p.is_partial() or p.is_replicate() for p in x.placements) \
                else x.full_tensor()
        if not self._groups.has(dims):
            return x.full_tensor()
        group = self._groups.name(dims)
        return funcol.wait_tensor(funcol.all_reduce(x._local_tensor, "sum", group))


def _set_grads(leaves: dict, reduced: dict) -> None:
    """Each leaf's .grad: its reduced local gradient, in the leaf's own layout."""
    for j, leaf in leaves.items():
        leaf.grad = DTensor.from_local(reduced[j].contiguous(), leaf.device_mesh,
                                       leaf.placements, run_check=False, shape=leaf.shape, stride=leaf.stride())
