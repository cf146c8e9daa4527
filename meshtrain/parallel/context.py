"""ShardedContext: the model's `ctx` calls answered with DTensor layouts on a device mesh.

Activations are DTensors; `constrain` redistributes them to the layout the plan gives
their logical axes, so DTensor emits exactly the collective a layout change needs
(Partial -> Replicate is the tensor-parallel all-reduce, Partial -> Shard(seq) the
sequence-parallel reduce-scatter, Shard(seq) -> Replicate its all-gather). Parameters are
gathered where they are used (SimpleFSDP), a bucket at a time (parallel/buckets.py: one
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

import collections
import contextlib
import weakref
from functools import partial
from typing import Mapping, Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..errors import ConfigError
from ..models.context import MoeRecords, _recomputing, causal_attention, remat_recording
from ..models.fp8 import fp8_linear
from ..models.losses import cross_entropy_sum
from ..models.moe import balance_loss, route, routed_experts, sequence_stats, z_loss
from ..models.policy import Policy
from .buckets import (BucketGather, BucketRun, Groups, InFlight, grad_layouts, group_dims, held_partials,
                      plan_buckets, traced_gather)
from .cp_attention import context_parallel_attention
from .zigzag import zigzag_order
from ..layout.placements import local_tensor
from .expert_parallel import AllToAllExchange, CopyToTensorParallel
from ..layout.mesh import device_mesh_for
from ..layout.plan import Plan


@torch.library.custom_op("meshtrain::row_parallel_linear", mutates_args=())
def _row_parallel_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T on local shards split on the in features: a partial sum. An op of its own
    so selective checkpointing can tell it from the other matmuls (models/policy.py): it
    keeps the reduced sum (a sequence shard under sp), not this (the whole sequence)."""
    return torch.nn.functional.linear(x, w)


@_row_parallel_linear.register_fake
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _row_parallel_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _row_parallel_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad @ w, grad.flatten(0, -2).T @ x.flatten(0, -2)


_row_parallel_linear.register_autograd(_row_parallel_backward, setup_context=_row_parallel_setup)


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


class _Regather:
    """What autograd keeps instead of a gathered parameter (or a view of one; a plain
    tensor when the parameter was used through `to_local`, as the MoE layer does):
    `fetch()` gathers the parameter's whole local value again."""

    def __init__(self, fetch, saved: torch.Tensor):
        self.fetch = fetch
        self.spec = (saved.placements, saved.shape, saved.stride()) if isinstance(saved, DTensor) else None
        local = local_tensor(saved)
        self.view = (local.size(), local.stride(), local.storage_offset())

    def value(self) -> torch.Tensor:
        local = self.fetch().as_strided(*self.view)
        if self.spec is None:
            return local
        placements, shape, stride = self.spec
        return DTensor.from_local(local, self.fetch.mesh, placements, run_check=False, shape=shape, stride=stride)


class _FetchParam:
    def __init__(self, shard: DTensor, placements, dtype):
        self.shard, self.placements, self.dtype, self.mesh = shard, placements, dtype, shard.device_mesh

    def __call__(self) -> torch.Tensor:
        with torch.no_grad():
            return _gather(self.shard, self.placements, self.dtype)._local_tensor


class _FetchActivation:
    """An activation all-gathered from shards (the sequence-parallel gather before the
    q/k/v and MLP matmuls): autograd keeps this rank's shard instead, and backward
    gathers again, once for consecutive uses of the same value (q, k and v read one
    normed input), as Megatron's sequence parallelism does."""

    def __init__(self, context: "ShardedContext", shard: DTensor, placements):
        self.context, self.shard, self.placements, self.mesh = context, shard, placements, shard.device_mesh

    def __call__(self) -> torch.Tensor:
        last = self.context._regathered_activation
        if last is not None and last[0] is self:
            return last[1]
        with torch.no_grad():
            local = self.shard.redistribute(self.mesh, self.placements)._local_tensor
        self.context._regathered_activation = (self, local)
        return local


