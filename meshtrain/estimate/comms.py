"""Every collective of one training step, predicted from the plan alone (`meshtrain plan`).

`step_collectives` walks the model the way `ShardedContext` (context.py) and `step`
(train/step.py) run it, with placements as plain data and no process group, so it works
on a pure plan at any world size. One dense block and one MoE block are each walked once
and multiplied by how many of them the model has. It is an explicit model of the runtime,
not a trace of it:
`tests/test_comms_estimate.py` runs real steps on the fake process group and checks that
this table and the runtime issue the same collectives (count and bytes per axis, op and
phase), so a change to one without the other fails there.

What each runtime call issues (one micro-step; `redistribute` below is the DTensor rule
per mesh dim: P->R all-reduce, P->S reduce-scatter, S->R all-gather, R->S and equal
placements nothing, S(i)->S(j) all-to-all):

| call | forward | backward |
|---|---|---|
| parameter lookup (`_UseParam`) | stored -> compute placements (all-gather over fsdp), compute dtype | gradient, in the parameter dtype, redistributed to the stored dims first (reduce-scatter), then to the replicated ones (all-reduce of the shard) |
| the same, eager (`compiled=False`) | | the gather again for every tensor autograd saved of it (`saves` below) |
| `constrain(x)` | source -> target placements | incoming gradient -> source, its Partials taken as Replicate |
| `embedding` (vocab split) | output Partial over the table's vocab dims | none (the table gradient is Partial over token-sharding dims) |
| `attention` (sequence split over cp) | allgather: one all-gather of K/V; a2a: two all-to-alls; ring: cp-1 sends (and receives) of a K/V block | allgather: one fp32 reduce-scatter of dK/dV; a2a: two all-to-alls; ring: cp-1 K/V blocks and cp fp32 dK/dV blocks sent |
| `cross_entropy_sum` | all-reduce max (rows) and sum (2 x rows) per vocab dim, fp32; all-reduce of the scalar per token-sharding dim | none |
| `moe` (MoE block, context.py) | router and expert weights gathered (experts over the expert mesh's fsdp); balance == "aux": the per-sequence sums (prob, counts; fp32, (batch, E)) all-reduced over cp, then the scalar loss over each batch dim; z_loss_coef > 0: the scalar over each token-splitting dim; ep > 1: one all-to-all of the per-expert counts (int64, E), then the routed rows out (dispatch) and back (combine) | gradients back as for any lookup, and eager re-gathers of what autograd keeps (the experts; the router in fp32 only, bf16 keeps its fp32 copy); experts Partial over the expert mesh's dp/fsdp; experts split over tp: rows (c) and gates (fp32) all-reduced over tp; ep > 1: the two row all-to-alls mirrored |
| `update` | | one fp32 scalar all-reduce over the world (optimizer phase, once per step) |
| the step's MoE load | the per-expert load (MoE layers x E, fp32), summed over micro-steps, all-reduced over each token-splitting dim once per step, after `update` (so forward by the recorder's phases) | |

A parameter's gradient is Partial on a mesh dim where it is used Replicated on an
activation sharded on that dim (batch, or the sequence under SP), Shard where it is used
sharded. A linear's output is Shard(last) where its weight splits dim 0, Partial where
it splits dim 1 against a Shard(last) input; its input gradient is Partial where the
weight splits dim 0. Assumptions: the batch is given as full tensors (counting targets
and the logged loss need no collective); activations and their gradients move in the
compute dtype; uneven shards are padded to a multiple of the group (as DTensor does);
when one redistribute changes several mesh dims, the all-gathers go first, innermost
mesh dim first, and the rest follow in mesh order (as DTensor does); compiled
steps issue what eager steps do, minus the backward re-gathers (not counted by a test).

Bytes are per rank, as tests/test_collectives.py records them: all_gather the gathered
output, reduce_scatter the input, all_reduce the tensor, all_to_all_single the input
(the part a rank sends to itself included). Ops are named as it names them
(`all_gather`, `reduce_scatter_sum`, `all_reduce_sum`, `all_reduce_max`,
`all_to_all_single`); an all-reduce over the whole world of a mesh with several dims has
axis "world". Expert weights live on the expert mesh (`plan.mesh.experts()`, fsdp x cp
refolded as fsdp x ep): their collectives are named by its axes (its "fsdp" is the
refolded group, counted under "fsdp" with the dense one).

Expert all-to-alls (axis "ep", MoE blocks with ep > 1) are routing-dependent; everything
else in an MoE block is sized by the plan and counted exactly. Their count is exact: per
MoE block per micro-step, forward: one of the counts (int64, E elements) and two of token
rows (dispatch, combine); backward: two (autograd mirrors dispatch and combine). Their
bytes are the uniform-routing expectation: each rank routes its T local tokens x top_k
rows of `dim` elements in the compute dtype (with a capacity factor, at most E x the
capacity of them are kept), and receives as many as it sends, so each of the four row
all-to-alls has T x top_k x dim x c bytes of input. Dropless, the forward dispatch and
the backward of the combine are exactly that whatever the routing; the other two move
the rows that this rank's experts received. Of these bytes, the fraction (ep - 1) / ep
is expected to leave the rank (the rest are rows for its own experts, which the
collective copies locally): `expert_exchange` gives both per MoE layer per micro-step.
"""

