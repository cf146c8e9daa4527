"""One micro-step's parameter lookups replayed over the plan's buckets: the gathers,
re-gathers and gradient reductions a step with buckets (parallel/bucket_run.py) issues for
the lookups a played recording made (`Walker.events`), counted into tallies."""

from __future__ import annotations

import math
from collections import defaultdict

from ..models.policy import Policy
from ..layout.buckets import DATA_AXES, gather_sets, group_dims, plan_buckets
from ..layout.traffic import Traffic, check_bucket
from .collective_tally import CollectiveTally
from .placement_rules import P, numel_on_rank
from .walker import Walker


def bucket_traffic(w: Walker, events, names, policy: Policy, traffic: Traffic,
                   step: CollectiveTally | None = None, keep: bool = False) -> list[tuple[int, dict]]:
    """One micro-step's parameter traffic, into `w.tally`, as a step with buckets
    (parallel/bucket_run.py, `traffic.bucket` block or a size in MB) issues it; of
    `traffic` the bucket, prefetch and fsdp_accumulate count here. `events` are one
    forward's parameter lookups in order (`Walker.events` of every block the rank runs,
    with the embedding's first and the head's last); `names` the parameters the rank
    holds. As `_BoundParams` and `BucketGather` run them:

    - forward: a lookup from a bucket the rank holds whole gathers the bucket unless it
      is the one gathered last (one all-gather per gather set: members with the same
      mesh dims and compute dtype, over those dims as one group, the padded shards in one
      buffer), and issues the next `prefetch` buckets' gathers (one not gathered since,
      once looked up, takes that gather); a `reused` parameter is kept from its first
      lookup. Any other parameter has collectives of its own (`param_traffic`).
    - eager backward (`w.eager`): a bucket is gathered again (every set) for each run of
      saved uses of its gathered members, in the order autograd saved them;
    - backward, per gather of a bucket with a trainable member looked up: one
      reduce-scatter per gather set (parameter dtype), then one all-reduce of what is
      still partial (over dims of size > 1: the other data dims, dims where a weight is
      used whole) per distinct set of dims, over those dims as one group where the step
      made one, else dim by dim. Members not looked up (or not trainable) count as
      Partial over the data dims. Those all-reduces go into `step` when given: a plain
      step holds them back on every micro-step but the last and issues them once; with
      fsdp_accumulate unsharded the reduce-scatters too.
    - `keep` (`step_collectives` parameters "kept": parallel.zero 1 and 2, a pp rank
      under parallel.pp_keep_gathered, with a walker that is neither eager nor
      recomputing): buckets of the rank's own parameters; a bucket once gathered stays gathered, so it is gathered once however its lookups
      interleave with other buckets', and the gradients of all its lookups are reduced
      together, once.

    Returns the eager backward's gathers again, in the order backward issues them:
    (bucket index, {(phase, op, axis): [count, bytes]}) each."""
    replay = _BucketReplay(w, check_bucket(traffic.bucket), names, policy, step,
                           traffic.fsdp_accumulate == "unsharded", keep)
    replay.forward(events, traffic.prefetch, keep)
    return replay.backward()


def buckets_of(plan, unit, names=None) -> tuple[list, dict]:
    """plan_buckets' buckets of `names` and each mesh's group dims (group_dims), once per
    plan: a pipeline's estimate and a layout search ask for them per rank and candidate."""
    memo = plan.__dict__.setdefault("_buckets_memo", {})
    key = (unit, None if names is None else tuple(names))
    if key not in memo:
        buckets, _ = plan_buckets(plan, unit, names)
        memo[key] = (buckets, {mesh: group_dims(buckets, plan, mesh) for mesh in {b.mesh for b in buckets}})
    return memo[key]


