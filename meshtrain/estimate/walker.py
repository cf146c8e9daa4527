"""Walks a block's operations over the plan's placements and records the collectives
the runtime issues for each (the counting machinery of comms.py)."""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict

from torch.distributed.tensor import Shard

from ..models.experts import expert_capacity
from ..models.family import TOKENS
from ..models.policy import Policy, keeps_fp32
from ..layout.buckets import DATA_AXES, gather_sets, group_axes, group_dims, plan_buckets
from ..layout.plan import Plan

R, P = ("R",), ("P",)


FP32, INT64 = 4, 8


PHASES = {"fwd": "forward", "bwd": "backward", "opt": "optimizer"}


def _pl(p) -> tuple:
    return ("S", p.dim) if isinstance(p, Shard) else R  # _StridedShard is a Shard


class _Walker:
    """Accumulates (phase, op, axis) -> [count, bytes] while a family table walks the model.

    `eager`: gathered weights are dropped after forward and gathered again in backward
    where autograd saved them (an eager step with reshard_after_forward). `keep_shards`:
    an all-gathered activation autograd saves is kept as its shard and gathered again
    in backward, once (parallel/regather.py: eager `_FetchActivation`, compiled a
    recomputing checkpoint). `recompute`: a
    compiled step's, gathered again once per lookup whose weight backward needs (the
    gather under a recomputing checkpoint, parallel/param_gather.py). Every parameter
    lookup is also kept in `events`, in order; `defer` leaves their traffic out of `out`,
    for `bucket_traffic` to replay them over the plan's buckets."""

    def __init__(self, plan: Plan, B: int, S: int, c: int, eager: bool, defer: bool = False,
                 recompute: bool = False, keep_shards: bool = False):
        self.plan, self.mesh = plan, plan.mesh
        self.B, self.S, self.c, self.eager, self.defer = B, S, c, eager, defer
        self.recompute, self.keep_shards = recompute, keep_shards
        # Full activation checkpointing, set while a block is walked: its recompute in
        # backward issues the block's activation collectives again (`_recomputed`).
        self.recompute_block = False
        self._last_replay: dict = {}
        self.out: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        self._acts: dict[tuple, tuple] = {}
        self.events: list[tuple] = []  # ("use" | "save", name, acts_on, saves, grad)
        self.loss_dims: tuple[int, ...] | None = None  # mesh dims the loss is a partial sum over

    # ---------------------------------------------------------------- placements
    def act(self, axes, partial=()) -> tuple:
        if axes not in self._acts:
            self._acts[axes] = tuple(_pl(p) for p in self.plan.activation(axes).placements)
        return tuple(P if i in partial else p for i, p in enumerate(self._acts[axes]))

    def compute(self, name) -> tuple:
        return tuple(_pl(p) for p in self.plan.params[name].compute_placements())

    def stored(self, name) -> tuple:
        return tuple(_pl(p) for p in self.plan.params[name].placements)

    def param_mesh(self, name):
        """The mesh a parameter's placements refer to (the expert mesh for expert weights)."""
        return self.plan.params[name].mesh

    def split_dims(self, name, dim) -> set[int]:
        return {i for i, p in enumerate(self.compute(name)) if p == ("S", dim)}

    def linear(self, x, w) -> tuple:
        """Placements of linear(x, w) (last dim 2)."""
        wp = self.compute(w)
        return tuple(("S", 2) if q == ("S", 0) else P if q == ("S", 1) and p == ("S", 2) else p
                     for p, q in zip(x, wp))

    def split_on(self, axes, dim) -> set[int]:
        """The mesh dims that split tensor dim `dim` of an activation with these logical axes."""
        return {i for i, p in enumerate(self.act(axes)) if p == ("S", dim)}

    @staticmethod
    def summed(a, b) -> tuple:
        """Placements of a + b: Partial where either addend is."""
        return tuple(P if P in (x, y) else x for x, y in zip(a, b))

    def grad_in(self, x, consumers) -> tuple:
        """Gradient of x arriving from column-parallel linear consumers."""
        split = set().union(*(self.split_dims(w, 0) for w in consumers))
        return tuple(P if i in split and p != ("S", 2) else p for i, p in enumerate(x))

    # ---------------------------------------------------------------- collectives
    def add(self, phase, op, i, nbytes, n=1, mesh=None):
        """n collectives of nbytes each over mesh dim i (of the dense mesh unless `mesh`)."""
        mesh = mesh or self.mesh
        if n and mesh.size(mesh.axes[i]) > 1:
            entry = self.out[(phase, op, mesh.axes[i])]
            entry[0] += n
            entry[1] += n * nbytes

    def add_group(self, phase, op, dims, nbytes, n=1, mesh=None):
        """n collectives of nbytes each over the group of mesh dims `dims` (of the dense
        mesh unless `mesh`: a parameter bucket's group, parallel/bucket_groups.py), named as
        `group_axes` names it."""
        mesh = mesh or self.mesh
        if n and math.prod(mesh.shape[i] for i in dims) > 1:
            entry = self.out[(phase, op, group_axes(mesh.axes, dims))]
            entry[0] += n
            entry[1] += n * nbytes

    def redistribute(self, phase, shape, cur, dst, itemsize, n=1, mesh=None):
        mesh = mesh or self.mesh
        add = lambda *a: self.add(*a, mesh=mesh)  # noqa: E731
        numel = lambda *a, **k: self._numel(*a, **k, mesh=mesh)  # noqa: E731
        cur = list(cur)
        # DTensor all-gathers innermost mesh dim first (undoing a nested split, e.g. a dim
        # over fsdp x cp), then takes the other changes in mesh order.
        gathers = [i for i, (a, b) in enumerate(zip(cur, dst)) if a[0] == "S" and b == R]
        for i in reversed(gathers):
            add(phase, "all_gather", i, itemsize * numel(shape, cur, pad=(i, cur[i][1])), n)
            cur[i] = R
        for i, (a, b) in enumerate(zip(cur, dst)):
            if a == b or a == R:
                cur[i] = b
                continue
            if a == P and b == R:
                add(phase, "all_reduce_sum", i, itemsize * numel(shape, cur), n)
            elif a == P:
                add(phase, "reduce_scatter_sum", i, itemsize * numel(shape, cur, pad=(i, b[1])), n)
            elif b == R:
                add(phase, "all_gather", i, itemsize * numel(shape, cur, pad=(i, a[1])), n)
            else:
                add(phase, "all_to_all_single", i, itemsize * numel(shape, cur), n)
            cur[i] = b

    def _numel(self, shape, pls, pad=None, mesh=None) -> int:
        """Local elements on the most loaded rank; `pad=(mesh dim, tensor dim)`: that dim
        whole over the mesh dim, padded to a multiple of its size."""
        mesh = mesh or self.mesh
        size = list(shape)
        for i, p in enumerate(pls):
            if p[0] == "S" and (i, p[1]) != pad:
                size[p[1]] = math.ceil(size[p[1]] / mesh.size(mesh.axes[i]))
        if pad is not None:
            k = mesh.size(mesh.axes[pad[0]])
            size[pad[1]] = math.ceil(size[pad[1]] / k) * k
        return math.prod(size)

    # ---------------------------------------------------------------- runtime calls
    def use(self, name, acts_on, saves=1, grad=None):
        """One `p[name]` lookup: gather, eager re-gathers (one per tensor autograd saves of
        it as a DTensor), gradient reduction. The gradient is Partial where `acts_on` (dense
        activations' placements) split the tokens, unless `grad` gives its placements; a
        parameter without gradient (not trainable) reduces nothing. Collectives run over
        the parameter's own mesh."""
        self.events.append(("use", name, acts_on, saves, grad))
        if not self.defer:
            self.param_traffic(name, acts_on, saves, grad)

    def reuse(self, name):
        """A parameter kept from its first lookup (`reused`: a tied table) used again where
        autograd saves it: nothing is gathered; eager, it is gathered again in backward."""
        self.events.append(("save", name, None, 1, None))
        if not self.defer:
            self.regather(name)

    def _dtype_bytes(self, name) -> int:
        spec = self.plan.params[name].spec
        return spec.dtype.itemsize if keeps_fp32(name) else self.c or spec.dtype.itemsize

    def regather(self, name, n=1):
        """`n` saved uses of the gathered `name`: gathered again in backward n times
        (eager) or once (compiled, recomputed)."""
        pp = self.plan.params[name]
        stored, compute = self.stored(name), self.compute(name)
        n = min(n, 1) if self.recompute else n if self.eager else 0
        if n and stored != compute:
            self.redistribute("bwd", pp.spec.shape, stored, compute, self._dtype_bytes(name), n=n, mesh=pp.mesh)

    def grad_of(self, name, acts_on, grad=None) -> tuple:
        """Placements of the gradient of a lookup of `name` (see `use`)."""
        if grad is not None:
            return grad
        return tuple(q if q != R else P if any(a[i][0] == "S" for a in acts_on) else R
                     for i, q in enumerate(self.compute(name)))

    def param_traffic(self, name, acts_on, saves=1, grad=None):
        """The collectives of one lookup of `name` with a collective of its own (`use`)."""
        pp = self.plan.params[name]
        spec, mesh = pp.spec, pp.mesh
        stored, compute = self.stored(name), self.compute(name)
        shape = spec.shape
        self.redistribute("fwd", shape, stored, compute, self._dtype_bytes(name), mesh=mesh)
        self.regather(name, saves)
        if not spec.trainable:
            return
        grad = self.grad_of(name, acts_on, grad)
        first = tuple(s if s != R else g for s, g in zip(stored, grad))
        self.redistribute("bwd", shape, grad, first, spec.dtype.itemsize, mesh=mesh)
        self.redistribute("bwd", shape, first, stored, spec.dtype.itemsize, mesh=mesh)

    def constrain(self, shape, src, dst, grad, saved: bool = True):
        """ctx.constrain from placements `src` to `dst`, its gradient arriving as `grad`.
        `saved`: autograd keeps the output (the normed input the matmuls read), so with
        keep_shards an all-gather is issued again in backward, once (in a recomputed
        block, by the recompute)."""
        with self._recomputed():
            self.redistribute("fwd", shape, src, dst, self.c or 4)
        self.redistribute("bwd", shape, grad, tuple(R if p == P else p for p in src), self.c or 4)
        gathers = src != dst and all(s == d or (s[0] == "S" and d == R) for s, d in zip(src, dst))
        if saved and self.keep_shards and gathers and not self.recompute_block:
            self.redistribute("bwd", shape, src, dst, self.c or 4)

    @contextlib.contextmanager
    def _recomputed(self):
        """The forward collectives issued inside: in a recomputed block, issued again in
        backward."""
        if not self.recompute_block:
            yield
            return
        before = {k: list(v) for k, v in self.out.items() if k[0] == "fwd"}
        yield
        self._last_replay = {}
        for (phase, op, axis), (n, nbytes) in list(self.out.items()):
            n0, b0 = before.get((phase, op, axis), (0, 0))
            if phase == "fwd" and n > n0:
                self._last_replay[("bwd", op, axis)] = (n - n0, nbytes - b0)
                entry = self.out[("bwd", op, axis)]
                entry[0] += n - n0
                entry[1] += nbytes - b0

    def end_recomputed_block(self):
        """A recompute stops once backward has what it needs: the block's last
        collective (its output's reduction) is not issued again."""
        for key, (n, nbytes) in self._last_replay.items():
            self.out[key][0] -= n
            self.out[key][1] -= nbytes
            if not self.out[key][0]:
                del self.out[key]
        self._last_replay = {}

    def attention(self, hq: int, hkv: int, hd: int):
        """ctx.attention over a sequence split on cp (parallel/cp_attention.py, section 5 of
        docs/parallelism.md): per rank, N = S / cp positions of the local rows."""
        if "cp" not in self.mesh.axes:
            return
        with self._recomputed():
            self._cp_attention(hq, hkv, hd)

    def _cp_attention(self, hq: int, hkv: int, hd: int):
        i, cp = self.mesh.axes.index("cp"), self.mesh.cp
        e = self.c or 4
        q = self._numel((self.B, self.S, hq, hd), self.act(("batch", "seq", "q_heads", None)))
        kv = 2 * self._numel((self.B, self.S, hkv, hd), self.act(("batch", "seq", "kv_heads", None)))
        comm = self.plan.cp_comm
        if comm == "allgather":  # K/V stacked; their gradients summed in fp32
            self.add("fwd", "all_gather", i, cp * kv * e)
            self.add("bwd", "reduce_scatter_sum", i, cp * kv * 4)
        elif comm == "ring":  # each hop: one send to the next rank, one receive from the previous
            for op in ("send", "recv"):
                self.add("fwd", op, i, kv * e, n=cp - 1)
                self.add("bwd", op, i, kv * e, n=cp - 1)
                self.add("bwd", op, i, kv * 4, n=cp)  # dK/dV travel home in fp32
        else:  # a2a: q, k, v in one all-to-all, the output in another; mirrored in backward
            for phase in ("fwd", "bwd"):
                self.add(phase, "all_to_all_single", i, (q + kv) * e)
                self.add(phase, "all_to_all_single", i, q * e)

    def embedding(self, table, ids_axes, dst_axes, shape, grad_partial=()):
        """constrain(ctx.embedding(ids, table), dst_axes): Partial over the table's vocab dims."""
        ids = self.act(ids_axes)
        src = tuple(P if i in self.split_dims(table, 0) else p for i, p in enumerate(ids)) + (R,)
        self.constrain(shape, src, self.act(dst_axes), self.act(dst_axes, grad_partial))

    def loss(self, logits):
        rows = self._numel((self.B, self.S), [p if p[0] == "S" and p[1] < 2 else R for p in logits])
        for i, p in enumerate(logits):
            if p == ("S", 2):
                self.add("fwd", "all_reduce_max", i, 4 * rows)
                self.add("fwd", "all_reduce_sum", i, 4 * 2 * rows)
        # The loss is a partial sum over the mesh dims that split the tokens: the step
        # reduces it (comms.step_collectives), once per step or once per micro-step.
        self.loss_dims = tuple(i for i, p in enumerate(logits) if p[0] == "S" and p[1] < 2)

    def moe(self, m, e: str, h, dim: int) -> tuple:
        """ctx.moe (parallel/sharded_moe.py) on the block input h (placements) of the MoE block
        whose parameters start with `e`: the router and expert weights' uses and every
        collective the plan sizes, the token all-to-alls at the uniform-routing expectation
        (comms.py's docstring). Returns the placements of the routed output."""
        B, S = self.B, self.S
        if m.balance == "aux_free":
            self.use(e + "expert_bias", [h], saves=0)  # not trainable: no gradient
        # Router and expert weights are used as local tensors (to_local); the eager runtime
        # swaps those for their shard too. The router is used in fp32 (models.policy).
        self.use(e + "router", [h])
        token_dims = {i for i, q in enumerate(h) if q[0] == "S"}
        partial_tokens = tuple(P if i in token_dims else R for i in range(len(h)))
        if m.balance == "aux":  # per-sequence sums (prob, counts) added up over cp, then the scalar over the batch
            per_sequence = tuple(P if q == ("S", 1) else q for q in h)
            summed = tuple(R if q == P else q for q in per_sequence)
            self.redistribute("fwd", (B, m.num_experts), per_sequence, summed, FP32, n=2)
            self.redistribute("fwd", (), tuple(P if q[0] == "S" else R for q in summed), (R,) * len(h), FP32)
        if m.z_loss_coef:
            self.redistribute("fwd", (), partial_tokens, (R,) * len(h), FP32)
        experts = [e + "w_gate", e + "w_up", e + "w_down"]
        em = self.param_mesh(experts[0])
        for name in experts:  # gradients Partial over the expert mesh's batch axes
            self.use(name, None, grad=tuple(P if a in ("dp", "fsdp", "cp") else q
                                            for a, q in zip(em.axes, self.compute(name))))
        tokens = self._numel((B, S), h)
        tp_split = "tp" in em.axes and self.compute(experts[0])[em.axes.index("tp")][0] == "S"
        if tp_split:  # CopyToTensorParallel: rows and gates, their gradients all-reduced over tp
            i = em.axes.index("tp")
            self.add("bwd", "all_reduce_sum", i, (self.c or 4) * tokens * dim, mesh=em)
            self.add("bwd", "all_reduce_sum", i, FP32 * tokens * m.top_k, mesh=em)
        if "ep" in em.axes:
            i, rows = em.axes.index("ep"), routed_rows(self, m)
            self.add("fwd", "all_to_all_single", i, INT64 * m.num_experts, mesh=em)  # the per-expert counts
            for phase in ("fwd", "bwd"):  # dispatch and combine, mirrored by autograd
                self.add(phase, "all_to_all_single", i, (self.c or 4) * rows * dim, n=2, mesh=em)
        return tuple(P if tp_split and a == "tp" else q for a, q in zip(self.mesh.axes, h))


