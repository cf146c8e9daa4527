"""DeepSeek-V3: multi-head latent attention (models/mla.py), dense SwiGLU blocks first,
then mixture-of-experts blocks with a sigmoid, group-limited, bias-balanced router and a
shared expert (models/moe.py, models/blocks.py). Computes what transformers'
DeepseekV3ForCausalLM computes; weights are (out_features, in_features) as there."""

from __future__ import annotations

import math
from typing import Mapping

import torch

from ..blocks import mlp, moe, moe_specs, rms_head, rope_tables, swiglu_specs
from ..context import Documents, ModelContext
from ..layers import rms_norm
from ..mla import mla, mla_specs
from ..spec import ParamSpec
from .config import DeepseekV3Config


def param_specs(cfg: DeepseekV3Config) -> dict[str, ParamSpec]:
    d, std = cfg.dim, cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)  # as llama's: residual variance independent of depth
    specs = {"tok_emb": ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), std=std, reused=cfg.tie_embeddings)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        specs[p + "attn_norm"] = ParamSpec((d,), ("norm",), init="ones")
        specs.update(mla_specs(cfg.mla, p + "attn.", d, cfg.n_heads, std, out_std))
        specs[p + "mlp_norm"] = ParamSpec((d,), ("norm",), init="ones")
        if i in cfg.moe_layers:
            specs.update(moe_specs(cfg.moe, d, p + "moe.", std, out_std))
        else:
            specs.update(swiglu_specs(p + "mlp.", d, cfg.ffn_dim, std, out_std))
    specs["norm"] = ParamSpec((d,), ("norm",), init="ones")
    if not cfg.tie_embeddings:
        specs["output"] = ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), std=std)
    return specs


def forward_stage(cfg: DeepseekV3Config, params: Mapping[str, torch.Tensor], x: torch.Tensor, ctx: ModelContext,
                  layers: tuple[int, int], first: bool, last: bool, docs: Documents | None = None) -> torch.Tensor:
    """One pipeline stage, as llama's (models/family.py Family.forward_stage)."""
    p = ctx.bind(params)
    if first:
        tokens = ctx.constrain(x, ("batch", "seq"))
        x = ctx.constrain(ctx.embedding(tokens, p["tok_emb"]), ("batch", "seq_sp", None))
    cos, sin = rope_tables(ctx, x, docs, cfg.mla.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    segments = None if docs is None or docs.segments is None else ctx.constrain(docs.segments, ("batch", "seq"))
    window = None if docs is None else docs.window
    for i in range(*layers):
        x = ctx.remat(_block, cfg, p, i, x, cos, sin, ctx, segments, window)
    return head(cfg, p, x, ctx) if last else x


def head(cfg: DeepseekV3Config, p: Mapping[str, torch.Tensor], x: torch.Tensor, ctx: ModelContext) -> torch.Tensor:
    return rms_head(p, x, cfg.norm_eps, "tok_emb" if cfg.tie_embeddings else "output", ctx)


def _block(cfg, p, i, x, cos, sin, ctx, segments=None, window=None):
    prefix = f"layers.{i}."
    h = ctx.constrain(rms_norm(x, p[prefix + "attn_norm"], cfg.norm_eps), ("batch", "seq", None))
    attn = mla(cfg.mla, p, prefix + "attn.", h, cos, sin, ctx, cfg.norm_eps, cfg.q_gain, segments, window)
    x = x + ctx.constrain(attn, ("batch", "seq_sp", None))
    if i in cfg.moe_layers:
        return x + moe(cfg.moe, p, prefix, x, cfg.norm_eps, ctx)
    return x + mlp(p, prefix, x, cfg.norm_eps, ctx)
