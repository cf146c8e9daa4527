"""Every collective of one training step, predicted from the plan alone (`meshtrain plan`).

`step_collectives` walks the model the way `ShardedContext` (context.py) and `step`
(train/step.py) run it, with placements as plain data and no process group, so it works
on a pure plan at any world size. One block is walked once and multiplied by the layer
count. It is an explicit model of the runtime, not a trace of it:
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
| `update` | | one fp32 scalar all-reduce over the world (optimizer phase, once per step) |

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
output, reduce_scatter the input, all_reduce the tensor. Ops are named as it names them
(`all_gather`, `reduce_scatter_sum`, `all_reduce_sum`, `all_reduce_max`); an all-reduce
over the whole world of a mesh with several dims has axis "world".
"""

from __future__ import annotations

import math
from collections import defaultdict

from torch.distributed.tensor import Shard

from ..errors import ConfigError
from ..models import ModelDef
from .plan import Plan

R, P = ("R",), ("P",)
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
        return tuple(_pl(p) for p in self.plan.params[name].compute_placements(self.mesh))

    def stored(self, name) -> tuple:
        return tuple(_pl(p) for p in self.plan.params[name].placements)

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
    def add(self, phase, op, i, nbytes, n=1):
        if n and self.mesh.size(self.mesh.axes[i]) > 1:
            entry = self.out[(phase, op, self.mesh.axes[i])]
            entry[0] += n
            entry[1] += n * nbytes

    def redistribute(self, phase, shape, cur, dst, itemsize, n=1):
        cur = list(cur)
        # DTensor all-gathers innermost mesh dim first (undoing a nested split, e.g. a dim
        # over fsdp x cp), then takes the other changes in mesh order.
        gathers = [i for i, (a, b) in enumerate(zip(cur, dst)) if a[0] == "S" and b == R]
        for i in reversed(gathers):
            self.add(phase, "all_gather", i, itemsize * self._numel(shape, cur, pad=(i, cur[i][1])), n)
            cur[i] = R
        for i, (a, b) in enumerate(zip(cur, dst)):
            if a == b or a == R:
                cur[i] = b
                continue
            if a == P and b == R:
                self.add(phase, "all_reduce_sum", i, itemsize * self._numel(shape, cur), n)
            elif a == P:
                self.add(phase, "reduce_scatter_sum", i, itemsize * self._numel(shape, cur, pad=(i, b[1])), n)
            elif b == R:
                self.add(phase, "all_gather", i, itemsize * self._numel(shape, cur, pad=(i, a[1])), n)
            else:
                self.add(phase, "all_to_all_single", i, itemsize * self._numel(shape, cur), n)
            cur[i] = b

    def _numel(self, shape, pls, pad=None) -> int:
        """Local elements on the most loaded rank; `pad=(mesh dim, tensor dim)`: that dim
        whole over the mesh dim, padded to a multiple of its size."""
        size = list(shape)
        for i, p in enumerate(pls):
            if p[0] == "S" and (i, p[1]) != pad:
                size[p[1]] = math.ceil(size[p[1]] / self.mesh.size(self.mesh.axes[i]))
        if pad is not None:
            k = self.mesh.size(self.mesh.axes[pad[0]])
            size[pad[1]] = math.ceil(size[pad[1]] / k) * k
        return math.prod(size)

    # ---------------------------------------------------------------- runtime calls
    def use(self, name, acts_on, saves=1):
        """One `p[name]` lookup: gather, eager re-gathers, gradient reduction."""
        spec = self.plan.params[name].spec
        stored, compute = self.stored(name), self.compute(name)
        shape, c = spec.shape, self.c or spec.dtype.itemsize
        self.redistribute("fwd", shape, stored, compute, c)
        if self.eager and stored != compute:
            self.redistribute("bwd", shape, stored, compute, c, n=saves)
        grad = tuple(q if q != R else P if any(a[i][0] == "S" for a in acts_on) else R
                     for i, q in enumerate(compute))
        first = tuple(s if s != R else g for s, g in zip(stored, grad))
        self.redistribute("bwd", shape, grad, first, spec.dtype.itemsize)
        self.redistribute("bwd", shape, first, stored, spec.dtype.itemsize)

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

