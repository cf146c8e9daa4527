"""When a sharded step reduces its gradients, micro-batch by micro-batch: the plain step's
own choreography (train/step.py), by the step's traffic.

ZeRO-3 eager: each micro-batch's backward reduce-scatters as it goes, holding what is
partial over the replica dims (dp) until the last micro-batch; compiled: the graphs
leave it partial and `ShardedContext.reduce_held` reduces it once. Kept weights
(parallel.zero 1 and 2, parallel/keep_gathered.py): the micro-batches run on weights
gathered once, their gradients summed locally, released in and after the last backward
(zero 1) or every one (zero 2).
"""

from __future__ import annotations

from typing import Mapping

from ..layout.traffic import Traffic
from .keep_gathered import KeptWeights


class GradientSchedule:
    """For a step on `ctx` (a ShardedContext, or None in one process) with `traffic`;
    `kept`: the KeptWeights whose context `ctx` is, or None; `compiled`: the step's
    graphs are compiled."""

    def __init__(self, ctx, traffic: Traffic, kept: KeptWeights | None, compiled: bool):
        self.ctx, self.kept, self.compiled = ctx, kept, compiled
        self.per_micro_batch = kept is not None and traffic.zero == 2

    def weights(self, params: Mapping) -> Mapping:
        """What the micro-batches run on: the parameters, or their kept gathered copies."""
        return params if self.kept is None else self.kept.gather(params, lazy=not self.compiled)

    def before_backward(self, micro: int, last: int) -> None:
        """ZeRO-3 eager: hold the replica reductions on all but the last micro-batch. Kept
        weights: the backward that releases (zero 1: the last; zero 2: each) reduces the
        buckets it completes as it goes."""
        if self.kept is not None:
            self.kept.arm(self.per_micro_batch or micro == last)
        elif self.ctx is not None and hasattr(self.ctx, "hold_reductions"):
            self.ctx.hold_reductions(micro < last)

    def after_backward(self, weights: Mapping, micro: int, last: int) -> None:
        """ZeRO-2: this micro-batch's gradients reduced into the shards'."""
        if self.per_micro_batch:
            self.kept.release()

    def after_last(self, weights: Mapping, params: Mapping) -> None:
        """ZeRO-1: the step's summed gradients reduced once; compiled ZeRO-3: what the
        graphs left partial, reduced once."""
        if self.kept is not None:
            if not self.per_micro_batch:
                self.kept.release()
            self.kept.end_step()
        elif self.compiled and self.ctx is not None and hasattr(self.ctx, "reduce_held"):
            self.ctx.reduce_held(params)
