"""Llama-3 family: RMSNorm, RoPE (optional Llama-3 scaling), GQA, SwiGLU, tied or untied
embeddings; optionally mixture-of-experts blocks (Mixtral, Qwen3-MoE, DeepSeek-V3-style
routers), per-head q/k RMSNorm and a head dim of its own (Qwen3). Weights are
(out_features, in_features) as in Hugging Face."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .context import LocalContext, ModelContext
from .layers import (
    KVCache,
    apply_rope,
    cached_attention,
    rms_norm,
    rope_cos_sin,
    rope_frequencies,
    rope_table,
)
from .moe import MoeConfig
from .spec import ParamSpec


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 688
    vocab_size: int = 512
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    moe: MoeConfig | None = None
    qk_norm: bool = False
    attn_head_dim: int | None = None  # None: dim // n_heads

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.moe.moe_layers(self.n_layers) if self.moe else ()

    def __post_init__(self) -> None:
        if self.attn_head_dim is None and self.dim % self.n_heads:
            raise ConfigError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: "
                              "choose a dim that is a multiple of n_heads")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads="
                              f"{self.n_kv_heads}: GQA needs whole groups of query heads per kv head; choose "
                              "n_kv_heads dividing n_heads")
        if self.head_dim % 2:
            raise ConfigError(f"head dim {self.head_dim} (model.dim / model.n_heads) is odd: RoPE needs "
                              "an even head dim; choose dim and n_heads with an even ratio")


_LLAMA31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}

PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    "llama3-1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                             vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
                             rope_scaling={**_LLAMA31_SCALING, "factor": 32.0}, tie_embeddings=True),
    "llama3-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                             vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
                             rope_scaling=_LLAMA31_SCALING),
    "llama3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                              vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
                              rope_scaling=_LLAMA31_SCALING),
    "llama3-405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                               vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
                               rope_scaling=_LLAMA31_SCALING),
}


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
            specs.update(_moe_specs(cfg, p + "moe.", std, out_std))
        else:
            specs[p + "mlp.w_gate"] = ParamSpec((cfg.ffn_dim, d), ("mlp", "embed"), std=std)
            specs[p + "mlp.w_up"] = ParamSpec((cfg.ffn_dim, d), ("mlp", "embed"), std=std)
            specs[p + "mlp.w_down"] = ParamSpec((d, cfg.ffn_dim), ("embed", "mlp"), std=out_std)
    specs["norm"] = ParamSpec((d,), ("norm",), init="ones")
    if not cfg.tie_embeddings:
        specs["output"] = ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), std=std)
    return specs


def _moe_specs(cfg: LlamaConfig, p: str, std: float, out_std: float) -> dict[str, ParamSpec]:
    """Router (E, dim); experts stacked on a leading `experts` dim (E, ffn, dim) and
    (E, dim, ffn); shared experts as one SwiGLU of shared_experts x expert_ffn_dim."""
    m, d = cfg.moe, cfg.dim
    e, f = m.num_experts, m.expert_ffn_dim
    specs = {p + "router": ParamSpec((e, d), (None, "embed"), std=std),
             p + "w_gate": ParamSpec((e, f, d), ("experts", "mlp", "embed"), std=std),
             p + "w_up": ParamSpec((e, f, d), ("experts", "mlp", "embed"), std=std),
             p + "w_down": ParamSpec((e, d, f), ("experts", "embed", "mlp"), std=out_std)}
    if m.balance == "aux_free":
        specs[p + "expert_bias"] = ParamSpec((e,), (None,), init="zeros", trainable=False)
    if m.shared_experts:
        fs = m.shared_experts * f
        specs[p + "shared.w_gate"] = ParamSpec((fs, d), ("mlp", "embed"), std=std)
        specs[p + "shared.w_up"] = ParamSpec((fs, d), ("mlp", "embed"), std=std)
        specs[p + "shared.w_down"] = ParamSpec((d, fs), ("embed", "mlp"), std=out_std)
    return specs


def forward(cfg: LlamaConfig, params: Mapping[str, torch.Tensor], tokens: torch.Tensor,
            ctx: ModelContext) -> torch.Tensor:
    """Logits (batch, seq, vocab) for `tokens` (batch, seq)."""
    return forward_stage(cfg, params, tokens, ctx, (0, cfg.n_layers), first=True, last=True)


def forward_stage(cfg: LlamaConfig, params: Mapping[str, torch.Tensor], x: torch.Tensor, ctx: ModelContext,
                  layers: tuple[int, int], first: bool, last: bool) -> torch.Tensor:
    """One pipeline stage: layers [start, stop), after the embedding when `first` (x is
    then the tokens, else the residual stream (batch, seq, dim)), ending with the head
    when `last` (logits, else the residual stream). `params` needs only the stage's own."""
    p = ctx.bind(params)
    seq_len = x.shape[1]
    if first:
        tokens = ctx.constrain(x, ("batch", "seq"))
        x = ctx.constrain(ctx.embedding(tokens, p["tok_emb"]), ("batch", "seq_sp", None))
    # On the activations' device: a plain tensor on the CPU would meet CUDA q/k under the
    # LocalContext (the ShardedContext moves constants to the mesh's device itself).
    cos, sin = rope_cos_sin(seq_len, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, x.device)
    cos, sin = (ctx.constrain(t.to(x.dtype), ("seq", None)) for t in (cos, sin))
    for i in range(*layers):
        x = ctx.remat(_block, cfg, p, i, x, cos, sin, ctx)
    if not last:
        return x
    x = ctx.constrain(rms_norm(x, p["norm"], cfg.norm_eps), ("batch", "seq", None))
    logits = ctx.linear(x, p, "tok_emb" if cfg.tie_embeddings else "output")
    return ctx.constrain(logits, ("batch", "seq", "vocab"))


