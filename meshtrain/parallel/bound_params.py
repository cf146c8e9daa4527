"""One forward's view of the parameters: each gathered where it is first used, a bucket at a
time (the next issued ahead), and registered with the regather hooks (parallel/regather.py)
so that backward gathers it again instead of keeping it."""

from __future__ import annotations

import contextlib
import weakref
from functools import partial
from typing import TYPE_CHECKING, Mapping

import torch
from torch.distributed.tensor import DTensor

from ..models.context import _recomputing
from .bucket_gather import BucketGather, traced_gather
from .param_gather import _UseParam, _gathered_again_in_backward, _recomputed
from .regather import _FetchBucket, _FetchParam, _Kept

if TYPE_CHECKING:
    from .context import ShardedContext


class _BoundParams(Mapping):
    """One forward's view of the parameters. A parameter the model marks `reused` (a tied
    embedding) is gathered once and kept for the forward, so its uses share one gather
    and one gradient reduction; any other is gathered with its bucket (parallel/bucket_gather.py)
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
        """Bucket b in a traced step (parallel/bucket_gather.py `traced_gather`), at its first
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