from __future__ import annotations

import math
from collections import defaultdict

from torch.distributed.tensor import Shard

from ..errors import ConfigError
from ..models import ModelDef
from ..models.experts import expert_capacity
from ..models.policy import keeps_fp32
from ..parallel.plan import Plan

R, P = ("R",), ("P",)
FP32, INT64 = 4, 8
RESIDUAL, BLOCK_IN, TOKENS = ("batch", "seq_sp", None), ("batch", "seq", None), ("batch", "seq")
PHASES = {"fwd": "forward", "bwd": "backward", "opt": "optimizer"}


def _pl(p) -> tuple:
    return ("S", p.dim) if isinstance(p, Shard) else R  # _StridedShard is a Shard


class _Walker:
    """Accumulates (phase, op, axis) -> [count, bytes] while a family table walks the model."""

    def __init__(self, plan: Plan, B: int, S: int, c: int, eager: bool):
        self.plan, self.mesh = plan, plan.mesh
        self.B, self.S, self.c, self.eager = B, S, c, eager
        self.out: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        self._acts: dict[tuple, tuple] = {}

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
        pp = self.plan.params[name]
        spec, mesh = pp.spec, pp.mesh
        stored, compute = self.stored(name), self.compute(name)
        shape, c = spec.shape, spec.dtype.itemsize if keeps_fp32(name) else self.c or spec.dtype.itemsize
        self.redistribute("fwd", shape, stored, compute, c, mesh=mesh)
        if self.eager and stored != compute:
            self.redistribute("bwd", shape, stored, compute, c, n=saves, mesh=mesh)
        if not spec.trainable:
            return
        if grad is None:
            grad = tuple(q if q != R else P if any(a[i][0] == "S" for a in acts_on) else R
                         for i, q in enumerate(compute))
        first = tuple(s if s != R else g for s, g in zip(stored, grad))
        self.redistribute("bwd", shape, grad, first, spec.dtype.itemsize, mesh=mesh)
        self.redistribute("bwd", shape, first, stored, spec.dtype.itemsize, mesh=mesh)

    def constrain(self, shape, src, dst, grad):
        self.redistribute("fwd", shape, src, dst, self.c or 4)
        self.redistribute("bwd", shape, grad, tuple(R if p == P else p for p in src), self.c or 4)

    def attention(self, hq: int, hkv: int, hd: int):
        """ctx.attention over a sequence split on cp (parallel/cp_attention.py, section 5 of
        docs/parallelism.md): per rank, N = S / cp positions of the local rows."""
        if "cp" not in self.mesh.axes:
            return
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
        for i, p in enumerate(logits):
            if p[0] == "S" and p[1] < 2:
                self.add("fwd", "all_reduce_sum", i, 4)


# -------------------------------------------------------------------- family tables
# Each mirrors its model's forward: every parameter lookup (with the activation it meets
# and how many tensors autograd saves of it) and every ctx.constrain (source layout,
# target, and the layout of the gradient that comes back).

