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
    # With multi-token prediction the modules read the embedding and the head again.
    again = cfg.mtp.depth > 0
    specs = {"tok_emb": ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), std=std, reused=cfg.tie_embeddings or again)}
    for i in range(cfg.n_layers):
        specs.update(_block_specs(cfg, f"layers.{i}.", i in cfg.moe_layers, std, out_std))
    specs["norm"] = ParamSpec((d,), ("norm",), init="ones")
    if not cfg.tie_embeddings:
        specs["output"] = ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), std=std, reused=again)
    for k in range(cfg.mtp.depth):  # after the head: they run after it
        specs.update(_mtp_specs(cfg, f"mtp.{k}.", std, out_std))
    return specs


def _block_specs(cfg: DeepseekV3Config, p: str, moe_block: bool, std: float, out_std: float) -> dict:
    d = cfg.dim
    specs = {p + "attn_norm": ParamSpec((d,), ("norm",), init="ones")}
    specs.update(mla_specs(cfg.mla, p + "attn.", d, cfg.n_heads, std, out_std))
    specs[p + "mlp_norm"] = ParamSpec((d,), ("norm",), init="ones")
    if moe_block:
        specs.update(moe_specs(cfg.moe, d, p + "moe.", std, out_std))
    else:
        specs.update(swiglu_specs(p + "mlp.", d, cfg.ffn_dim, std, out_std))
    return specs


def _mtp_specs(cfg: DeepseekV3Config, p: str, std: float, out_std: float) -> dict:
    """A multi-token prediction module: norms of the token embedding and of the hidden
    state, their projection back to dim, a block (MoE when the model has experts, as
    DeepSeek-V3's), and its own final norm; embedding and head are the model's."""
    d = cfg.dim
    specs = {p + "enorm": ParamSpec((d,), ("norm",), init="ones"), p + "hnorm": ParamSpec((d,), ("norm",), init="ones"),
             p + "eh_proj": ParamSpec((d, 2 * d), ("embed", None), std=std)}
    specs.update(_block_specs(cfg, p, cfg.moe is not None, std, out_std))
    specs[p + "norm"] = ParamSpec((d,), ("norm",), init="ones")
    return specs


def forward_stage(cfg: DeepseekV3Config, params: Mapping[str, torch.Tensor], x: torch.Tensor, ctx: ModelContext,
                  layers: tuple[int, int], first: bool, last: bool, docs: Documents | None = None) -> torch.Tensor:
    """One pipeline stage, as llama's (models/family.py Family.forward_stage)."""
    p = ctx.bind(params)
    x, _ = _layers(cfg, p, x, ctx, layers, first, docs)
    return head(cfg, p, x, ctx) if last else x


def forward_mtp(cfg: DeepseekV3Config, params: Mapping[str, torch.Tensor], x: torch.Tensor, ctx: ModelContext,
                layers: tuple[int, int], first: bool, ahead: list,
                docs: Documents | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The last stage (the whole model when layers are all of them and `first`) with its
    multi-token prediction modules (models/mtp.py): the logits, and each depth's;
    ahead[k-1] holds the ids (batch, seq) of the tokens k positions ahead. One binding of
    the parameters for all of it (a sharded context gathers each once)."""
    p = ctx.bind(params)
    h, tables = _layers(cfg, p, x, ctx, layers, first, docs)
    return head(cfg, p, h, ctx), _mtp(cfg, p, h, ahead, ctx, tables)


def _layers(cfg, p, x, ctx, layers, first, docs):
    """Blocks [start, stop) on bound parameters, after the embedding when `first`; and
    what they attended with (RoPE tables, segments, window), which MTP's blocks reuse."""
    if first:
        tokens = ctx.constrain(x, ("batch", "seq"))
        x = ctx.constrain(ctx.embedding(tokens, p["tok_emb"]), ("batch", "seq_sp", None))
    cos, sin = rope_tables(ctx, x, docs, cfg.mla.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    segments = None if docs is None or docs.segments is None else ctx.constrain(docs.segments, ("batch", "seq"))
    window = None if docs is None else docs.window
    for i in range(*layers):
        x = ctx.remat(_block, cfg, p, f"layers.{i}.", i in cfg.moe_layers, x, cos, sin, ctx, segments, window)
    return x, (cos, sin, segments, window)


def head(cfg: DeepseekV3Config, p: Mapping[str, torch.Tensor], x: torch.Tensor, ctx: ModelContext) -> torch.Tensor:
    return rms_head(p, x, cfg.norm_eps, "tok_emb" if cfg.tie_embeddings else "output", ctx)


def _block(cfg, p, prefix, moe_block, x, cos, sin, ctx, segments=None, window=None):
    h = ctx.constrain(rms_norm(x, p[prefix + "attn_norm"], cfg.norm_eps), ("batch", "seq", None))
    attn = mla(cfg.mla, p, prefix + "attn.", h, cos, sin, ctx, cfg.norm_eps, cfg.q_gain, segments, window)
    x = x + ctx.constrain(attn, ("batch", "seq_sp", None))
    if moe_block:
        return x + moe(cfg.moe, p, prefix, x, cfg.norm_eps, ctx)
    return x + mlp(p, prefix, x, cfg.norm_eps, ctx)


def _mtp(cfg, p, h, ahead, ctx, tables):
    """Each depth's logits: h is the last block's output before the final norm, `tables`
    what the blocks attended with."""
    cos, sin, segments, window = tables
    out = []
    for k, ids in enumerate(ahead):
        pre = f"mtp.{k}."
        e = ctx.embedding(ctx.constrain(ids, ("batch", "seq")), p["tok_emb"])
        e = rms_norm(ctx.constrain(e, ("batch", "seq_sp", None)), p[pre + "enorm"], cfg.norm_eps)
        x = torch.cat([e, rms_norm(h, p[pre + "hnorm"], cfg.norm_eps)], -1)
        h = ctx.constrain(ctx.linear(x, p, pre + "eh_proj"), ("batch", "seq_sp", None))
        h = ctx.remat(_block, cfg, p, pre, cfg.moe is not None, h, cos, sin, ctx, segments, window)
        out.append(rms_head(p, h, cfg.norm_eps, "tok_emb" if cfg.tie_embeddings else "output", ctx, norm=pre + "norm"))
    return out