class _BucketReplay:
    """The plan's buckets, and the gathers a forward's lookups took of them."""

    def __init__(self, w: Walker, unit, names, policy: Policy, step: CollectiveTally | None, unsharded: bool,
                 keep: bool = False):
        self.w, self.plan, self.policy, self.step, self.unsharded = w, w.plan, policy, step, unsharded
        # Kept weights are bucketed among the rank's own, in forward order (parallel/keep_gathered.py).
        self.buckets, self.groups = buckets_of(w.plan, unit, [n for n in w.plan.params if n in names] if keep else None)
        self.bucket_of = {n: b.index for b in self.buckets for n in b.names}
        self.complete = {b.index for b in self.buckets if all(n in names for n in b.names)}
        self._sets: dict[int, list] = {}
        self.kept: dict[str, int | None] = {}  # reused parameters: the gather (index into calls) they came from
        self.live, self.pending = None, set()  # (bucket, call) gathered last; buckets whose gather was issued ahead
        self.calls: list[tuple[int, dict]] = []  # per bucket gather: (bucket, gradient placements by name)
        self.held: dict[int, int] = {}  # with `keep`: bucket -> its one gather (index into calls)
        self.saved: list[int] = []  # buckets of the saved uses of gathered members, in forward order

    # ---------------------------------------------------------------- one bucket
    def sets_of(self, b: int) -> list:
        """(gather dims, compute dtype, member indices, padded elements per rank) per set."""
        if b not in self._sets:
            bucket = self.buckets[b]
            dtypes = [self.policy.param_dtype(m.name) or self.plan.params[m.name].spec.dtype for m in bucket.members]
            self._sets[b] = [(g, dtype, js, sum(math.prod(bucket.members[j].padded(bucket.mesh.shape)) for j in js))
                             for g, dtype, js in gather_sets(bucket, bucket.mesh.shape, dtypes)]
        return self._sets[b]

    def ways(self, b: int, dims) -> int:
        return math.prod(self.buckets[b].mesh.shape[i] for i in dims)

    def gather(self, b: int, phase: str, into: CollectiveTally | None = None):
        into = self.w.tally if into is None else into
        for g, dtype, _, numel in self.sets_of(b):
            into.add_group(phase, "all_gather", g, self.ways(b, g) * numel * dtype.itemsize, mesh=self.buckets[b].mesh)

    def in_sets(self, b: int) -> set[int]:
        return {j for _, _, js, _ in self.sets_of(b) for j in js}

    def reduce(self, b: int, grads: dict):
        """The reductions of one gather's gradients (`grads`: placements by member name)."""
        bucket, w, step = self.buckets[b], self.w, self.step
        mesh, shape = bucket.mesh, bucket.mesh.shape
        for g, _, js, numel in self.sets_of(b):
            itemsize = self.plan.params[bucket.members[js[0]].name].spec.dtype.itemsize
            (step if self.unsharded and step is not None else w.tally).add_group(
                "bwd", "reduce_scatter_sum", g, self.ways(b, g) * numel * itemsize, mesh=mesh)
        data = tuple(i for i, a in enumerate(mesh.axes) if a in DATA_AXES and shape[i] > 1)
        gathered, partial = self.in_sets(b), defaultdict(int)
        for j, m in enumerate(bucket.members):
            spec, compute = self.plan.params[m.name].spec, w.compute(m.name)
            grad = grads.get(m.name) or tuple(P if i in data else q for i, q in enumerate(compute))
            done = set(m.gather) if j in gathered else set()
            dims = tuple(i for i, q in enumerate(grad) if q == P and i not in done and shape[i] > 1)
            if dims:
                numel = math.prod(m.padded(shape)) if j in gathered else numel_on_rank(spec.shape, compute, mesh)
                partial[dims] += numel * spec.dtype.itemsize
        for dims, nbytes in partial.items():
            for group in ([dims] if dims in self.groups[mesh] else [(i,) for i in dims]):
                (step or w.tally).add_group("bwd", "all_reduce_sum", group, nbytes, mesh=mesh)

    # ---------------------------------------------------------------- the step
    def forward(self, events, prefetch: int, keep: bool):
        """Each lookup in order: served by its bucket's gather (issued as the runtime
        would, with `prefetch` ahead), or by collectives of its own."""
        w = self.w
        for kind, name, acts_on, saves, grad in events:
            spec = self.plan.params[name].spec
            call = self._gather_for(name, self.bucket_of.get(name), prefetch, keep)
            if call is None:
                if name in self.kept or kind == "save":
                    w.regather(name, saves)  # kept from its own gather: only the saves
                else:
                    w.param_traffic(name, acts_on, saves, grad)
            else:
                b, grads = self.calls[call]
                if kind == "use" and spec.trainable:
                    new, old = w.grad_of(name, acts_on, grad), grads.get(name)
                    grads[name] = new if old is None else w.summed(old, new)
                if saves and self.buckets[b].names.index(name) in self.in_sets(b):
                    self.saved += [b] * saves
            if kind == "use" and spec.reused and name not in self.kept:
                self.kept[name] = call

    def _gather_for(self, name: str, b: int | None, prefetch: int, keep: bool) -> int | None:
        """The gather (index into calls) a lookup of `name` (in bucket b) takes, issuing it
        and the next `prefetch` buckets' where the runtime would; None: no bucket's."""
        if name in self.kept:
            return self.kept[name]
        if b in self.held:
            return self.held[b]
        if b not in self.complete:
            return None
        if self.live is None or self.live[0] != b:
            if b in self.pending:
                self.pending.discard(b)
            else:
                self.gather(b, "fwd")
            self.calls.append((b, {}))
            self.live = (b, len(self.calls) - 1)
            for nb in range(b + 1, b + 1 + prefetch):
                if nb in self.complete and nb not in self.pending:
                    self.pending.add(nb)
                    self.gather(nb, "fwd")
        if keep:
            self.held[b] = self.live[1]
        return self.live[1]

    def backward(self) -> list[tuple[int, dict]]:
        """The backward's gathers again (returned per bucket, eager) and every gather's
        reductions."""
        w, saved, regathers = self.w, self.saved, []
        if w.eager:  # backward unpacks the saved tensors in the reverse order of their saves
            for i, b in reversed(list(enumerate(saved))):
                if i == len(saved) - 1 or saved[i + 1] != b:
                    one = CollectiveTally(self.plan.mesh)
                    self.gather(b, "bwd", one)
                    self.gather(b, "bwd")
                    regathers.append((b, dict(one.out)))
        elif w.recompute:  # compiled: each bucket autograd saved is gathered again once, recomputed
            for b in reversed(dict.fromkeys(saved)):
                self.gather(b, "bwd")
        for b, grads in self.calls:
            if grads:
                self.reduce(b, grads)
        return regathers
