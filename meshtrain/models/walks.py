"""Walks shared by the families' cost terms (models/family.py `Costs`): the token
embedding, and the head with its loss."""

from __future__ import annotations

from .family import BLOCK_IN, RESIDUAL, TOKENS


def walk_embed(w, cfg, tied_head: bool):
    """The token lookup. tied_head: this rank's head uses the table too; a tied table is
    then gathered once and kept (reused), and its one gradient sums both uses. The lookup
    saves no table (walk_head counts the projection's save)."""
    h, tokens = w.act(BLOCK_IN), w.act(TOKENS)
    w.use("tok_emb", [tokens, h] if tied_head else [tokens], saves=0)
    w.embedding("tok_emb", TOKENS, RESIDUAL, (w.B, w.S, cfg.dim))


def walk_head(w, cfg, table_used: bool, norm_bias: bool = False):
    """Final norm, output projection and loss. table_used: a tied table was already looked
    up on this rank (walk_embed), so it is not gathered again."""
    B, S, d = w.B, w.S, cfg.dim
    x, h = w.act(RESIDUAL), w.act(BLOCK_IN)
    out = "tok_emb" if cfg.tie_embeddings else "output"
    w.use("norm", [x])
    if norm_bias:
        w.use("norm_bias", [x], saves=0)
    w.constrain((B, S, d), x, h, w.grad_in(h, [out]))
    if not cfg.tie_embeddings:
        w.use("output", [h])
    elif not table_used:  # a pipeline's last stage: its own replica of the tied table
        w.use("tok_emb", [h])
    else:  # the table kept from the lookup: the projection saves it, here, for backward
        w.reuse("tok_emb")
    logits = w.act(("batch", "seq", "vocab"))
    w.constrain((B, S, cfg.vocab_size), w.linear(h, out), logits, logits)
    w.loss(logits)
