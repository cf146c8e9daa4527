"""ZeRO-3 in eager steps: saved-tensor hooks that keep a shard instead of a gathered value
(a parameter, a bucket member, a sequence-parallel activation) and gather it again when
backward needs it, a bucket once for all its uses, the bucket before it issued ahead."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.distributed.tensor import DTensor

from ..layout.placements import local_tensor
from .param_gather import _gather


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

    def __init__(self, context: "RegatherHooks", shard: DTensor, placements):
        self.context, self.shard, self.placements, self.mesh = context, shard, placements, shard.device_mesh

    def __call__(self) -> torch.Tensor:
        last = self.context._regathered_activation
        if last is not None and last[0] is self:
            return last[1]
        with torch.no_grad():
            local = self.shard.redistribute(self.mesh, self.placements)._local_tensor
        self.context._regathered_activation = (self, local)
        return local


class _Kept(dict):
    """Bucket -> shards, for the buckets whose weights autograd kept in one forward;
    `done`: those backward has gathered again (never issued ahead a second time)."""

    def __init__(self):
        super().__init__()
        self.done: set[int] = set()


class _FetchBucket:
    """Member j of bucket `index`; `saved`: the buckets of the same forward that backward
    will gather again (bucket -> shards), so the one before can be issued ahead."""

    def __init__(self, context: "RegatherHooks", index: int, j: int, shards, saved: _Kept):
        self.context, self.index, self.j, self.shards, self.saved = context, index, j, shards, saved
        self.mesh = context.mesh

    def mark(self) -> None:
        """Autograd kept a weight of this bucket: backward will gather it again."""
        self.saved[self.index] = self.shards

    def __call__(self) -> torch.Tensor:
        return self.context._regather_bucket(self.index, self.saved)[self.j]


class RegatherHooks:
    """ShardedContext's eager ZeRO-3 part. Reads the context's `_runs`, `mesh`, `held`,
    `prefetch`; owns `_gathered` (what the pack hook recognises), `_regathered`,
    `_regathered_activation`, `_pending_bwd` and `_views`, reset per forward."""

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
        uses; the highest bucket backward has not gathered yet is issued ahead: the one
        before b, or, from a head that modules after it (multi-token prediction) also
        read, the last of theirs."""
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
            ahead = max((i for i in saved if i not in saved.done), default=None)
            if self.prefetch and ahead is not None and ahead not in self._pending_bwd:
                self._pending_bwd = {ahead: self._issue_bucket(ahead, dict(zip(self._runs[ahead].bucket.names,
                                                                                saved[ahead])))}
        return self._regathered[b]

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