def _only_gathers(source, target) -> bool:
    """Does redistributing `source` to `target` placements only all-gather (no partial
    sum, no new split)?"""
    return source != target and all(
        s == t or (isinstance(s, Shard) and t.is_replicate()) for s, t in zip(source, target))


class _Kept(dict):
    """Bucket -> shards, for the buckets whose weights autograd kept in one forward;
    `done`: those backward has gathered again (never issued ahead a second time)."""

    def __init__(self):
        super().__init__()
        self.done: set[int] = set()


class _FetchBucket:
    """Member j of bucket `index`; `saved`: the buckets of the same forward that backward
    will gather again (bucket -> shards), so the one before can be issued ahead."""

    def __init__(self, context: "ShardedContext", index: int, j: int, shards, saved: _Kept):
        self.context, self.index, self.j, self.shards, self.saved = context, index, j, shards, saved
        self.mesh = context.mesh

    def mark(self) -> None:
        """Autograd kept a weight of this bucket: backward will gather it again."""
        self.saved[self.index] = self.shards

    def __call__(self) -> torch.Tensor:
        return self.context._regather_bucket(self.index, self.saved)[self.j]


class _BoundParams(Mapping):
    """One forward's view of the parameters. A parameter the model marks `reused` (a tied
    embedding) is gathered once and kept for the forward, so its uses share one gather
    and one gradient reduction; any other is gathered with its bucket (parallel.buckets)
    when first looked up, and the bucket dropped when the next one is gathered, so a
    forward holds one block's gathered weights (and `prefetch` more in flight), not the
    model's."""

    def __init__(self, context: "ShardedContext", params: Mapping[str, DTensor]):
        self._context, self._params = context, params
        self._kept: dict[str, DTensor] = {}
        self._live: dict[int, dict[str, DTensor]] = {}
        self._pending: dict[int, tuple] = {}  # prefetched gathers by bucket
        self._complete = {r.bucket.index for r in context._runs if all(n in params for n in r.bucket.names)}
        self._saved = _Kept()  # the buckets backward gathers again
        # Traced: gathers under a recomputing checkpoint, so backward gathers again.
        self._recompute = context.reshard and context.policy.checkpointing == "none"

    def __getitem__(self, name: str) -> DTensor:
        if name in self._kept:
            return self._kept[name]
        b = self._context._bucket_of.get(name)
        if b in self._complete:
            if b not in self._live:
                if torch.compiler.is_compiling():
                    self._live = {b: self._gather_bucket_traced(b)}
                else:
                    with _outside_selective_checkpoint():
                        self._live = {b: self._gather_bucket(b)}
            gathered = self._live[b][name]
        else:
            gathered = self._gather(name)
        if self._context.plan.params[name].spec.reused:
            self._kept[name] = gathered
        return gathered

    def _gather_bucket(self, b: int) -> dict[str, DTensor]:
        context = self._context
        run = context._runs[b]
        shards = [self._params[n] for n in run.bucket.names]
        pending = self._pending.pop(b, (None,) * len(run.sets))
        outs = BucketGather.apply(run, *pending, *shards)
        gathered = {j for s in run.sets for j in s.members}
        if context.held:  # cast per use: cast again in backward rather than saved
            gathered |= {j for j, (d, p) in enumerate(zip(run.dtypes, run.param_dtypes)) if d != p}
        if context.reshard:
            for j in gathered:
                local = outs[j]._local_tensor
                context._gathered[local.untyped_storage().data_ptr()] = (
                    weakref.ref(local), _FetchBucket(context, b, j, shards, self._saved))
        if not _recomputing():  # a block recomputed in backward wants the bucket before it next
            for nb in range(b + 1, b + 1 + context.prefetch):
                if nb in self._complete and nb not in self._pending:
                    self._pending[nb] = context._issue_bucket(nb, self._params)
        return dict(zip(run.bucket.names, outs))

    def _gather_bucket_traced(self, b: int) -> dict[str, DTensor]:
        """Bucket b in a traced step (parallel/buckets.py `traced_gather`), at its first
        use. Issuing the next one ahead is left to the compiled graph
        (parallel/overlap.py): a traced functional collective is waited where it is
        issued, and a gather issued outside the recomputing checkpoint would be kept
        for backward."""
        context = self._context
        run = context._runs[b]
        shards = [self._params[n] for n in run.bucket.names]
        gather = partial(traced_gather, run)
        outs = _recomputed(gather, *shards) if self._recompute else gather(*shards)
        return dict(zip(run.bucket.names, outs))

    def _gather(self, name: str) -> DTensor:
        context = self._context
        placements = context.plan.params[name].compute_placements()
        shard = self._params[name]
        dtype = context.policy.param_dtype(name)
        reshard = context.reshard and placements != tuple(shard.placements)
        traced = torch.compiler.is_compiling()
        # (Traced, a block checkpointed whole or selectively gathers again in its recompute.)
        if traced and reshard and self._recompute:
            return _gathered_again_in_backward(shard, placements, dtype)
        gathered = _UseParam.apply(shard, placements, dtype)
        if traced or not reshard:
            return gathered  # nothing was gathered, or it is kept for backward (by choice, or traced)
        local = gathered._local_tensor
        # A weak reference: once the gathered tensor dies its storage may be reused.
        context._gathered[local.untyped_storage().data_ptr()] = (weakref.ref(local),
                                                                 _FetchParam(shard, placements, dtype))
        return gathered

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def _with_own_view(fn, *args):
    return fn(*(_BoundParams(a._context, a._params) if isinstance(a, _BoundParams) else a for a in args))


