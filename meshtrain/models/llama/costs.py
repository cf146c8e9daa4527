"""The llama family's cost terms (models/family.py `Costs`): what its blocks keep for
backward beyond the shared terms, and its blocks, embedding and head as walks over the
estimator's walker (meshtrain/estimate/walker.py), one `w.use` per parameter lookup, in
model.py's order of lookups, and one `w.constrain` per `ctx.constrain` of model.py."""

from __future__ import annotations

from ..family import BLOCK_IN, RESIDUAL, Costs
from ..walks import walk_embed, walk_head

def per_sequence(cfg, seq_len: int, itemsize: int) -> list:
    """The RoPE tables: cos and sin (seq, head_dim) in the compute dtype."""
    return [((seq_len, cfg.head_dim), ("seq", None), 2 * itemsize)]


def weight_saved(cfg, name: str) -> bool:
    if name == "tok_emb":  # a lookup keeps ids; a tied table is kept by the head's matmul
        return cfg.tie_embeddings
    return not name.endswith(".moe.expert_bias")  # added to the scores, not multiplied


def _attention(w, cfg, p: str):
    B, S, d, hd = w.B, w.S, cfg.dim, cfg.head_dim
    x, h = w.act(RESIDUAL), w.act(BLOCK_IN)
    w.use(p + "attn_norm", [x])  # rms_norm saves the weight once
    qkv = [p + "attn.wq", p + "attn.wk", p + "attn.wv"]
    w.constrain((B, S, d), x, h, w.grad_in(h, qkv))
    for name, heads, n in zip(qkv, ("q_heads", "kv_heads", "kv_heads"), (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads)):
        w.use(name, [h])
        out = w.act(("batch", "seq", heads, None))
        w.constrain((B, S, n, hd), w.linear(h, name), out, out)
    if cfg.qk_norm:  # per-head norms on q / k: the tokens split their gradient
        w.use(p + "attn.q_norm", [w.act(("batch", "seq", "q_heads", None))])
        w.use(p + "attn.k_norm", [w.act(("batch", "seq", "kv_heads", None))])
    w.attention(cfg.n_heads, cfg.n_kv_heads, hd)
    q = w.act(("batch", "seq", "q_heads", None))
    w.use(p + "attn.wo", [q])
    w.constrain((B, S, d), w.linear(q, p + "attn.wo"), x, x)


def _swiglu(w, h, p: str) -> tuple:
    """The placements of a SwiGLU's output (w_gate, w_up, w_down under prefix p) on h."""
    for name in (p + "w_gate", p + "w_up"):
        w.use(name, [h])
    hidden = w.linear(h, p + "w_gate")
    w.use(p + "w_down", [hidden])
    return w.linear(hidden, p + "w_down")


def walk_block(w, cfg, p: str):
    B, S, d = w.B, w.S, cfg.dim
    x, h = w.act(RESIDUAL), w.act(BLOCK_IN)
    _attention(w, cfg, p)
    w.use(p + "mlp_norm", [x])
    w.constrain((B, S, d), x, h, w.grad_in(h, [p + "mlp.w_gate", p + "mlp.w_up"]))
    w.constrain((B, S, d), _swiglu(w, h, p + "mlp."), x, x)


def walk_moe_block(w, cfg, p: str):
    """An MoE block: attention as in a dense block, then the routed experts (ctx.moe) and
    the shared experts."""
    B, S, d, m = w.B, w.S, cfg.dim, cfg.moe
    x, h = w.act(RESIDUAL), w.act(BLOCK_IN)
    _attention(w, cfg, p)
    w.use(p + "mlp_norm", [x])
    e = p + "moe."
    shared = [e + "shared.w_gate", e + "shared.w_up"] if m.shared_experts else []
    # The routed path's gradient reaches h whole (tp copies all-reduced in ctx.moe); the
    # shared experts' column-parallel linears leave theirs Partial over tp.
    # h is saved by the shared experts' matmuls, or in fp32 by the router (bf16: its copy).
    w.constrain((B, S, d), x, h, w.grad_in(h, shared), saved=bool(shared) or w.c is None)
    out = w.moe(m, e, h, d)
    if shared:
        out = w.summed(out, _swiglu(w, h, e + "shared."))
    w.constrain((B, S, d), out, x, x)


COSTS = Costs(mlp_saved=4, per_sequence=per_sequence, weight_saved=weight_saved, walk_block=walk_block,
              walk_embed=walk_embed, walk_head=walk_head, walk_moe_block=walk_moe_block)