def bucket_traffic(w: _Walker, events, unit, names, policy: Policy, prefetch: int = 1,
                   step: _Walker | None = None, unsharded: bool = False,
                   keep: bool = False) -> list[tuple[int, dict]]:
    """One micro-step's parameter traffic, into `w.out`, as a step with buckets
    (parallel/bucket_run.py, `unit` block or a size in MB) issues it. `events` are one
    forward's parameter lookups in order (`_Walker.events` of every block the rank runs,
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
      `unsharded` (parallel.fsdp_accumulate) the reduce-scatters too.
    - `keep` (a pp rank under parallel.pp_keep_gathered, with a walker that is neither
      eager nor recomputing): a bucket once gathered stays gathered, so it is gathered
      once however its lookups interleave with other buckets', and the gradients of all
      its lookups are reduced together, once.

    Returns the eager backward's gathers again, in the order backward issues them:
    (bucket index, {(phase, op, axis): [count, bytes]}) each."""
    plan = w.plan
    buckets, _ = plan_buckets(plan, unit)
    groups = {mesh: group_dims(buckets, plan, mesh) for mesh in {b.mesh for b in buckets}}
    bucket_of = {n: b.index for b in buckets for n in b.names}
    complete = {b.index for b in buckets if all(n in names for n in b.names)}
    cache: dict[int, list] = {}

    def sets_of(b: int) -> list:
        """(gather dims, compute dtype, member indices, padded elements per rank) per set."""
        if b not in cache:
            bucket = buckets[b]
            dtypes = [policy.param_dtype(m.name) or plan.params[m.name].spec.dtype for m in bucket.members]
            cache[b] = [(g, dtype, js, sum(math.prod(bucket.members[j].padded(bucket.mesh.shape)) for j in js))
                        for g, dtype, js in gather_sets(bucket, bucket.mesh.shape, dtypes)]
        return cache[b]

    def ways(b: int, dims) -> int:
        return math.prod(buckets[b].mesh.shape[i] for i in dims)

    def gather(b: int, phase: str, into: _Walker = w):
        for g, dtype, _, numel in sets_of(b):
            into.add_group(phase, "all_gather", g, ways(b, g) * numel * dtype.itemsize, mesh=buckets[b].mesh)

    def in_sets(b: int) -> set[int]:
        return {j for _, _, js, _ in sets_of(b) for j in js}

    def reduce(b: int, grads: dict):
        bucket = buckets[b]
        mesh, shape = bucket.mesh, bucket.mesh.shape
        for g, _, js, numel in sets_of(b):
            itemsize = plan.params[bucket.members[js[0]].name].spec.dtype.itemsize
            (step if unsharded and step is not None else w).add_group("bwd", "reduce_scatter_sum", g,
                                                                        ways(b, g) * numel * itemsize, mesh=mesh)
        data = tuple(i for i, a in enumerate(mesh.axes) if a in DATA_AXES and shape[i] > 1)
        gathered, partial = in_sets(b), defaultdict(int)
        for j, m in enumerate(bucket.members):
            spec, compute = plan.params[m.name].spec, w.compute(m.name)
            grad = grads.get(m.name) or tuple(P if i in data else q for i, q in enumerate(compute))
            done = set(m.gather) if j in gathered else set()
            dims = tuple(i for i, q in enumerate(grad) if q == P and i not in done and shape[i] > 1)
            if dims:
                numel = math.prod(m.padded(shape)) if j in gathered else w._numel(spec.shape, compute, mesh=mesh)
                partial[dims] += numel * spec.dtype.itemsize
        for dims, nbytes in partial.items():
            for group in ([dims] if dims in groups[mesh] else [(i,) for i in dims]):
                (step or w).add_group("bwd", "all_reduce_sum", group, nbytes, mesh=mesh)

    kept: dict[str, int | None] = {}  # reused parameters: the gather (index into calls) they came from
    live, pending = None, set()  # (bucket, call) gathered last; buckets whose gather was issued ahead
    calls: list[tuple[int, dict]] = []  # per bucket gather: (bucket, gradient placements by name)
    held: dict[int, int] = {}  # with `keep`: bucket -> its one gather (index into calls)
    saved: list[int] = []  # buckets of the saved uses of gathered members, in forward order
    for kind, name, acts_on, saves, grad in events:
        spec, b = plan.params[name].spec, bucket_of.get(name)
        if name in kept:
            call = kept[name]
        elif b in held:
            call = held[b]
        elif b in complete:
            if live is None or live[0] != b:
                if b in pending:
                    pending.discard(b)
                else:
                    gather(b, "fwd")
                calls.append((b, {}))
                live = (b, len(calls) - 1)
                for nb in range(b + 1, b + 1 + prefetch):
                    if nb in complete and nb not in pending:
                        pending.add(nb)
                        gather(nb, "fwd")
            call = live[1]
            if keep:
                held[b] = call
        else:
            call = None
        if call is None:
            if name in kept or kind == "save":
                w.regather(name, saves)  # kept from its own gather: only the saves
            else:
                w.param_traffic(name, acts_on, saves, grad)
        else:
            b = calls[call][0]
            if kind == "use" and spec.trainable:
                new, old = w.grad_of(name, acts_on, grad), calls[call][1].get(name)
                calls[call][1][name] = new if old is None else w.summed(old, new)
            if saves and buckets[b].names.index(name) in in_sets(b):
                saved += [b] * saves
        if kind == "use" and spec.reused and name not in kept:
            kept[name] = call
    regathers = []
    if w.eager:  # backward unpacks the saved tensors in the reverse order of their saves
        for i, b in reversed(list(enumerate(saved))):
            if i == len(saved) - 1 or saved[i + 1] != b:
                one = _Walker(plan, w.B, w.S, w.c, w.eager)
                gather(b, "bwd", one)
                gather(b, "bwd")
                regathers.append((b, dict(one.out)))
    elif w.recompute:  # compiled: each bucket autograd saved is gathered again once, recomputed
        for b in reversed(dict.fromkeys(saved)):
            gather(b, "bwd")
    for b, grads in calls:
        if grads:
            reduce(b, grads)
    return regathers


def routed_rows(w: _Walker, m) -> int:
    """Routing slots (rows of dim floats) one rank sends to the experts per MoE call: its
    T local tokens x top_k; with a capacity factor, what the experts keep of them at
    uniform routing (each expert gets T k / E and keeps at most its capacity)."""
    tokens = w._numel((w.B, w.S), w.act(TOKENS))
    rows = tokens * m.top_k
    if m.capacity_factor is not None:
        rows = min(rows, m.num_experts * expert_capacity(tokens, m.top_k, m.num_experts, m.capacity_factor))
    return rows
