"""Multi-head latent attention (DeepSeek-V2/V3): configuration, parameters and forward,
written once on local or sharded tensors like every layer (models/context.py).

Queries come from a low-rank latent of the block input (q_lora_rank; null: one full
projection, as DeepSeek-V2-Lite), normed; keys and values from one shared latent of
kv_lora_rank, normed, expanded per head into a position-free key part (qk_nope_head_dim)
and a value (v_head_dim); a separate rotary key of qk_rope_head_dim is shared by every
head. A query head is [nope | rope] against the key's [nope | shared rope]. Tensor
parallelism splits the heads (the up-projections wq_b / wq and wkv_b column-parallel,
wo row-parallel); the down-projections, their norms and the shared rotary key are small
and stay whole on every tp rank (docs/deepseek.md, "Plan rules").

MlaConfig is the model.mla section of a run config itself, checked when built, as
MoeConfig is model.moe's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError, check_bool, check_int
from .layers import apply_rope, apply_rope_interleaved, rms_norm
from .spec import ParamSpec

# As models/config.py's MAX_SIZES: far above any real model (DeepSeek-V3: q_lora 1536,
# kv_lora 512, head dims 128 / 64 / 128), low enough that a typo fails here.
MAX_SIZES = {"q_lora_rank": 2**16, "kv_lora_rank": 2**16, "qk_nope_head_dim": 2**12, "qk_rope_head_dim": 2**12,
             "v_head_dim": 2**12}


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (model.arch deepseek_v3)."""

    q_lora_rank: int | None = 64
    """Rank of the query latent (DeepSeek-V3: 1536); null: queries projected from the block input directly (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 32
    """Rank of the shared key/value latent (DeepSeek-V3: 512)."""
    qk_nope_head_dim: int = 32
    """Per-head query/key dims without position (DeepSeek-V3: 128)."""
    qk_rope_head_dim: int = 16
    """Per-head query dims with RoPE, against one rotary key shared by every head (DeepSeek-V3: 64); even."""
    v_head_dim: int = 32
    """Per-head value dims (DeepSeek-V3: 128)."""
    rope_interleave: bool = True
    """The rotary dims come in interleaved pairs (x0, x1), (x2, x3), ..., as in DeepSeek's released weights; false: half-split, as Llama's."""

    def __post_init__(self) -> None:
        if self.q_lora_rank is not None:
            check_int(self.q_lora_rank, "model.mla.q_lora_rank", 1, MAX_SIZES["q_lora_rank"])
        for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            check_int(getattr(self, key), f"model.mla.{key}", 1, MAX_SIZES[key])
        check_int(self.qk_rope_head_dim, "model.mla.qk_rope_head_dim", 2, MAX_SIZES["qk_rope_head_dim"])
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} is odd: RoPE rotates pairs of "
                              "dims; choose an even size")
        check_bool(self.rope_interleave, "model.mla.rope_interleave")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_specs(m: MlaConfig, p: str, d: int, n_heads: int, std: float, out_std: float) -> dict[str, ParamSpec]:
    """Block `p`'s attention parameters on the embed dim d (weights (out, in))."""
    qk, kv = m.qk_head_dim, m.qk_nope_head_dim + m.v_head_dim
    specs = {}
    if m.q_lora_rank is None:
        specs[p + "wq"] = ParamSpec((n_heads * qk, d), ("q_heads", "embed"), std=std, units=(qk, 1))
    else:
        specs[p + "wq_a"] = ParamSpec((m.q_lora_rank, d), (None, "embed"), std=std)
        specs[p + "q_norm"] = ParamSpec((m.q_lora_rank,), ("norm",), init="ones")
        specs[p + "wq_b"] = ParamSpec((n_heads * qk, m.q_lora_rank), ("q_heads", "embed"), std=std, units=(qk, 1))
    specs[p + "wkv_a"] = ParamSpec((m.kv_lora_rank + m.qk_rope_head_dim, d), (None, "embed"), std=std)
    specs[p + "kv_norm"] = ParamSpec((m.kv_lora_rank,), ("norm",), init="ones")
    specs[p + "wkv_b"] = ParamSpec((n_heads * kv, m.kv_lora_rank), ("q_heads", "embed"), std=std, units=(kv, 1))
    specs[p + "wo"] = ParamSpec((d, n_heads * m.v_head_dim), ("embed", "q_heads"), std=out_std,
                                units=(1, m.v_head_dim))
    return specs


def mla(m: MlaConfig, p, prefix: str, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx, eps: float,
        q_gain: float = 1.0, segments=None, window=None) -> torch.Tensor:
    """Latent attention of the normed block input h (batch, seq, dim) with the parameters
    under `prefix`; `q_gain` multiplies the queries (YaRN's softmax temperature, applied
    to q so every attention kernel keeps its 1/sqrt(qk_head_dim)). Returns the output
    projection's (batch, seq, dim), before the residual's layout."""
    heads = ("batch", "seq", "q_heads", None)
    if m.q_lora_rank is None:
        q = ctx.linear(h, p, prefix + "wq")
    else:
        latent_q = rms_norm(ctx.linear(h, p, prefix + "wq_a"), p[prefix + "q_norm"], eps)
        q = ctx.linear(ctx.constrain(latent_q, ("batch", "seq", None)), p, prefix + "wq_b")
    q_nope, q_rope = ctx.constrain(q.unflatten(-1, (-1, m.qk_head_dim)), heads).split(
        [m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
    latent, k_rope = ctx.linear(h, p, prefix + "wkv_a").split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
    latent = ctx.constrain(rms_norm(latent, p[prefix + "kv_norm"], eps), ("batch", "seq", None))
    rope = apply_rope_interleaved if m.rope_interleave else apply_rope
    k_rope = rope(k_rope.unsqueeze(-2), cos, sin)  # (batch, seq, 1, rope): one key for every head
    # Decoding caches these two, not the expanded keys and values (models/decode.py).
    latent, k_rope = ctx.cached_latents(latent, k_rope)
    kv = ctx.constrain(ctx.linear(latent, p, prefix + "wkv_b").unflatten(-1, (-1, m.qk_nope_head_dim + m.v_head_dim)),
                       heads)
    k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], -1)
    k_rope = ctx.constrain(k_rope.expand(*k_nope.shape[:-1], m.qk_rope_head_dim), heads)
    q = torch.cat([q_nope, rope(q_rope, cos, sin)], -1)
    k = torch.cat([k_nope, k_rope], -1)
    if q_gain != 1.0:
        q = q * q_gain
    out = ctx.attention(q, k, v, segments, window).flatten(-2)
    return ctx.linear(out, p, prefix + "wo")