def _llama_attention(w: _Walker, cfg, p: str):
    B, S, d, hd = w.B, w.S, cfg.dim, cfg.head_dim
    x, h = w.act(RESIDUAL), w.act(BLOCK_IN)
    w.use(p + "attn_norm", [x])  # rms_norm saves the weight once
    qkv = [p + "attn.wq", p + "attn.wk", p + "attn.wv"]
    w.constrain((B, S, d), x, h, w.grad_in(h, qkv))
    for name, heads, n in zip(qkv, ("q_heads", "kv_heads", "kv_heads"), (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads)):
        w.use(name, [h])
        out = w.act(("batch", "seq", heads, None))
        w.constrain((B, S, n, hd), w.linear(h, name), out, out)
    if getattr(cfg, "qk_norm", False):  # per-head norms on q / k: the tokens split their gradient
        w.use(p + "attn.q_norm", [w.act(("batch", "seq", "q_heads", None))])
        w.use(p + "attn.k_norm", [w.act(("batch", "seq", "kv_heads", None))])
    w.attention(cfg.n_heads, cfg.n_kv_heads, hd)
    q = w.act(("batch", "seq", "q_heads", None))
    w.use(p + "attn.wo", [q])
    w.constrain((B, S, d), w.linear(q, p + "attn.wo"), x, x)


def _llama_block(w: _Walker, cfg, p: str):
    B, S, d = w.B, w.S, cfg.dim
    x, h = w.act(RESIDUAL), w.act(BLOCK_IN)
    _llama_attention(w, cfg, p)
    w.use(p + "mlp_norm", [x])
    mlp = [p + "mlp.w_gate", p + "mlp.w_up"]
    w.constrain((B, S, d), x, h, w.grad_in(h, mlp))
    for name in mlp:
        w.use(name, [h])
    hidden = w.linear(h, mlp[0])
    w.use(p + "mlp.w_down", [hidden])
    w.constrain((B, S, d), w.linear(hidden, p + "mlp.w_down"), x, x)


def _routed_rows(w: _Walker, m) -> int:
    """Routing slots (rows of dim floats) one rank sends to the experts per MoE call: its
    T local tokens x top_k; with a capacity factor, what the experts keep of them at
    uniform routing (each expert gets T k / E and keeps at most its capacity)."""
    tokens = w._numel((w.B, w.S), w.act(TOKENS))
    rows = tokens * m.top_k
    if m.capacity_factor is not None:
        rows = min(rows, m.num_experts * expert_capacity(tokens, m.top_k, m.num_experts, m.capacity_factor))
    return rows


