"""GPT-2 family: LayerNorm, learned absolute positions, multi-head attention with biases,
GELU (tanh) MLP with biases, tied or untied output. Weights are (out_features,
in_features) as in Hugging Face (whose Conv1D stores them transposed).

Tensor parallelism: q/k/v and the MLP up-projection are column-parallel, so their biases
are split like their output dim (logical axes q_heads / mlp) and go inside F.linear. The
attention and MLP output projections are row-parallel: their biases are added after the
`constrain` that reduces the matmul's partial sums, so each is added once, not once per
tensor-parallel rank.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ..context import Documents, ModelContext
from ..layers import layer_norm
from ..spec import ParamSpec
from .config import GPT2Config


def param_specs(cfg: GPT2Config) -> dict[str, ParamSpec]:
    d, hd, f = cfg.dim, cfg.head_dim, cfg.ffn_dim
    std = cfg.init_std
    # Output projections feed the residual stream once per block each: scale them so the
    # residual variance does not grow with depth (GPT-2 convention).
    out_std = std / math.sqrt(2 * cfg.n_layers)
    specs = {
        "tok_emb": ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), std=std, reused=cfg.tie_embeddings),
        "pos_emb": ParamSpec((cfg.max_seq_len, d), ("positions", "embed"), std=std),
    }
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        specs[p + "attn_norm"] = ParamSpec((d,), ("norm",), init="ones")
        specs[p + "attn_norm_bias"] = ParamSpec((d,), ("norm",), init="zeros")
        for w in ("q", "k", "v"):
            specs[p + f"attn.w{w}"] = ParamSpec((d, d), ("q_heads", "embed"), std=std, units=(hd, 1))
            specs[p + f"attn.b{w}"] = ParamSpec((d,), ("q_heads",), init="zeros", units=(hd,))
        specs[p + "attn.wo"] = ParamSpec((d, d), ("embed", "q_heads"), std=out_std, units=(1, hd))
        specs[p + "attn.bo"] = ParamSpec((d,), ("embed",), init="zeros")
        specs[p + "mlp_norm"] = ParamSpec((d,), ("norm",), init="ones")
        specs[p + "mlp_norm_bias"] = ParamSpec((d,), ("norm",), init="zeros")
        specs[p + "mlp.w_up"] = ParamSpec((f, d), ("mlp", "embed"), std=std)
        specs[p + "mlp.b_up"] = ParamSpec((f,), ("mlp",), init="zeros")
        specs[p + "mlp.w_down"] = ParamSpec((d, f), ("embed", "mlp"), std=out_std)
        specs[p + "mlp.b_down"] = ParamSpec((d,), ("embed",), init="zeros")
    specs["norm"] = ParamSpec((d,), ("norm",), init="ones")
    specs["norm_bias"] = ParamSpec((d,), ("norm",), init="zeros")
    if not cfg.tie_embeddings:
        specs["output"] = ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), std=std)
    return specs


def forward_stage(cfg: GPT2Config, params: Mapping[str, torch.Tensor], x: torch.Tensor, ctx: ModelContext,
                  layers: tuple[int, int], first: bool, last: bool, docs: Documents | None = None) -> torch.Tensor:
    """One pipeline stage: layers [start, stop), after the token and position embeddings
    when `first` (x is then the tokens, else the residual stream (batch, seq, dim)),
    ending with the final norm and the head when `last` (logits, else the residual
    stream). `params` needs only the stage's own. `docs`: packed documents' segments
    (attention) and positions (the learned position embeddings), per row."""
    seq_len, start = x.shape[1], ctx.start_pos
    if start + seq_len > cfg.max_seq_len:
        raise ConfigError(f"positions up to {start + seq_len - 1} do not fit model.max_seq_len={cfg.max_seq_len} "
                          "(GPT-2 learns one embedding per position): use shorter sequences, generate fewer "
                          "tokens, or train with a larger max_seq_len")
    p = ctx.bind(params)
    if first:
        tokens = ctx.constrain(x, ("batch", "seq"))
        x = ctx.constrain(ctx.embedding(tokens, p["tok_emb"]), ("batch", "seq_sp", None))
        if docs is not None and docs.positions is not None:  # restarting at each document
            positions = ctx.constrain(docs.positions, ("batch", "seq"))
            pos = ctx.constrain(ctx.embedding(positions, p["pos_emb"]), ("batch", "seq_sp", None))
        else:
            positions = ctx.constrain(torch.arange(start, start + seq_len, device=tokens.device), ("seq",))
            pos = ctx.constrain(ctx.embedding(positions, p["pos_emb"]), ("seq_sp", None))
        x = x + pos
    segments = None if docs is None or docs.segments is None else ctx.constrain(docs.segments, ("batch", "seq"))
    window = None if docs is None else docs.window
    for i in range(*layers):
        x = ctx.remat(_block, cfg, p, f"layers.{i}.", x, ctx, segments, window)
    return head(cfg, p, x, ctx) if last else x


def head(cfg: GPT2Config, p: Mapping[str, torch.Tensor], x: torch.Tensor, ctx: ModelContext) -> torch.Tensor:
    """Final LayerNorm and output projection: logits of the residual stream x (bound params)."""
    x = ctx.constrain(layer_norm(x, p["norm"], p["norm_bias"], cfg.norm_eps), ("batch", "seq", None))
    logits = ctx.linear(x, p, "tok_emb" if cfg.tie_embeddings else "output")
    return ctx.constrain(logits, ("batch", "seq", "vocab"))


def _block(cfg, p, prefix, x, ctx, segments=None, window=None):
    x = x + _attention(cfg, p, prefix, x, ctx, segments, window)
    return x + _mlp(cfg, p, prefix, x, ctx)


def _attention(cfg, p, prefix, x, ctx, segments, window):
    h = layer_norm(x, p[prefix + "attn_norm"], p[prefix + "attn_norm_bias"], cfg.norm_eps)
    h = ctx.constrain(h, ("batch", "seq", None))
    hd = cfg.head_dim
    q, k, v = (ctx.constrain(ctx.linear(h, p, prefix + f"attn.w{w}", p[prefix + f"attn.b{w}"]).unflatten(-1, (-1, hd)),
                             ("batch", "seq", "q_heads", None)) for w in ("q", "k", "v"))
    out = ctx.attention(q, k, v, segments, window).flatten(-2)
    return ctx.constrain(ctx.linear(out, p, prefix + "attn.wo"), ("batch", "seq_sp", None)) + p[prefix + "attn.bo"]


def _mlp(cfg, p, prefix, x, ctx):
    h = layer_norm(x, p[prefix + "mlp_norm"], p[prefix + "mlp_norm_bias"], cfg.norm_eps)
    h = ctx.constrain(h, ("batch", "seq", None))
    up = F.gelu(ctx.linear(h, p, prefix + "mlp.w_up", p[prefix + "mlp.b_up"]), approximate="tanh")
    return ctx.constrain(ctx.linear(up, p, prefix + "mlp.w_down"), ("batch", "seq_sp", None)) + p[prefix + "mlp.b_down"]
