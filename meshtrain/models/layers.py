"""Pure building blocks shared by the model families."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 whatever the compute dtype, as the reference implementations do.
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    return y.to(x.dtype) * weight + bias


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies, with the Llama-3 long-context rescaling when `scaling` is given
    (keys: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling:
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def rope_table(seq_len: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq, head_dim) in the half-split (Hugging Face) convention."""
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, scaling: dict | None = None,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE tables (seq_len, head_dim) on `device` (computed on the CPU, as decode's)."""
    return tuple(t.to(device) for t in rope_table(seq_len, rope_frequencies(head_dim, theta, scaling)))


# A function of the config alone: under torch.compile it becomes a constant of the graph
# instead of being recomputed (in double precision, per element) inside every kernel
# that applies it, which cost ~9% of a compiled step (docs/performance.md). This is what
# torch._dynamo.assume_constant_result does; importing dynamo for it cost every process
# ~3 s at start (tests/test_compile.py checks the two agree).
rope_cos_sin._dynamo_marked_constant = True


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, seq, heads, head_dim); cos/sin (seq, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclass
class KVCache:
    """Keys and values of the positions decoded so far: per layer, a preallocated
    (batch, max_len, kv_heads, head_dim) tensor that `decode` fills in place."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @staticmethod
    def empty(n_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "KVCache":
        shape = (batch, max_len, kv_heads, head_dim)
        return KVCache([torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)],
                       [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)])

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                     start_pos: int) -> torch.Tensor:
    """Store k/v (batch, t, kv_heads, head_dim) at positions start_pos.. of `layer` in the
    cache, then causal attention of q (batch, t, q_heads, head_dim) at those positions over
    every cached position up to its own. GQA by grouping (no repeated K/V). Returns
    (batch, t, q_heads, head_dim)."""
    t = q.shape[1]
    end = start_pos + t
    if start_pos < 0 or end > cache.max_len:
        raise ConfigError(f"decoding positions {start_pos}..{end - 1} do not fit the KV cache of "
                          f"{cache.max_len} positions: allocate a longer cache")
    cache.k[layer][:, start_pos:end] = k
    cache.v[layer][:, start_pos:end] = v
    keys, values = cache.k[layer][:, :end], cache.v[layer][:, :end]
    if t == 1:  # one new token sees every cached position
        mask, causal = None, False
    elif start_pos == 0:  # prefill: plain causal attention
        mask, causal = None, True
    else:  # several new tokens after cached ones: query i sees keys 0..start_pos+i
        mask = torch.arange(end, device=q.device) <= torch.arange(start_pos, end, device=q.device)[:, None]
        causal = False
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask, is_causal=causal,
                                         enable_gqa=keys.shape[2] != q.shape[2])
    return out.transpose(1, 2)
