"""Weights gathered once per step and kept over its micro-batches: parallel.zero 1 and 2
(the whole model's; Megatron's distributed optimizer) and parallel.pp_keep_gathered (a
pipeline rank's stage weights, the same thing as zero 1 there).

Under ZeRO-3 every micro-batch gathers the weights (again in backward, with
reshard_after_forward) and reduce-scatters their gradients. Here the rank gathers each
bucket once per step, cast to the compute dtype before the all-gather (bf16 on the wire
and in memory under bf16; the router stays fp32), and keeps the gathered weights as
leaves the micro-batches run on through a `held` ShardedContext on the `gathered` plan
(no gathers, no reductions). An eager step gathers a bucket where the first micro-batch
first uses it, the next ones issued ahead (Megatron's --overlap-param-gather); a compiled
one, whose graphs take the weights as inputs, gathers them all before it.

Each leaf's gradient is added, as it lands, into an fp32 sum of the step (Megatron's
main_grad) and dropped, so micro-batches add up in fp32 whatever the compute dtype.
`release` reduces those sums into the shards' .grad: per bucket one reduce-scatter per
gather set (fp32) and one all-reduce of what is still partial (dp; tp for
sequence-parallel norms) - the eager bucket path's own collectives
(parallel/bucket_run.py `BucketRun.reduce`), called directly. Zero 1 releases once per
step, zero 2 after every micro-batch's backward (the shards' .grad adding them up). Armed
for the backward that releases (`arm`), a bucket whose leaves all have their gradient is
reduced there and then, while backward goes on with the buckets before it (Megatron's
--overlap-grad-reduce); `release` reduces whatever is left.
"""

from __future__ import annotations

