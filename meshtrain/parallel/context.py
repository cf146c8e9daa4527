"""ShardedContext: the model's `ctx` calls answered with DTensor layouts on a device mesh.

Activations are DTensors; `constrain` redistributes them to the layout the plan gives
their logical axes, so DTensor emits exactly the collective a layout change needs
(Partial -> Replicate is the tensor-parallel all-reduce, Partial -> Shard(seq) the
sequence-parallel reduce-scatter, Shard(seq) -> Replicate its all-gather). Parameters are
gathered where they are used (SimpleFSDP), a bucket at a time (parallel/bucket_run.py: one
all-gather per block, the next one issued ahead, in compiled steps by a pass on the graph
(parallel/overlap.py); backward reduce-scatters the bucket's gradients in fp32 whatever
the compute dtype); what no bucket holds, one
parameter at a time (DTensor's redistribute both ways). Gathered parameters are not kept
for backward (ZeRO-3, reshard_after_forward): in eager steps saved-tensor hooks keep a
reference to the shard and gather again (the whole bucket, once) when backward needs the
value; in compiled steps each gather sits under a checkpoint that recomputes it (the
hooks cannot be traced).
Attention and the vocab-parallel loss run on local shards with explicit collectives.
A sequence split over cp is held in zigzag order (rank r: chunks r and 2cp-1-r of 2cp),
so causal attention costs every cp rank the same; position-wise ops never notice the
order, plain tensors (tokens, RoPE tables, positions, targets) are permuted the same way
when they are sliced, and the loss is a sum over tokens.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..models.context import MoeRecords, remat_recording
from ..models.policy import Policy
from .activations import ActivationLayouts
from .bound_params import _BoundParams, _with_own_view
from ..layout.buckets import group_dims, plan_buckets
from .bucket_groups import Groups, InFlight
from .bucket_run import BucketRun
from .reductions import Reductions
from .regather import RegatherHooks
from .sharded_attention import ShardedAttention
from .sharded_linear import ShardedLinear
from .sharded_moe import ShardedMoe
from .vocab_parallel import VocabParallel
from ..layout.mesh import device_mesh_for
from ..layout.plan import Plan
from ..layout.traffic import Traffic


class ShardedContext(RegatherHooks, Reductions, ActivationLayouts, ShardedLinear, ShardedAttention, ShardedMoe,
                     VocabParallel):
    """The model's `ctx` under a plan on a device mesh: the state of the parameter buckets
    (built here), and the parts that answer the model's calls, one job each: the eager
    regather hooks (parallel/regather.py), the gradient reductions (parallel/reductions.py),
    activation layouts (parallel/activations.py), matmuls (parallel/sharded_linear.py),
    attention (parallel/sharded_attention.py), MoE (parallel/sharded_moe.py), and the
    vocab-parallel embedding and loss (parallel/vocab_parallel.py). `bind` gives one
    forward's view of the parameters (parallel/bound_params.py)."""

    start_pos = 0  # training only: sequences start at position 0

    def __init__(self, plan: Plan, device_mesh: DeviceMesh, policy: Policy | torch.dtype | None = None,
                 traffic: Traffic = Traffic(), *, held: bool = False, names=None):
        """`traffic`: how the parameters travel (layout/traffic.py). `held`: the parameters it is bound to are gathered already and held over the
        step's micro-batches by their owner (parallel/keep_gathered.py, with `plan` the
        `gathered` plan): their gradients stay this rank's partial sums, never reduced
        here, and a weight cast to the compute dtype is cast again in backward, not saved.
        `names`: the parameters it will be bound to (default: all), so buckets hold
        only those (a held context's must all be bucketed: none reduced alone)."""
        self.plan, self.mesh, self.policy = plan, device_mesh, Policy.coerce(policy)
        self.prefetch, self.reshard = traffic.prefetch, traffic.reshard_after_forward or held
        self.held = held
        buckets, _ = plan_buckets(plan, traffic.bucket, names)
        self._groups = Groups(device_mesh, group_dims(buckets, plan))
        # Expert weights' buckets run on the expert mesh, with groups of its own (made on
        # every rank, in the same order: group creation is collective).
        meshes = {plan.mesh: (device_mesh, self._groups)}
        for spec in dict.fromkeys(b.mesh for b in buckets if b.mesh != plan.mesh):
            folded = device_mesh_for(device_mesh, spec)
            meshes[spec] = (folded, Groups(folded, group_dims(buckets, plan, spec)))
        inflight = InFlight(traffic.prefetch)  # gradient reductions in flight, as many as gathers ahead
        unsharded = traffic.fsdp_accumulate == "unsharded"
        # Mesh dims that split the sequence: a weight used whole there gets partial
        # gradients (expert weights meet routed rows, not sequences).
        seq = frozenset(plan.mesh.axes.index(a) for axis in ("seq", "seq_sp") for a in plan.rules.lookup(axis)
                        if a in plan.mesh.axes)
        self._runs = [BucketRun(b, plan, *meshes[b.mesh], self.policy, inflight, unsharded,
                                seq if b.mesh == plan.mesh else frozenset()) for b in buckets]
        for run in self._runs:
            run.hold = held
        self._bucket_of = {n: b.index for b in buckets for n in b.names}
        self._gathered: dict[int, tuple] = {}  # storage of a gathered parameter -> how to fetch it again
        self._regathered: dict[int, list] = {}  # backward: buckets gathered again (the current, the next)
        self._regathered_activation: tuple | None = None  # backward: (_FetchActivation, its gathered value)
        self._pending_bwd: dict[int, tuple] = {}
        self._cp_dim = plan.mesh.axes.index("cp") if "cp" in plan.mesh.axes else None
        self._moe = MoeRecords()
        self._views: list | None = None  # inside regather_in_backward: the forward's parameter views (weak)

    def bind(self, params):
        view = _BoundParams(self, params)
        if self._views is not None and not torch.compiler.is_compiling():
            self._views.append(weakref.ref(view))
        return view

    def cached_latents(self, latent, rope_key):
        return latent, rope_key  # training: the latents given (models/context.py)

    def remat(self, fn, *args):
        if torch.compiler.is_compiling() and self.policy.checkpointing != "none":
            # Dynamo refuses a checkpointed region that mutates state from outside it, as
            # gathering a bucket into the forward's view of the parameters does: the
            # block gathers into a view of its own, made inside the region.
            fn = partial(_with_own_view, fn)
        return remat_recording(self.policy, self, fn, *args)