def _llama_moe_block(w: _Walker, cfg, p: str):
    """An MoE block: attention as in a dense block, then ShardedContext.moe (context.py)
    and the shared experts, with every collective that the plan sizes; the token
    all-to-alls at the uniform-routing expectation (module docstring)."""
    B, S, d, m = w.B, w.S, cfg.dim, cfg.moe
    x, h = w.act(RESIDUAL), w.act(BLOCK_IN)
    _llama_attention(w, cfg, p)
    w.use(p + "mlp_norm", [x])
    e = p + "moe."
    shared = [e + "shared.w_gate", e + "shared.w_up"] if m.shared_experts else []
    # The routed path's gradient reaches h whole (tp copies all-reduced in ctx.moe); the
    # shared experts' column-parallel linears leave theirs Partial over tp.
    w.constrain((B, S, d), x, h, w.grad_in(h, shared))
    if m.balance == "aux_free":
        w.use(e + "expert_bias", [h], saves=0)  # not trainable: no gradient
    # Router and expert weights are used as local tensors (to_local); the eager runtime
    # swaps those for their shard too. The router is used in fp32 (models.policy).
    w.use(e + "router", [h])
    token_dims = {i for i, q in enumerate(h) if q[0] == "S"}
    partial_tokens = tuple(P if i in token_dims else R for i in range(len(h)))
    if m.balance == "aux":  # per-sequence sums (prob, counts) added up over cp, then the scalar over the batch
        per_sequence = tuple(P if q == ("S", 1) else q for q in h)
        summed = tuple(R if q == P else q for q in per_sequence)
        w.redistribute("fwd", (B, m.num_experts), per_sequence, summed, FP32, n=2)
        w.redistribute("fwd", (), tuple(P if q[0] == "S" else R for q in summed), (R,) * len(h), FP32)
    if m.z_loss_coef:
        w.redistribute("fwd", (), partial_tokens, (R,) * len(h), FP32)
    experts = [e + "w_gate", e + "w_up", e + "w_down"]
    em = w.param_mesh(experts[0])
    for name in experts:  # gradients Partial over the expert mesh's batch axes
        w.use(name, None, grad=tuple(P if a in ("dp", "fsdp", "cp") else q
                                              for a, q in zip(em.axes, w.compute(name))))
    tokens = w._numel((B, S), h)
    tp_split = "tp" in em.axes and w.compute(experts[0])[em.axes.index("tp")][0] == "S"
    if tp_split:  # CopyToTensorParallel: rows and gates, their gradients all-reduced over tp
        i = em.axes.index("tp")
        w.add("bwd", "all_reduce_sum", i, (w.c or 4) * tokens * d, mesh=em)
        w.add("bwd", "all_reduce_sum", i, FP32 * tokens * m.top_k, mesh=em)
    if "ep" in em.axes:
        i, rows = em.axes.index("ep"), _routed_rows(w, m)
        w.add("fwd", "all_to_all_single", i, INT64 * m.num_experts, mesh=em)  # the per-expert counts
        for phase in ("fwd", "bwd"):  # dispatch and combine, mirrored by autograd
            w.add(phase, "all_to_all_single", i, (w.c or 4) * rows * d, n=2, mesh=em)
    out = tuple(P if tp_split and a == "tp" else q for a, q in zip(w.mesh.axes, h))
    if shared:
        for name in shared:
            w.use(name, [h])
        hidden = w.linear(h, shared[0])
        w.use(e + "shared.w_down", [hidden])
        out = tuple(P if P in (a, b) else a for a, b in zip(out, w.linear(hidden, e + "shared.w_down")))
    w.constrain((B, S, d), out, x, x)


def _gpt2_block(w: _Walker, cfg, p: str):
    B, S, d, hd = w.B, w.S, cfg.dim, cfg.head_dim
    x, h = w.act(RESIDUAL), w.act(BLOCK_IN)
    q = w.act(("batch", "seq", "q_heads", None))
    w.use(p + "attn_norm", [x])
    w.use(p + "attn_norm_bias", [x], saves=0)  # added, not saved
    qkv = [p + f"attn.w{n}" for n in "qkv"]
    w.constrain((B, S, d), x, h, w.grad_in(h, qkv))
    for n in "qkv":
        w.use(p + f"attn.w{n}", [h])
        w.use(p + f"attn.b{n}", [h], saves=0)  # bias inside F.linear: its gradient sums tokens
        w.constrain((B, S, cfg.n_heads, hd), w.linear(h, p + f"attn.w{n}"), q, q)
    w.attention(cfg.n_heads, cfg.n_heads, hd)
    w.use(p + "attn.wo", [q])
    w.constrain((B, S, d), w.linear(q, p + "attn.wo"), x, x)
    w.use(p + "attn.bo", [x], saves=0)  # added after the constrain
    w.use(p + "mlp_norm", [x])
    w.use(p + "mlp_norm_bias", [x], saves=0)
    w.constrain((B, S, d), x, h, w.grad_in(h, [p + "mlp.w_up"]))
    w.use(p + "mlp.w_up", [h])
    w.use(p + "mlp.b_up", [h], saves=0)
    hidden = w.linear(h, p + "mlp.w_up")
    w.use(p + "mlp.w_down", [hidden])
    w.constrain((B, S, d), w.linear(hidden, p + "mlp.w_down"), x, x)
    w.use(p + "mlp.b_down", [x], saves=0)


