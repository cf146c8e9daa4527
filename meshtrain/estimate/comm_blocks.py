"""The collectives of each model family's blocks, embedding and head, written as walks
over the plan's placements (walker.py); step_collectives (comms.py) adds them up."""

from __future__ import annotations

from ..models.experts import expert_capacity
from .walker import BLOCK_IN, FP32, INT64, RESIDUAL, TOKENS, P, R, _Walker


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