@contextlib.contextmanager
def _outside_selective_checkpoint():
    """Gathering a bucket is parameter traffic, not part of the block: keep its ops out of
    selective checkpointing's op cache, which requires the block's recompute in backward
    to run exactly the ops its forward ran (a bucket gathered ahead, or still live from
    the block before, is gathered inside the block only when recomputed)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    if isinstance(_get_current_dispatch_mode(), (_CachingTorchDispatchMode, _CachedTorchDispatchMode)):
        with _pop_mode_temporarily():
            yield
    else:
        yield


class ShardedContext:
    start_pos = 0  # training only: sequences start at position 0

    def __init__(self, plan: Plan, device_mesh: DeviceMesh, policy: Policy | torch.dtype | None = None, *,
                 bucket: str | float = "block", prefetch: int = 1, reshard_after_forward: bool = True,
                 fsdp_accumulate: str = "sharded", held: bool = False, names=None):
        """`held`: the parameters it is bound to are gathered already and held over the
        step's micro-batches by their owner (parallel/keep_gathered.py, with `plan` the
        `gathered` plan): their gradients stay this rank's partial sums, never reduced
        here, and a weight cast to the compute dtype is cast again in backward, not saved.
        `names`: the parameters it will be bound to (default: all), so buckets hold
        only those (a held context's must all be bucketed: none reduced alone)."""
        self.plan, self.mesh, self.policy = plan, device_mesh, Policy.coerce(policy)
        self.prefetch, self.reshard = prefetch, reshard_after_forward or held
        self.held = held
        buckets, _ = plan_buckets(plan, bucket, names)
        self._groups = Groups(device_mesh, group_dims(buckets, plan))
        # Expert weights' buckets run on the expert mesh, with groups of its own (made on
        # every rank, in the same order: group creation is collective).
        meshes = {plan.mesh: (device_mesh, self._groups)}
        for spec in dict.fromkeys(b.mesh for b in buckets if b.mesh != plan.mesh):
            folded = device_mesh_for(device_mesh, spec)
            meshes[spec] = (folded, Groups(folded, group_dims(buckets, plan, spec)))
        inflight = InFlight(prefetch)  # gradient reductions in flight, as many as gathers ahead
        unsharded = fsdp_accumulate == "unsharded"
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

    @contextlib.contextmanager
    def regather_in_backward(self):
        """Scope of one forward: autograd keeps shards, not gathered parameters."""
        self._gathered, self._regathered, self._pending_bwd = {}, {}, {}
        self._regathered_activation = None
        self._views = []

        def pack(t):
            local = local_tensor(t)
            # Plain tensors too (a weight used through to_local); not wrappers such as a
            # pending collective's result, which have no storage of their own.
            if type(local) is torch.Tensor and local.device.type != "meta":
                ptr = local.untyped_storage().data_ptr()
                ref, fetch = self._gathered.get(ptr, (lambda: None, None))
                alive = ref()
                if alive is not None and alive.untyped_storage().data_ptr() == ptr:
                    if isinstance(fetch, _FetchBucket):
                        fetch.mark()
                    return _Regather(fetch, t)
            return t

        def unpack(t):
            return t.value() if isinstance(t, _Regather) else t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self._gathered = {}
            # A checkpointed block keeps its parameter view for the recompute: drop the
            # bucket the forward gathered last, or every micro-batch in flight would hold
            # one (the recompute gathers it again).
            for ref in self._views:
                view = ref()
                if view is not None:
                    view._live = {}
            self._views = None

    def _issue_bucket(self, b: int, params) -> tuple:
        """Start bucket b's gathers (async: waited where they are unpacked)."""
        run = self._runs[b]
        shards = [params[n]._local_tensor for n in run.bucket.names]
        return tuple(run.issue(s, shards) for s in run.sets)

    def _regather_bucket(self, b: int, saved: _Kept) -> list[torch.Tensor]:
        """Backward (eager): bucket b's gathered weights again, once for all of its saved
        uses; the bucket before it (next in backward) is issued ahead."""
        if b not in self._regathered:
            run, shards = self._runs[b], saved[b]
            locals_ = [s._local_tensor for s in shards]
            with torch.no_grad():
                pending = self._pending_bwd.pop(b, None) or tuple(run.issue(s, locals_) for s in run.sets)
                # (held: no gathers; the casts made per use are made again here)
                out = {j: t.to(d) if self.held else t for j, (t, d) in enumerate(zip(locals_, run.dtypes))}
                for s, gathered in zip(run.sets, pending):
                    out.update(run.unpack(s, gathered))
            self._regathered = {b: [out[j] for j in range(len(shards))]}
            saved.done.add(b)
            before = b - 1  # (a tied table's bucket is needed first, by the head, and not again)
            if self.prefetch and before in saved and before not in saved.done and before not in self._pending_bwd:
                self._pending_bwd = {before: self._issue_bucket(before, dict(zip(self._runs[before].bucket.names,
                                                                                  saved[before])))}
        return self._regathered[b]

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
        (parallel.buckets `held_partials`: replica dims, tp for sequence-parallel norms),
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

    def _keep_shard(self, shard: DTensor, gathered: DTensor, placements) -> None:
        """Eager: should autograd save `gathered`, the pack hook (regather_in_backward)
        keeps `shard` and gathers again in backward. The entry goes when `gathered` dies,
        so a shard nothing saved the gathered value for is not held to the end of forward."""
        local = gathered._local_tensor
        ptr = local.untyped_storage().data_ptr()

        def forget(ref):
            if self._gathered.get(ptr, (None,))[0] is ref:
                del self._gathered[ptr]

        self._gathered[ptr] = (weakref.ref(local, forget), _FetchActivation(self, shard, placements))

    def embedding(self, ids: DTensor, table: DTensor) -> DTensor:
        """Vocab-parallel lookup: each rank returns the rows it holds and zeros elsewhere,
        as a Partial sum over the vocab axes that the next `constrain` reduces."""
        vocab_dims = [i for i, p in enumerate(table.placements) if isinstance(p, Shard) and p.dim == 0]
        if not vocab_dims:
            return torch.nn.functional.embedding(ids, table)
        (i,) = vocab_dims
        # Each rank's rows see only its own tokens: their gradient is a partial sum over
        # the mesh dims that split the tokens.
        grad_placements = [Partial() if isinstance(ids.placements[j], Shard) else p
                           for j, p in enumerate(table.placements)]
        rows = table.to_local(grad_placements=grad_placements)
        start = self.mesh.get_local_rank(i) * rows.shape[0]
        local_ids = ids.to_local() - start
        inside = (local_ids >= 0) & (local_ids < rows.shape[0])
        out = torch.nn.functional.embedding(local_ids.clamp(0, rows.shape[0] - 1), rows) * inside.unsqueeze(-1)
        placements = [Partial() if j == i else p for j, p in enumerate(ids.placements)]
        shape = (*ids.shape, rows.shape[1])
        return DTensor.from_local(out, self.mesh, placements, run_check=False, shape=shape,
                                  stride=make_contiguous_strides_for(shape))

    def linear(self, x: DTensor, params, name: str, bias: DTensor | None = None) -> DTensor:
        w, recipe = params[name], self.policy.fp8_recipe(name)
        if recipe is not None:
            out = self._local_linear(x, w, partial(self._fp8_gemm, recipe))
            if out is None:
                raise ConfigError(f"fp8 linear: unsupported layout of input {x.placements} and weight "
                                  f"{w.placements}: use train.precision bf16 for this plan")
        elif self.policy.checkpointing == "selective" and any(
                isinstance(px, Shard) and px.dim == x.ndim - 1 and isinstance(pw, Shard) and pw.dim == 1
                for px, pw in zip(x.placements, w.placements)):
            out = self._local_linear(x, w, lambda a, b, *_: _row_parallel_linear(a, b))
            if out is None:
                out = torch.nn.functional.linear(x, w)
        elif any(isinstance(p, Shard) and 0 < p.dim < x.ndim - 1 for p in x.placements):
            # The sequence dim is split (cp): DTensor's linear flattens it with the batch
            # dim into a strided shard, which a traced step beside another mesh axis
            # cannot take (hundreds of unbacked sizes, torch 2.13: Known gap 12).
            out = self._local_linear(x, w, lambda a, b, *_: torch.nn.functional.linear(a, b))
            if out is None:
                out = torch.nn.functional.linear(x, w)
        else:
            return torch.nn.functional.linear(x, w, bias)
        return out if bias is None else out + bias

    def _local_linear(self, x: DTensor, w: DTensor, gemm) -> DTensor | None:
        """x @ w.T on local shards, `gemm(x_local, w_local, x_dims, w_dims)`, or None for a
        layout it does not take. Per mesh dim, x split on a token dim gives an output split
        the same way; a column-parallel w (split on out features) an output split on its
        last dim; a row-parallel pair (x and w split on in features) a partial sum.
        `x_dims` and `w_dims` name the mesh dims splitting x as (tokens: rows, in: cols)
        and w as (out: rows, in: cols)."""
        last = x.ndim - 1
        x_dims = {"rows": set(), "cols": set()}
        w_dims = {"rows": set(), "cols": set()}
        out_placements = []
        for i, (px, pw) in enumerate(zip(x.placements, w.placements)):
            x_split = isinstance(px, Shard) and ("cols" if px.dim == last else "rows")
            w_split = isinstance(pw, Shard) and ("cols" if pw.dim == 1 else "rows")
            if px.is_partial() or pw.is_partial() or (x_split == "cols") != (w_split == "cols") \
                    or (x_split == "rows" and w_split):
                return None
            if x_split:
                x_dims[x_split].add(i)
            if w_split:
                w_dims[w_split].add(i)
            out_placements.append(Shard(last) if w_split == "rows" else Partial() if x_split == "cols"
                                  else px)
        # The gradients of local operands: partial sums over the dims the other operand
        # splits on its own rows.
        x_local = x.to_local(grad_placements=[Partial() if i in w_dims["rows"] else p
                                              for i, p in enumerate(x.placements)])
        w_local = w.to_local(grad_placements=[Partial() if i in x_dims["rows"] else p
                                              for i, p in enumerate(w.placements)])
        out = gemm(x_local, w_local, x_dims, w_dims)
        shape = (*x.shape[:-1], w.shape[0])
        return DTensor.from_local(out, self.mesh, out_placements, run_check=False, shape=shape,
                                  stride=make_contiguous_strides_for(shape))

    def _fp8_gemm(self, recipe: str, x: torch.Tensor, w: torch.Tensor, x_dims, w_dims) -> torch.Tensor:
        """fp8 GEMM of local shards, quantised with the scales one process would use: each
        amax is all-reduced (max) over the mesh dims that split the dims it was taken over."""
        # Dims of the operands as fp8_linear names them: x (M, K), w (N, K), grad (M, N).
        split = {"x": (x_dims["rows"], x_dims["cols"]), "w": (w_dims["rows"], w_dims["cols"]),
                 "grad": (x_dims["rows"], w_dims["rows"])}

        def allmax(t, operand, over):
            for i in sorted(set().union(*(split[operand][d] for d in over))):
                t = funcol.all_reduce(t, "max", (self.mesh, i))
            return t

        return fp8_linear(x, w, recipe, allmax)

    def remat(self, fn, *args):
        if torch.compiler.is_compiling() and self.policy.checkpointing != "none":
            # Dynamo refuses a checkpointed region that mutates state from outside it, as
            # gathering a bucket into the forward's view of the parameters does: the
            # block gathers into a view of its own, made inside the region.
            fn = partial(_with_own_view, fn)
        return remat_recording(self.policy, self, fn, *args)

    def attention(self, q: DTensor, k: DTensor, v: DTensor, segments: DTensor | None = None,
                  window: int | None = None) -> DTensor:
        """Causal attention on local shards: heads split by tp need nothing; a sequence
        split over cp (zigzag) is exchanged the plan's cp_comm way. `segments` (batch,
        seq), as ("batch", "seq") lays them out: each rank's rows, every position;
        `window` as for models.context.ModelContext.attention (cp ignores it: its blocks
        skip what no local query sees)."""
        seq_dims = [i for i, p in enumerate(q.placements) if isinstance(p, Shard) and p.dim == 1]
        if any(i != self._cp_dim for i in seq_dims):
            raise ConfigError(f"attention: the sequence is split over mesh axis "
                              f"{self.plan.mesh.axes[seq_dims[-1]]}; only cp may split it there (rules "
                              f"{self.plan.rules.lookup('seq')} for 'seq')")
        local = None if segments is None else segments.to_local()
        if seq_dims:
            out = context_parallel_attention(q.to_local(), k.to_local(), v.to_local(),
                                             self.mesh.get_group(self._cp_dim), self.plan.cp_comm, local)
        else:
            out = causal_attention(q.to_local(), k.to_local(), v.to_local(), local, key=segments, window=window)
        # Contiguous, as the stride it is declared with says (the heads are flattened next,
        # which would copy a transposed kernel output anyway).
        return DTensor.from_local(out.contiguous(), self.mesh, q.placements, run_check=False,
                                  shape=q.shape, stride=make_contiguous_strides_for(q.shape))

    def moe(self, h: DTensor, cfg, router: DTensor, bias: DTensor | None, w_gate: DTensor, w_up: DTensor,
            w_down: DTensor) -> DTensor:
        """Routing on this rank's tokens; experts on their ep ranks (all-to-all) with their
        mlp dim split over tp. The per-sequence balance sums are added up over cp (the
        ranks that split a sequence), the load and z-loss over every token-splitting axis."""
        mesh, placements = self.mesh, h.placements
        token_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
        x = h.to_local()
        b, s, d = x.shape
        n = cfg.num_experts
        # Each rank's tokens give the router a partial gradient over the token-splitting dims.
        # (`router` stays referenced: while it lives, the regather hook knows its gathered
        # storage, so what linear saves of it is fetched again in backward, not kept.)
        local_router = router.to_local(grad_placements=[Partial() if i in token_dims else p
                                                        for i, p in enumerate(router.placements)])
        logits = torch.nn.functional.linear(x.float(), local_router.float())
        idx, gates, probs = route(logits.flatten(0, 1), cfg, None if bias is None else bias.to_local())
        prob_sum, counts = sequence_stats(probs.view(b, s, n), idx.view(b, s, cfg.top_k), n)
        balance = z = None
        if cfg.balance == "aux":
            per_sequence = [Partial() if p == Shard(1) else p for p in placements]
            shape = (h.shape[0], n)
            sums = [DTensor.from_local(t, mesh, per_sequence, run_check=False, shape=shape,
                                       stride=make_contiguous_strides_for(shape)).redistribute(
                        mesh, [Replicate() if p.is_partial() else p for p in per_sequence])
                    for t in (prob_sum, counts)]
            balance = _replicated(balance_loss(sums[0], sums[1], h.shape[1], cfg).sum())
        tokens = [Partial() if i in token_dims else Replicate() for i in range(mesh.ndim)]
        if cfg.z_loss_coef:
            z = DTensor.from_local(z_loss(logits, cfg), mesh, tokens, run_check=False).redistribute(
                mesh, [Replicate()] * mesh.ndim)
        self._moe.add(balance, z, DTensor.from_local(counts.sum(0), mesh, tokens, run_check=False))

        expert_mesh = w_gate.device_mesh
        names = expert_mesh.mesh_dim_names
        weights = [w.to_local(grad_placements=[Partial() if a in ("dp", "fsdp", "cp") else p
                                               for a, p in zip(names, w.placements)])
                   for w in (w_gate, w_up, w_down)]
        rows = x.reshape(-1, d)
        tp_split = "tp" in names and isinstance(w_gate.placements[names.index("tp")], Shard)
        if tp_split:
            group = expert_mesh.get_group("tp")
            rows, gates = CopyToTensorParallel.apply(rows, group), CopyToTensorParallel.apply(gates, group)
        exchange = AllToAllExchange(expert_mesh.get_group("ep"), expert_mesh.size(names.index("ep")), n) \
            if "ep" in names else None
        out = routed_experts(rows, idx, gates, *weights, cfg, exchange).view(b, s, d)
        out_placements = [Partial() if tp_split and a == "tp" else p
                          for a, p in zip(mesh.mesh_dim_names, placements)]
        return DTensor.from_local(out, mesh, out_placements, run_check=False, shape=h.shape,
                                  stride=make_contiguous_strides_for(h.shape))

    def moe_aux(self):
        return self._moe.take()

    def cross_entropy_sum(self, logits: DTensor, targets: torch.Tensor, reduce: bool = True) -> DTensor:
        """Vocab-parallel cross entropy (models.losses): each rank works on its vocab slice,
        a chunk of rows at a time; two small reductions over the vocab axes (the row max,
        then the sum of exp and the target logit stacked), so the full-vocab logits are
        never gathered and no fp32 copy of them is made. Returns a replicated scalar, or
        with `reduce` False the partial sums over the token-splitting ranks (a Partial
        DTensor: a step reduces its micro-steps' sum once, `reduce_sum`)."""
        vocab_dim = logits.ndim - 1
        targets = self.constrain(targets, ("batch", "seq")).to_local()
        local = logits.to_local()
        vocab_mesh_dims = [i for i, p in enumerate(logits.placements) if isinstance(p, Shard) and p.dim == vocab_dim]
        start, all_max, all_sum = 0, None, None
        if vocab_mesh_dims:
            (i,) = vocab_mesh_dims  # default rules shard vocab on one axis
            start = self.mesh.get_local_rank(i) * local.shape[-1]
            all_max = partial(funcol.all_reduce, reduceOp="max", group=(self.mesh, i))
            all_sum = partial(funcol.all_reduce, reduceOp="sum", group=(self.mesh, i))
        total = cross_entropy_sum(local, targets, vocab_start=start, all_max=all_max, all_sum=all_sum)
        # Tokens are split over the batch and sequence axes: the loss is a sum over them.
        token_dims = {i for i, p in enumerate(logits.placements) if isinstance(p, Shard) and p.dim < vocab_dim}
        placements = [Partial() if i in token_dims else Replicate() for i in range(self.mesh.ndim)]
        total = DTensor.from_local(total, self.mesh, placements, run_check=False)
        return total.redistribute(self.mesh, [Replicate()] * self.mesh.ndim) if reduce else total


def _set_grads(leaves: dict, reduced: dict) -> None:
    """Each leaf's .grad: its reduced local gradient, in the leaf's own layout."""
    for j, leaf in leaves.items():
        leaf.grad = DTensor.from_local(reduced[j].contiguous(), leaf.device_mesh,
                                       leaf.placements, run_check=False, shape=leaf.shape, stride=leaf.stride())


def _replicated(x: DTensor) -> DTensor:
    return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)

