"""What each runtime call of a recorded forward issues: the `Walker` plays a recording of
the family's own forward (models/recording.py: w.play) on the plan, evaluating its
layouts with the placement rules of placement_rules.py, counting the collectives of each
parameter lookup, constrain, attention and MoE call into its tally
(collective_tally.py) and keeping every parameter lookup in `events` for the bucket
replay (bucket_replay.py)."""

from __future__ import annotations

import contextlib

from ..models.experts import expert_capacity
from ..models.family import TOKENS
from ..models.policy import keeps_fp32
from ..models.recording import Attend, Constrain, Experts, Remat, Use
from ..layout.plan import Plan
from .collective_tally import CollectiveTally
from .dtype_bytes import FP32, INT64
from .placement_rules import P, R, PlacementRules, gathers, numel_on_rank


class Walker(PlacementRules):
    """Counts into `tally` the collectives of the runtime calls of a recorded forward.

    `eager`: gathered weights are dropped after forward and gathered again in backward
    where autograd saved them (an eager step with reshard_after_forward). `keep_shards`:
    an all-gathered activation autograd saves is kept as its shard and gathered again
    in backward, once (parallel/regather.py: eager `_FetchActivation`, compiled a
    recomputing checkpoint). `recompute`: a
    compiled step's, gathered again once per lookup whose weight backward needs (the
    gather under a recomputing checkpoint, parallel/param_gather.py). Every parameter
    lookup is also kept in `events`, in order; `defer` leaves their traffic out of the
    tally, for `bucket_traffic` to replay them over the plan's buckets."""

    def __init__(self, plan: Plan, B: int, S: int, c: int, eager: bool, defer: bool = False,
                 recompute: bool = False, keep_shards: bool = False):
        super().__init__(plan)
        self.B, self.S, self.c, self.eager, self.defer = B, S, c, eager, defer
        self.recompute, self.keep_shards = recompute, keep_shards
        # Full activation checkpointing: each ctx.remat region (a block) is recomputed in
        # backward, issuing its activation collectives again (`_recomputed`) but the last.
        self.full_checkpointing = False
        self.recompute_block = False  # inside such a region
        self.tally = CollectiveTally(plan.mesh)
        self.events: list[tuple] = []  # ("use" | "save", name, acts_on, saves, grad)
        self.loss_dims: tuple[int, ...] | None = None  # mesh dims the loss is a partial sum over
        self.losses = 0  # cross-entropies taken (the head's, each multi-token prediction module's)
        self.moe_calls = 0  # MoE blocks played

    def _numel(self, shape, pls) -> int:
        return numel_on_rank(shape, pls, self.mesh)

    def play(self, events):
        """A recording's events (models/recording.py), in order, on this plan."""
        for e in events:
            if isinstance(e, Use) and e.reuse:
                self.reuse(e.name, e.saves)
            elif isinstance(e, Use):
                self.use(e.name, [self.layout(a) for a in e.acts], e.saves,
                         grad=self.expert_grad(e.name) if e.experts else None)
            elif isinstance(e, Constrain):
                self.constrain(e.shape, self.layout(e.src), self.act(e.axes), self.constrain_grad(e), e.saved)
            elif isinstance(e, Attend):
                self.attention(e.q, e.k, e.v)
            elif isinstance(e, Experts):
                self.moe(e.moe, self.layout(e.h), e.dim, e.expert)
            elif isinstance(e, Remat):
                self.remat(e.begin)
            else:
                raise TypeError(f"not a recorded event: {e!r}")

    def constrain_grad(self, e: Constrain) -> tuple:
        """The gradient arriving at a constrain's output: partial over tp where
        column-parallel linears read it, over the dims that split what it was broadcast
        over (a position table added to every row), as it was placed otherwise."""
        dims = {i for wider, k in e.broadcast for i, p in enumerate(self.layout(wider)) if p[0] == "S" and p[1] < k}
        return self.grad_in(self.act(e.axes, dims), e.consumers)

    # ---------------------------------------------------------------- parameters
    def use(self, name, acts_on, saves=1, grad=None):
        """One `p[name]` lookup: gather, eager re-gathers (one per tensor autograd saves of
        it as a DTensor), gradient reduction. The gradient is Partial where `acts_on` (dense
        activations' placements) split the tokens, unless `grad` gives its placements; a
        parameter without gradient (not trainable) reduces nothing. Collectives run over
        the parameter's own mesh."""
        self.events.append(("use", name, acts_on, saves, grad))
        if not self.defer:
            self.param_traffic(name, acts_on, saves, grad)

    def reuse(self, name, saves=1):
        """A parameter kept from its first lookup (`reused`: a tied table) used again,
        autograd saving `saves` tensors of it: nothing is gathered; eager, it is gathered
        again in backward for each."""
        self.events.append(("save", name, None, saves, None))
        if not self.defer:
            self.regather(name, saves)

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
            self.tally.redistribute("bwd", pp.spec.shape, stored, compute, self._dtype_bytes(name), n=n,
                                    mesh=pp.mesh)

    def param_traffic(self, name, acts_on, saves=1, grad=None):
        """The collectives of one lookup of `name` with a collective of its own (`use`)."""
        pp = self.plan.params[name]
        spec, mesh = pp.spec, pp.mesh
        stored, compute = self.stored(name), self.compute(name)
        shape = spec.shape
        self.tally.redistribute("fwd", shape, stored, compute, self._dtype_bytes(name), mesh=mesh)
        self.regather(name, saves)
        if not spec.trainable:
            return
        grad = self.grad_of(name, acts_on, grad)
        first = tuple(s if s != R else g for s, g in zip(stored, grad))
        self.tally.redistribute("bwd", shape, grad, first, spec.dtype.itemsize, mesh=mesh)
        self.tally.redistribute("bwd", shape, first, stored, spec.dtype.itemsize, mesh=mesh)

    # ---------------------------------------------------------------- activations
    def constrain(self, shape, src, dst, grad, saved: bool = True):
        """ctx.constrain from placements `src` to `dst`, its gradient arriving as `grad`.
        `saved`: autograd keeps the output (the normed input the matmuls read), so with
        keep_shards an all-gather is issued again in backward, once (in a recomputed
        block, by the recompute)."""
        with self._recomputed():
            self.tally.redistribute("fwd", shape, src, dst, self.c or 4)
        self.tally.redistribute("bwd", shape, grad, tuple(R if p == P else p for p in src), self.c or 4)
        if saved and self.keep_shards and gathers(src, dst) and not self.recompute_block:
            self.tally.redistribute("bwd", shape, src, dst, self.c or 4)

    @contextlib.contextmanager
    def _recomputed(self):
        """The forward collectives issued inside: in a recomputed block, issued again in
        backward."""
        if not self.recompute_block:
            yield
            return
        with self.tally.replayed_in_backward():
            yield

    def remat(self, begin: bool):
        """A ctx.remat region begins or ends. Under full checkpointing backward recomputes
        it, but stops once it has what it needs: the region's last collective (its
        output's reduction) is not issued again."""
        if not self.full_checkpointing:
            return
        if not begin:
            self.tally.drop_last_replay()
        self.recompute_block = begin

    def attention(self, q: tuple, k: tuple, v: tuple):
        """ctx.attention on q, k, v of these global shapes over a sequence split on cp
        (parallel/cp_attention.py, section 5 of docs/parallelism.md): per rank, N = S / cp
        positions of the local rows."""
        if "cp" not in self.mesh.axes:
            return
        with self._recomputed():
            self._cp_attention(q, k, v)

    def _cp_attention(self, q_shape: tuple, k_shape: tuple, v_shape: tuple):
        i, cp, add = self.mesh.axes.index("cp"), self.mesh.cp, self.tally.add
        e = self.c or 4
        q = self._numel(q_shape, self.act(("batch", "seq", "q_heads", None)))
        heads = self.act(("batch", "seq", "kv_heads", None))
        v_shape = (*v_shape[:-1], max(v_shape[-1], k_shape[-1]))  # narrower values travel padded to the keys' width
        kv = self._numel(k_shape, heads) + self._numel(v_shape, heads)
        comm = self.plan.cp_comm
        if comm == "allgather":  # K/V stacked; their gradients summed in fp32
            add("fwd", "all_gather", i, cp * kv * e)
            add("bwd", "reduce_scatter_sum", i, cp * kv * 4)
        elif comm == "ring":  # each hop: one send to the next rank, one receive from the previous
            for op in ("send", "recv"):
                add("fwd", op, i, kv * e, n=cp - 1)
                add("bwd", op, i, kv * e, n=cp - 1)
                add("bwd", op, i, kv * 4, n=cp)  # dK/dV travel home in fp32
        else:  # a2a: q, k, v in one all-to-all, the output in another; mirrored in backward
            for phase in ("fwd", "bwd"):
                add(phase, "all_to_all_single", i, (q + kv) * e)
                add(phase, "all_to_all_single", i, q * e)

    def loss(self, logits):
        rows = self._numel((self.B, self.S), [p if p[0] == "S" and p[1] < 2 else R for p in logits])
        for i, p in enumerate(logits):
            if p == ("S", 2):
                self.tally.add("fwd", "all_reduce_max", i, 4 * rows)
                self.tally.add("fwd", "all_reduce_sum", i, 4 * 2 * rows)
        # The loss is a partial sum over the mesh dims that split the tokens: the step
        # reduces it (comms.step_collectives), once per step or once per micro-step.
        self.loss_dims = tuple(i for i, p in enumerate(logits) if p[0] == "S" and p[1] < 2)
        self.losses += 1

    def expert_grad(self, name) -> tuple:
        """An expert weight's gradient: partial over the expert mesh's batch axes (ctx.moe
        uses it whole, as a local tensor, on the tokens routed to it)."""
        em = self.param_mesh(name)
        return tuple(P if a in ("dp", "fsdp", "cp") else q for a, q in zip(em.axes, self.compute(name)))

    def moe(self, m, h, dim: int, expert: str):
        """ctx.moe (parallel/sharded_moe.py) on the block input h (placements), beside its
        parameters' lookups: the balancing terms' reductions, tp's copies and the token
        all-to-alls over ep at the uniform-routing expectation (comms.py's docstring);
        `expert` is the first expert weight's name."""
        B, S, tally = self.B, self.S, self.tally
        self.moe_calls += 1
        token_dims = {i for i, q in enumerate(h) if q[0] == "S"}
        partial_tokens = tuple(P if i in token_dims else R for i in range(len(h)))
        if m.balance == "aux":  # per-sequence sums (prob, counts) added up over cp, then the scalar over the batch
            per_sequence = tuple(P if q == ("S", 1) else q for q in h)
            summed = tuple(R if q == P else q for q in per_sequence)
            tally.redistribute("fwd", (B, m.num_experts), per_sequence, summed, FP32, n=2)
            tally.redistribute("fwd", (), tuple(P if q[0] == "S" else R for q in summed), (R,) * len(h), FP32)
        if m.z_loss_coef:
            tally.redistribute("fwd", (), partial_tokens, (R,) * len(h), FP32)
        em = self.param_mesh(expert)
        tokens = self._numel((B, S), h)
        if self.moe_tp_split(expert):  # CopyToTensorParallel: rows and gates, their gradients all-reduced over tp
            i = em.axes.index("tp")
            tally.add("bwd", "all_reduce_sum", i, (self.c or 4) * tokens * dim, mesh=em)
            tally.add("bwd", "all_reduce_sum", i, FP32 * tokens * m.top_k, mesh=em)
        if "ep" in em.axes:
            i, rows = em.axes.index("ep"), routed_rows(self, m)
            tally.add("fwd", "all_to_all_single", i, INT64 * m.num_experts, mesh=em)  # the per-expert counts
            for phase in ("fwd", "bwd"):  # dispatch and combine, mirrored by autograd
                tally.add(phase, "all_to_all_single", i, (self.c or 4) * rows * dim, n=2, mesh=em)


def routed_rows(w: Walker, m) -> int:
    """Routing slots (rows of dim floats) one rank sends to the experts per MoE call: its
    T local tokens x top_k; with a capacity factor, what the experts keep of them at
    uniform routing (each expert gets T k / E and keeps at most its capacity)."""
    tokens = w._numel((w.B, w.S), w.act(TOKENS))
    rows = tokens * m.top_k
    if m.capacity_factor is not None:
        rows = min(rows, m.num_experts * expert_capacity(tokens, m.top_k, m.num_experts, m.capacity_factor))
    return rows
