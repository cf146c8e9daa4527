"""The gpt2 family's cost terms (models/family.py `Costs`): learned positions, biases that
keep nothing for backward, and its block, embedding and head as walks over the
estimator's walker (meshtrain/estimate/walker.py), one `w.use` per parameter lookup, in
model.py's order of lookups (buckets of a size in MB may split a block), and one
`w.constrain` per `ctx.constrain` of model.py."""

from __future__ import annotations

from ..family import BLOCK_IN, RESIDUAL, Costs
from ..walks import walk_embed as _walk_token_embedding
from ..walks import walk_head as _walk_head

INT64 = 8


def per_sequence(cfg, seq_len: int, itemsize: int) -> list:
    """The position ids (seq,) the position lookup keeps."""
    return [((seq_len,), ("seq",), INT64)]


def weight_saved(cfg, name: str) -> bool:
    if name == "tok_emb":  # a lookup keeps ids; a tied table is kept by the head's matmul
        return cfg.tie_embeddings
    leaf = name.rsplit(".", 1)[-1]
    return not (name == "pos_emb" or leaf.startswith("b") or leaf.endswith("norm_bias"))


def walk_block(w, cfg, p: str):
    B, S, d, hd = w.B, w.S, cfg.dim, cfg.head_dim
    x, h = w.act(RESIDUAL), w.act(BLOCK_IN)
    q = w.act(("batch", "seq", "q_heads", None))
    w.use(p + "attn_norm", [x])
    w.use(p + "attn_norm_bias", [x], saves=0)  # added, not saved
    qkv = [p + f"attn.w{n}" for n in "qkv"]
    w.constrain((B, S, d), x, h, w.grad_in(h, qkv))
    for n in "qkv":  # the bias is looked up first: it is an argument of ctx.linear
        w.use(p + f"attn.b{n}", [h], saves=0)  # bias inside F.linear: its gradient sums tokens
        w.use(p + f"attn.w{n}", [h])
        w.constrain((B, S, cfg.n_heads, hd), w.linear(h, p + f"attn.w{n}"), q, q)
    w.attention(cfg.n_heads, cfg.n_heads, hd)
    w.use(p + "attn.wo", [q])
    w.constrain((B, S, d), w.linear(q, p + "attn.wo"), x, x)
    w.use(p + "attn.bo", [x], saves=0)  # added after the constrain
    w.use(p + "mlp_norm", [x])
    w.use(p + "mlp_norm_bias", [x], saves=0)
    w.constrain((B, S, d), x, h, w.grad_in(h, [p + "mlp.w_up"]))
    w.use(p + "mlp.b_up", [h], saves=0)
    w.use(p + "mlp.w_up", [h])
    hidden = w.linear(h, p + "mlp.w_up")
    w.use(p + "mlp.w_down", [hidden])
    w.constrain((B, S, d), w.linear(hidden, p + "mlp.w_down"), x, x)
    w.use(p + "mlp.b_down", [x], saves=0)


def walk_embed(w, cfg, tied_head: bool):
    """Token and position lookups: positions are (seq,) ids and (seq_sp, None) rows; the
    broadcast add sums their gradient over the batch."""
    _walk_token_embedding(w, cfg, tied_head)
    w.use("pos_emb", [w.act(("seq",))], saves=0)
    w.embedding("pos_emb", ("seq",), ("seq_sp", None), (w.S, cfg.dim), grad_partial=w.split_on(RESIDUAL, 0))


def walk_head(w, cfg, table_used: bool):
    _walk_head(w, cfg, table_used, norm_bias=True)


COSTS = Costs(mlp_saved=2, per_sequence=per_sequence, weight_saved=weight_saved, walk_block=walk_block,
              walk_embed=walk_embed, walk_head=walk_head, mlp_matmuls=1, norm_stats=2)
