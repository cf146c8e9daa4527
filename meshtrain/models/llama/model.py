"""Llama-3 family: RMSNorm, RoPE (optional Llama-3 scaling), GQA, SwiGLU, tied or untied
embeddings; optionally mixture-of-experts blocks (Mixtral, Qwen3-MoE, DeepSeek-V3-style
routers), per-head q/k RMSNorm and a head dim of its own (Qwen3). Weights are
(out_features, in_features) as in Hugging Face."""

from __future__ import annotations

import math
from typing import Mapping

import torch

from ..blocks import mlp, moe, moe_specs, rms_head, rope_tables, swiglu_specs
from ..context import Documents, ModelContext
from ..layers import apply_rope, rms_norm
from ..spec import ParamSpec
from .config import LlamaConfig


def param_specs(cfg: LlamaConfig) -> dict[str, ParamSpec]:
    d, hd = cfg.dim, cfg.head_dim
    std = cfg.init_std
    # Output projections feed the residual stream once per block each: scale them so the
    # residual variance does not grow with depth (GPT-2 / Megatron convention).
    out_std = std / math.sqrt(2 * cfg.n_layers)
    specs = {"tok_emb": ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), std=std, reused=cfg.tie_embeddings)}
    moe_layers = cfg.moe_layers
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        specs[p + "attn_norm"] = ParamSpec((d,), ("norm",), init="ones")
        if cfg.qk_norm:
            specs[p + "attn.q_norm"] = ParamSpec((hd,), (None,), init="ones")
            specs[p + "attn.k_norm"] = ParamSpec((hd,), (None,), init="ones")
        specs[p + "attn.wq"] = ParamSpec((cfg.n_heads * hd, d), ("q_heads", "embed"), std=std, units=(hd, 1))
        specs[p + "attn.wk"] = ParamSpec((cfg.n_kv_heads * hd, d), ("kv_heads", "embed"), std=std, units=(hd, 1))
        specs[p + "attn.wv"] = ParamSpec((cfg.n_kv_heads * hd, d), ("kv_heads", "embed"), std=std, units=(hd, 1))
        specs[p + "attn.wo"] = ParamSpec((d, cfg.n_heads * hd), ("embed", "q_heads"), std=out_std, units=(1, hd))
        specs[p + "mlp_norm"] = ParamSpec((d,), ("norm",), init="ones")
        if i in moe_layers:
            specs.update(moe_specs(cfg.moe, d, p + "moe.", std, out_std))
        else:
            specs.update(swiglu_specs(p + "mlp.", d, cfg.ffn_dim, std, out_std))
    specs["norm"] = ParamSpec((d,), ("norm",), init="ones")
    if not cfg.tie_embeddings:
        specs["output"] = ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), std=std)
    return specs


def forward_stage(cfg: LlamaConfig, params: Mapping[str, torch.Tensor], x: torch.Tensor, ctx: ModelContext,
                  layers: tuple[int, int], first: bool, last: bool, docs: Documents | None = None) -> torch.Tensor:
    """One pipeline stage: layers [start, stop), after the embedding when `first` (x is
    then the tokens, else the residual stream (batch, seq, dim)), ending with the head
    when `last` (logits, else the residual stream). `params` needs only the stage's own.
    `docs`: packed documents' segments (attention) and positions (RoPE), per row."""
    p = ctx.bind(params)
    if first:
        tokens = ctx.constrain(x, ("batch", "seq"))
        x = ctx.constrain(ctx.embedding(tokens, p["tok_emb"]), ("batch", "seq_sp", None))
    cos, sin = rope_tables(ctx, x, docs, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    segments = None if docs is None or docs.segments is None else ctx.constrain(docs.segments, ("batch", "seq"))
    window = None if docs is None else docs.window
    for i in range(*layers):
        x = ctx.remat(_block, cfg, p, i, x, cos, sin, ctx, segments, window)
    return head(cfg, p, x, ctx) if last else x


def head(cfg: LlamaConfig, p: Mapping[str, torch.Tensor], x: torch.Tensor, ctx: ModelContext) -> torch.Tensor:
    """Final norm and output projection: logits of the residual stream x (bound params)."""
    return rms_head(p, x, cfg.norm_eps, "tok_emb" if cfg.tie_embeddings else "output", ctx)


def _block(cfg, p, i, x, cos, sin, ctx, segments=None, window=None):
    prefix = f"layers.{i}."
    x = x + _attention(cfg, p, prefix, x, cos, sin, ctx, segments, window)
    if i in cfg.moe_layers:
        return x + moe(cfg.moe, p, prefix, x, cfg.norm_eps, ctx)
    return x + mlp(p, prefix, x, cfg.norm_eps, ctx)


def _attention(cfg, p, prefix, x, cos, sin, ctx, segments, window):
    h = ctx.constrain(rms_norm(x, p[prefix + "attn_norm"], cfg.norm_eps), ("batch", "seq", None))
    hd = cfg.head_dim
    q = ctx.constrain(ctx.linear(h, p, prefix + "attn.wq").unflatten(-1, (-1, hd)), ("batch", "seq", "q_heads", None))
    k = ctx.constrain(ctx.linear(h, p, prefix + "attn.wk").unflatten(-1, (-1, hd)), ("batch", "seq", "kv_heads", None))
    v = ctx.constrain(ctx.linear(h, p, prefix + "attn.wv").unflatten(-1, (-1, hd)), ("batch", "seq", "kv_heads", None))
    if cfg.qk_norm:
        q = rms_norm(q, p[prefix + "attn.q_norm"], cfg.norm_eps)
        k = rms_norm(k, p[prefix + "attn.k_norm"], cfg.norm_eps)
    out = ctx.attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, segments, window).flatten(-2)
    return ctx.constrain(ctx.linear(out, p, prefix + "attn.wo"), ("batch", "seq_sp", None))