def _embed(w: _Walker, cfg, gpt2: bool, tied_head: bool):
    """The token (and GPT-2 position) lookups. tied_head: the same rank's head uses the
    table too; a tied table is then gathered once and kept (reused), and its one gradient
    sums both uses."""
    B, S, d = w.B, w.S, cfg.dim
    x, h, tokens = w.act(RESIDUAL), w.act(BLOCK_IN), w.act(TOKENS)
    w.use("tok_emb", [tokens, h] if tied_head else [tokens], saves=int(tied_head))
    w.embedding("tok_emb", TOKENS, RESIDUAL, (B, S, d))
    if gpt2:  # positions: (seq,) ids, (seq_sp, None) rows; the broadcast add sums their gradient over batch
        w.use("pos_emb", [w.act(("seq",))], saves=0)
        batch_dims = {i for i, p in enumerate(x) if p == ("S", 0)}
        w.embedding("pos_emb", ("seq",), ("seq_sp", None), (S, d), grad_partial=batch_dims)


def _head(w: _Walker, cfg, gpt2: bool, table_used: bool):
    """Final norm, output projection and loss. table_used: a tied table was already looked
    up on this rank (by `_embed`), so it is not gathered again."""
    B, S, d = w.B, w.S, cfg.dim
    x, h = w.act(RESIDUAL), w.act(BLOCK_IN)
    out = "tok_emb" if cfg.tie_embeddings else "output"
    w.use("norm", [x])
    if gpt2:
        w.use("norm_bias", [x], saves=0)
    w.constrain((B, S, d), x, h, w.grad_in(h, [out]))
    if not cfg.tie_embeddings:
        w.use("output", [h])
    elif not table_used:  # a pipeline's last stage: its own replica of the tied table
        w.use("tok_emb", [h])
    logits = w.act(("batch", "seq", "vocab"))
    w.constrain((B, S, cfg.vocab_size), w.linear(h, out), logits, logits)
    w.loss(logits)


FAMILIES = {"llama": _llama_block, "gpt2": _gpt2_block}
MOE_BLOCKS = {"llama": _llama_moe_block}


def _block_kinds(model: ModelDef, layers) -> dict[str, list[int]]:
    """The layer indices a rank runs, by kind ("dense", "moe"). `layers`: None (all), a
    count (the first that many; only without MoE blocks) or the indices themselves."""
    cfg = model.cfg
    moe = set(getattr(cfg, "moe_layers", ()) or ())
    if layers is None:
        ids = list(range(cfg.n_layers))
    elif isinstance(layers, int):
        if moe:
            raise ConfigError("collective estimate: a layer count cannot say which blocks are MoE; give the "
                              "layer indices (as the pipeline estimate does)")
        ids = list(range(layers))
    else:
        ids = list(layers)
    return {"dense": [i for i in ids if i not in moe], "moe": [i for i in ids if i in moe]}