def _llama_block(w: _Walker, cfg, p: str):
    B, S, d, hd = w.B, w.S, cfg.dim, cfg.head_dim
    x, h = w.act(RESIDUAL), w.act(BLOCK_IN)
    w.use(p + "attn_norm", [x])  # rms_norm saves the weight once
    qkv = [p + "attn.wq", p + "attn.wk", p + "attn.wv"]
    w.constrain((B, S, d), x, h, w.grad_in(h, qkv))
    for name, heads, n in zip(qkv, ("q_heads", "kv_heads", "kv_heads"), (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads)):
        w.use(name, [h])
        out = w.act(("batch", "seq", heads, None))
        w.constrain((B, S, n, hd), w.linear(h, name), out, out)
    w.attention(cfg.n_heads, cfg.n_kv_heads, hd)
    q = w.act(("batch", "seq", "q_heads", None))
    w.use(p + "attn.wo", [q])
    w.constrain((B, S, d), w.linear(q, p + "attn.wo"), x, x)
    w.use(p + "mlp_norm", [x])
    mlp = [p + "mlp.w_gate", p + "mlp.w_up"]
    w.constrain((B, S, d), x, h, w.grad_in(h, mlp))
    for name in mlp:
        w.use(name, [h])
    hidden = w.linear(h, mlp[0])
    w.use(p + "mlp.w_down", [hidden])
    w.constrain((B, S, d), w.linear(hidden, p + "mlp.w_down"), x, x)


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


def step_collectives(plan: Plan, model: ModelDef, *, micro_batch_rows: int, seq_len: int, micro_steps: int,
                     precision: str = "fp32", compiled: bool = False, layers: int | None = None,
                     embedding: bool = True, head: bool = True) -> list[dict]:
    """The collectives of one optimizer step: dicts {axis, op, phase, count, bytes}, one per
    (axis, op, phase); bytes are the total per rank over the step. `micro_batch_rows` is
    the sequences of one micro-step over all data-parallel ranks (micro_batch x dp x fsdp).
    A pipeline rank (plan: the stage plan without pp) runs `layers` layers and the
    embedding and head only where it holds them; its point-to-point traffic is counted by
    meshtrain/pipeline/estimate.py."""
    family = model.family.__name__.rsplit(".", 1)[-1]
    if family not in FAMILIES:
        raise ConfigError(f"collective estimate: no table for model family {family!r}")
    if precision not in ("fp32", "bf16"):
        raise ConfigError(f"train.precision={precision!r}: choose fp32 or bf16")
    data = plan.mesh.dp * plan.mesh.fsdp
    if micro_batch_rows % data:
        raise ConfigError(f"{micro_batch_rows} sequences per micro-step cannot be split over {data} "
                          "data-parallel ranks (dp x fsdp)")
    c = 2 if precision == "bf16" else None  # None: parameters' own dtype
    block, rest = (_Walker(plan, micro_batch_rows, seq_len, c, eager=not compiled) for _ in range(2))
    FAMILIES[family](block, model.cfg, "layers.0.")
    gpt2, tied = family == "gpt2", model.cfg.tie_embeddings
    if embedding:
        _embed(rest, model.cfg, gpt2, tied_head=tied and head)
    if head:
        _head(rest, model.cfg, gpt2, table_used=embedding)
    total: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for part, times in ((block, model.cfg.n_layers if layers is None else layers), (rest, 1)):
        for key, (n, nbytes) in part.out.items():
            total[key][0] += n * times * micro_steps
            total[key][1] += nbytes * times * micro_steps
    if plan.mesh.world > 1:  # the squared grad norm, fp32, over the world
        axis = plan.mesh.axes[0] if len(plan.mesh.axes) == 1 else "world"
        total[("opt", "all_reduce_sum", axis)] = [1, 4]
    return [{"axis": axis, "op": op, "phase": PHASES[phase], "count": n, "bytes": nbytes}
            for (phase, op, axis), (n, nbytes) in sorted(total.items(), key=lambda kv: (list(PHASES).index(kv[0][0]), kv[0]))]