def _block(cfg, p, i, x, cos, sin, ctx):
    prefix = f"layers.{i}."
    x = x + _attention(cfg, p, prefix, x, cos, sin, ctx)
    if i in cfg.moe_layers:
        return x + _moe(cfg, p, prefix, x, ctx)
    return x + _mlp(p, prefix, x, cfg.norm_eps, ctx)


def _attention(cfg, p, prefix, x, cos, sin, ctx):
    h = ctx.constrain(rms_norm(x, p[prefix + "attn_norm"], cfg.norm_eps), ("batch", "seq", None))
    hd = cfg.head_dim
    q = ctx.constrain(ctx.linear(h, p, prefix + "attn.wq").unflatten(-1, (-1, hd)), ("batch", "seq", "q_heads", None))
    k = ctx.constrain(ctx.linear(h, p, prefix + "attn.wk").unflatten(-1, (-1, hd)), ("batch", "seq", "kv_heads", None))
    v = ctx.constrain(ctx.linear(h, p, prefix + "attn.wv").unflatten(-1, (-1, hd)), ("batch", "seq", "kv_heads", None))
    if cfg.qk_norm:
        q = rms_norm(q, p[prefix + "attn.q_norm"], cfg.norm_eps)
        k = rms_norm(k, p[prefix + "attn.k_norm"], cfg.norm_eps)
    out = ctx.attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v).flatten(-2)
    return ctx.constrain(ctx.linear(out, p, prefix + "attn.wo"), ("batch", "seq_sp", None))


def _swiglu(p, prefix, h, ctx):
    gate = F.silu(ctx.linear(h, p, prefix + "w_gate")) * ctx.linear(h, p, prefix + "w_up")
    return ctx.linear(gate, p, prefix + "w_down")


def _mlp(p, prefix, x, eps, ctx):
    h = ctx.constrain(rms_norm(x, p[prefix + "mlp_norm"], eps), ("batch", "seq", None))
    return ctx.constrain(_swiglu(p, prefix + "mlp.", h, ctx), ("batch", "seq_sp", None))


def _moe(cfg, p, prefix, x, ctx):
    m = cfg.moe
    h = ctx.constrain(rms_norm(x, p[prefix + "mlp_norm"], cfg.norm_eps), ("batch", "seq", None))
    e = prefix + "moe."
    bias = p[e + "expert_bias"] if m.balance == "aux_free" else None
    out = ctx.moe(h, m, p[e + "router"], bias, p[e + "w_gate"], p[e + "w_up"], p[e + "w_down"])
    if m.shared_experts:
        out = out + _swiglu(p, e + "shared.", h, ctx)
    return ctx.constrain(out, ("batch", "seq_sp", None))


# --------------------------------------------------------------------------- decoding
#
# Inference with a KV cache: `decode` runs the prompt (prefill) and then one token at a
# time, each call reading the keys and values of earlier positions from the cache instead
# of recomputing them. It is plain single-device code (no ModelContext): parameters are
# used in their own dtype.


def init_cache(cfg: LlamaConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> KVCache:
    """An empty cache for `max_len` positions (at most cfg.max_seq_len is meaningful)."""
    return KVCache.empty(cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim, dtype, device)


def decode(cfg: LlamaConfig, params: Mapping[str, torch.Tensor], tokens: torch.Tensor, cache: KVCache,
           start_pos: int, last_only: bool = False) -> torch.Tensor:
    """Logits (batch, t, vocab) for `tokens` (batch, t) at positions start_pos..start_pos+t-1,
    given that the cache holds positions 0..start_pos-1; stores these positions' keys and
    values in the cache. Called on the whole prompt and then token by token, the logits are
    those of `forward` on the whole sequence. last_only: logits of the last position only
    (batch, 1, vocab)."""
    p = params
    t = tokens.shape[1]
    x = F.embedding(tokens, p["tok_emb"])
    inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # CPU, as rope_table's positions
    cos, sin = (r[start_pos:].to(x.device, x.dtype) for r in rope_table(start_pos + t, inv_freq))
    hd = cfg.head_dim
    moe_layers, ctx = cfg.moe_layers, LocalContext()  # the MoE blocks' plain single-device path
    for i in range(cfg.n_layers):
        prefix = f"layers.{i}."
        h = rms_norm(x, p[prefix + "attn_norm"], cfg.norm_eps)
        q = F.linear(h, p[prefix + "attn.wq"]).unflatten(-1, (-1, hd))
        k = F.linear(h, p[prefix + "attn.wk"]).unflatten(-1, (-1, hd))
        v = F.linear(h, p[prefix + "attn.wv"]).unflatten(-1, (-1, hd))
        if cfg.qk_norm:
            q = rms_norm(q, p[prefix + "attn.q_norm"], cfg.norm_eps)
            k = rms_norm(k, p[prefix + "attn.k_norm"], cfg.norm_eps)
        out = cached_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, cache, i, start_pos)
        x = x + F.linear(out.flatten(-2), p[prefix + "attn.wo"])
        if i in moe_layers:
            x = x + _moe(cfg, p, prefix, x, ctx)
            continue
        h = rms_norm(x, p[prefix + "mlp_norm"], cfg.norm_eps)
        gate = F.silu(F.linear(h, p[prefix + "mlp.w_gate"])) * F.linear(h, p[prefix + "mlp.w_up"])
        x = x + F.linear(gate, p[prefix + "mlp.w_down"])
    if last_only:
        x = x[:, -1:]
    x = rms_norm(x, p["norm"], cfg.norm_eps)
    return F.linear(x, p["tok_emb" if cfg.tie_embeddings else "output"])