import dataclasses
from functools import partial
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
        self.names_set = frozenset(self.names)
        # Both in the run's buckets and prefetch; what else the traffic says is this
        # class's to decide: gathered once, never resharded, reduced once per step.
        buckets = Traffic(bucket=traffic.bucket, prefetch=traffic.prefetch)
        # Bucketed in the plan's (forward) order, as the planner counts them.
        self._ordered = [n for n in plan.params if n in self.names_set]
        self._gatherer = ShardedContext(plan, device_mesh, Policy(dtype=policy.dtype),
                                        dataclasses.replace(buckets, reshard_after_forward=False),
                                        names=self._ordered)
        # The held context sees the weights in the dtype they are kept in: used as they are.
        self.context = ShardedContext(gathered(plan, policy), device_mesh, policy, buckets, held=True,
                                      names=self.names)
        # The layout each held gradient's local sum is a part of (Partial where tokens split).
        self._layouts = self.context.gradient_layouts()
        loose = [n for n in self.names if plan.params[n].spec.trainable and n not in self._layouts]
        if loose:
            raise ConfigError(f"parallel.zero {traffic.zero} / pp_keep_gathered: {', '.join(loose)} would be reduced "
                              "every micro-batch (no bucket holds them): use parallel.bucket block or a size in MB")
        runs = self._gatherer._runs
        self._bucket_of = {n: b for b, run in enumerate(runs) for n in run.bucket.names}
        # Per bucket, the leaves with a gradient to wait for before it is reduced in backward.
        self._expected = [sum(plan.params[n].spec.trainable for n in run.bucket.names if n in self._layouts)
                          for run in runs]
        self._params: Mapping[str, DTensor] = {}
        self._main: dict[str, tuple[torch.Tensor, DTensor]] = {}  # name -> (fp32 local sum, its leaf)
        self._leaves: dict[str, DTensor] = {}  # this step's, as they are made
        self._landed = [0] * len(runs)
        self._armed = False

    def gather(self, params: Mapping[str, DTensor], lazy: bool = False) -> Mapping[str, DTensor]:
        """This rank's weights gathered (one all-gather per bucket and gather set, the next
        bucket's issued ahead), as leaves whose gradients the micro-batches add up. `lazy`
        (eager steps): each bucket gathered at its first use instead of all of them now."""
        self._params, self._main = params, {}
        self._landed = [0] * len(self._landed)
        self._leaves = {}
        view = _Leaves(self, self._gatherer.bind(params), self._leaves)
        if not lazy:  # in bucket order: each gather issued ahead is the one taken next
            for n in self._ordered:
                view[n]
        return view

    def _leaf(self, name: str, gathered_weight: DTensor) -> DTensor:
        leaf = gathered_weight.detach().requires_grad_(self._params[name].requires_grad)
        if leaf.requires_grad:
            leaf.register_post_accumulate_grad_hook(partial(self._landed_grad, name))
        return leaf

    def _fold(self, name: str, leaf: DTensor) -> None:
        """A leaf's gradient added into the step's fp32 sum, and dropped."""
        g = leaf.grad._local_tensor
        leaf.grad = None
        have = self._main.get(name)
        self._main[name] = (g.float() if have is None else have[0].add_(g), leaf)

    def collect(self) -> None:
        """The gradients a backward left in the leaves' .grad without accumulating them
        through autograd (torch.distributed.pipelining's stage_backward_weight, the eager
        zero-bubble weight pass, assigns them), folded into the sums: after each such pass,
        so the micro-batches add up in fp32."""
        for n, leaf in self._leaves.items():
            if leaf.grad is not None:
                self._fold(n, leaf)

    def _landed_grad(self, name: str, leaf: DTensor) -> None:
        """A leaf's gradient, as autograd accumulates it: into the step's fp32 sum; armed,
        its bucket reduced once all of its leaves have landed."""
        self._fold(name, leaf)
        b = self._bucket_of.get(name)
        if self._armed and b is not None:
            self._landed[b] += 1
            if self._landed[b] == self._expected[b]:
                self._reduce(b)

    def sums(self) -> dict[str, torch.Tensor]:
        """The fp32 gradient sums (local tensors) not reduced yet, by parameter name."""
        return {n: s[0] for n, s in self._main.items()}

    def arm(self, releasing: bool) -> None:
        """Before a backward: `releasing` if `release` follows it, so buckets whose
        gradients are complete are reduced during it."""
        self._armed = releasing
        self._landed = [0] * len(self._landed)

    def release(self) -> None:
        """The gradients summed since the last release reduced into the shards' .grad
        (added to what they hold): the buckets backward did not reduce already."""
        self.collect()
        for b in range(len(self._landed)):
            self._reduce(b)
        self._armed = False

    def end_step(self) -> None:
        """After the step's last release: its leaves let go, so the kept weights are freed
        with the step's own reference (before the update, not at the next gather)."""
        self._leaves, self._params, self._main = {}, {}, {}

    def _reduce(self, b: int) -> None:
        run = self._gatherer._runs[b]
        names = run.bucket.names
        summed = [self._main.pop(n, None) for n in names]
        if all(s is None for s in summed):
            return
        grads = [None if s is None else
                 DTensor.from_local(s[0], s[1].device_mesh, self._layouts[n], run_check=False,
                                    shape=s[1].shape, stride=s[1].stride())
                 for n, s in zip(names, summed)]
        shards = [self._params[n] for n in names]
        local = run.reduce(grads, [s._local_tensor for s in shards], shards)
        for shard, g in zip(shards, local):
            if g is None or not shard.requires_grad:
                continue
            g = DTensor.from_local(g, shard.device_mesh, shard.placements, run_check=False, shape=shard.shape,
                                   stride=shard.stride())
            shard.grad = g if shard.grad is None else shard.grad + g


class _Leaves(Mapping):
    """The kept leaves of one step, each bucket's made (gathered) at its first lookup."""

    def __init__(self, kept: KeptWeights, view, leaves: dict):
        self._kept, self._view, self._leaves = kept, view, leaves

    def __getitem__(self, name: str) -> DTensor:
        if name not in self._leaves:
            kept = self._kept
            if name not in kept.names_set:
                raise KeyError(name)
            b = kept._bucket_of.get(name)
            members = [name] if b is None else kept._gatherer._runs[b].bucket.names
            with torch.no_grad():
                for n in members:
                    self._leaves[n] = kept._leaf(n, self._view[n])
        return self._leaves[name]

    def __contains__(self, name) -> bool:
        return name in self._kept.names_set

    def __iter__(self):
        return iter(self._kept.names)

    def __len__(self) -> int:
        return len(self._kept.names)