def step_collectives(plan: Plan, model: ModelDef, *, micro_batch_rows: int, seq_len: int, micro_steps: int,
                     precision: str = "fp32", compiled: bool = False, layers=None,
                     embedding: bool = True, head: bool = True) -> list[dict]:
    """The collectives of one optimizer step: dicts {axis, op, phase, count, bytes}, one per
    (axis, op, phase); bytes are the total per rank over the step. `micro_batch_rows` is
    the sequences of one micro-step over all data-parallel ranks (micro_batch x dp x fsdp).
    A pipeline rank (plan: the stage plan without pp) runs `layers` layers (a count, or
    their indices) and the embedding and head only where it holds them; its point-to-point
    traffic is counted by meshtrain/estimate/pipeline.py. Dense and MoE blocks are each
    walked once (their first layer) and multiplied by how many of them run."""
    family = model.family.__name__.rsplit(".", 1)[-1]
    if family not in FAMILIES:
        raise ConfigError(f"collective estimate: no table for model family {family!r}")
    if precision not in ("fp32", "bf16", "fp8"):
        raise ConfigError(f"train.precision={precision!r}: choose fp32, bf16 or fp8")
    c = _check_batch(plan, micro_batch_rows, precision)
    kinds = _block_kinds(model, layers)
    if kinds["moe"] and family not in MOE_BLOCKS:
        raise ConfigError(f"collective estimate: no MoE table for model family {family!r}")
    walk = lambda: _Walker(plan, micro_batch_rows, seq_len, c, eager=not compiled)  # noqa: E731
    parts = []  # (walker, times per micro-step)
    for kind, table in (("dense", FAMILIES[family]), ("moe", MOE_BLOCKS.get(family))):
        if kinds[kind]:
            block = walk()
            table(block, model.cfg, f"layers.{kinds[kind][0]}.")
            parts.append((block, len(kinds[kind])))
    rest = walk()
    gpt2, tied = family == "gpt2", model.cfg.tie_embeddings
    if embedding:
        _embed(rest, model.cfg, gpt2, tied_head=tied and head)
    if head:
        _head(rest, model.cfg, gpt2, table_used=embedding)
    parts.append((rest, 1))
    total: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for part, times in parts:
        for key, (n, nbytes) in part.out.items():
            total[key][0] += n * times * micro_steps
            total[key][1] += nbytes * times * micro_steps
    if kinds["moe"]:  # the per-expert load (MoE layers x E, fp32), summed over micro-steps, all-reduced
        once = walk()  # once per step, after the update (outside it: counted as forward, as recorded)
        tokens = once.act(BLOCK_IN)
        once.redistribute("fwd", (len(kinds["moe"]), model.cfg.moe.num_experts),
                          tuple(P if q[0] == "S" else R for q in tokens), (R,) * len(tokens), FP32)
        for key, (n, nbytes) in once.out.items():
            total[key][0] += n
            total[key][1] += nbytes
    if plan.mesh.world > 1:  # the squared grad norm, fp32, over the world
        axis = plan.mesh.axes[0] if len(plan.mesh.axes) == 1 else "world"
        total[("opt", "all_reduce_sum", axis)] = [1, 4]
    return [{"axis": axis, "op": op, "phase": PHASES[phase], "count": n, "bytes": nbytes}
            for (phase, op, axis), (n, nbytes) in sorted(total.items(), key=lambda kv: (list(PHASES).index(kv[0][0]), kv[0]))]


def _check_batch(plan: Plan, micro_batch_rows: int, precision: str):
    """The compute dtype's bytes (None: each parameter's own) after checking the batch splits."""
    data = plan.mesh.dp * plan.mesh.fsdp
    if micro_batch_rows % data:
        raise ConfigError(f"{micro_batch_rows} sequences per micro-step cannot be split over {data} "
                          "data-parallel ranks (dp x fsdp)")
    return 2 if precision in ("bf16", "fp8") else None  # fp8: bf16 gathers and activations


def expert_exchange(plan: Plan, model: ModelDef, *, micro_batch_rows: int, seq_len: int,
                    precision: str = "fp32") -> dict | None:
    """The expert all-to-alls over ep of one MoE layer in one micro-step, per rank, at the
    uniform-routing expectation (module docstring); None without MoE blocks or with ep 1.
    rows: routing slots the rank sends (T local tokens x top_k); bytes: the four token
    all-to-alls (dispatch and combine, forward and backward) as step_collectives counts
    them (the whole input, the rows that stay on the rank included) plus the counts
    exchange; leaving_bytes: the expected share that leaves the rank, (ep - 1) / ep."""
    cfg = model.cfg
    moe_layers = getattr(cfg, "moe_layers", ()) or ()
    if not moe_layers or plan.mesh.experts().ep == 1:
        return None
    if precision not in ("fp32", "bf16", "fp8"):
        raise ConfigError(f"train.precision={precision!r}: choose fp32, bf16 or fp8")
    c = _check_batch(plan, micro_batch_rows, precision) or 4
    w = _Walker(plan, micro_batch_rows, seq_len, c, eager=True)
    ep, m = plan.mesh.experts().ep, cfg.moe
    rows = _routed_rows(w, m)
    tokens = 4 * c * rows * cfg.dim
    counts = INT64 * m.num_experts
    return {"ep": ep, "moe_layers": len(moe_layers), "rows": rows, "row_bytes": c * cfg.dim,
            "all_to_alls": 5, "token_bytes": tokens, "counts_bytes": counts, "bytes": tokens + counts,
            "leaving_bytes": (tokens + counts) * (ep - 1) // ep}
