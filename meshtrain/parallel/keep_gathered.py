"""Weights gathered once per step and kept over its micro-batches: parallel.zero 1 and 2
(the whole model's; Megatron's distributed optimizer) and parallel.pp_keep_gathered (a
pipeline rank's stage weights, the same thing as zero 1 there).

Under ZeRO-3 every micro-batch gathers the weights (again in backward, with
reshard_after_forward) and reduce-scatters their gradients. Here the rank gathers its
weights once, in their own dtype (fp32), before the first micro-batch (`KeptWeights.gather`);
the micro-batches run on them through a `held` ShardedContext on the `gathered` plan,
which casts per use and leaves every gradient as this rank's partial sum, added up by
autograd over the micro-batches; `KeptWeights.release` then sends that sum back through
the gathers' own backward: per bucket one reduce-scatter per gather set and one
all-reduce of what is still partial (dp; tp for sequence-parallel norms), into the
shards' .grad. Zero 1 releases once, after the last backward; zero 2 after every
micro-batch's (the gradients sharded between micro-batches, the shards' .grad adding
them up). The gathers and reductions are the eager bucket path's
(parallel/bucket_gather.py) in eager and compiled steps alike: they run outside the
compiled graphs, which see the gathered weights as inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch
from torch.distributed.tensor import DTensor

from ..errors import ConfigError
from ..models.policy import Policy
from .context import ShardedContext
from ..layout.plan import Plan, gathered
from ..layout.traffic import Traffic


class KeptWeights:
    """The weights `names` on `plan`'s mesh (a pp rank's: its sub-mesh, the plan without
    pp): `context` runs the model (or the stages) on what `gather` returns; `release`
    reduces their gradients."""

    def __init__(self, plan: Plan, device_mesh, names, policy: Policy, traffic: Traffic = Traffic()):
        self.names = list(names)
        # Gathered in the parameters' dtype: the gradients add up in fp32 over the
        # micro-batches and the cast to the compute dtype is made per use.
        # Both in the run's buckets and prefetch; what else the traffic says is this
        # class's to decide: gathered once, never resharded, reduced once per step.
        buckets = Traffic(bucket=traffic.bucket, prefetch=traffic.prefetch)
        self._gatherer = ShardedContext(plan, device_mesh, Policy(),
                                        dataclasses.replace(buckets, reshard_after_forward=False))
        self.context = ShardedContext(gathered(plan), device_mesh, policy, buckets, held=True, names=self.names)
        # The layout each held gradient's local sum is a part of (Partial where tokens split).
        self._layouts = self.context.gradient_layouts()
        loose = [n for n in self.names if plan.params[n].spec.trainable and n not in self._layouts]
        if loose:
            raise ConfigError(f"parallel.zero {traffic.zero} / pp_keep_gathered: {', '.join(loose)} would be reduced "
                              "every micro-batch (no bucket holds them): use parallel.bucket block or a size in MB")
        self._gathers: dict[str, DTensor] = {}

    def gather(self, params: Mapping[str, DTensor]) -> dict[str, DTensor]:
        """This rank's weights gathered (one all-gather per bucket and gather set, the next
        bucket's issued ahead), as leaves whose .grad the micro-batches add up."""
        view = self._gatherer.bind(params)
        with torch.enable_grad():
            self._gathers = {n: view[n] for n in self.names}
        return {n: g.detach().requires_grad_(params[n].requires_grad) for n, g in self._gathers.items()}

    def release(self, kept: Mapping[str, DTensor], retain: bool = False) -> None:
        """The gradients `kept` (gather's leaves) hold reduced into the shards' .grad (added
        to what they hold), through the gathers' backward, and dropped from the leaves.
        `retain`: more releases follow this step (zero 2: one per micro-batch), so the
        gathers' graph stays."""
        outs, grads = [], []
        for n, leaf in kept.items():
            if leaf.grad is None:
                continue
            local = leaf.grad._local_tensor
            outs.append(self._gathers[n])
            grads.append(DTensor.from_local(local, leaf.device_mesh, self._layouts[n], run_check=False,
                                            shape=leaf.shape, stride=leaf.stride()))
            leaf.grad = None
        if not retain:
            self._gathers = {}
        if outs:
            torch.autograd.backward(outs, grads, retain_graph=retain)
