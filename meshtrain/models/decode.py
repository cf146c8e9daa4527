"""Decoding with a KV cache through the families' own block code.

`decode` runs a family's `forward_stage` under a `DecodeContext`: a single-device context
(parameters in their own dtype, as `LocalContext` without a policy) whose attention
writes this call's keys and values into the cache and attends over every cached position,
and whose `start_pos` tells the family where the new tokens sit (RoPE angles, learned
positions). Called on the whole prompt and then token by token, the logits are those of
`forward` on the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .context import LocalContext


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


class DecodeContext(LocalContext):
    """LocalContext for one decode call: the blocks call `attention` once each, in layer
    order, so the n-th call reads and extends layer n of the cache."""

    def __init__(self, cache: KVCache, start_pos: int):
        super().__init__()
        self.cache, self.start_pos, self._layer = cache, start_pos, 0

    def attention(self, q, k, v, segments=None, window=None):
        assert segments is None, "decoding generates one sequence per row: no packed documents"
        out = cached_attention(q, k, v, self.cache, self._layer, self.start_pos)
        self._layer += 1
        return out


def decode(family, cfg, params, tokens: torch.Tensor, cache: KVCache, start_pos: int,
           last_only: bool = False) -> torch.Tensor:
    """Logits (batch, t, vocab) for `tokens` (batch, t) at positions start_pos..start_pos+t-1
    of the model `family` / `cfg`, given that the cache holds positions 0..start_pos-1;
    stores these positions' keys and values. last_only: the last position's logits only
    (batch, 1, vocab), the head run on that row alone."""
    ctx = DecodeContext(cache, start_pos)
    x = family.forward_stage(cfg, params, tokens, ctx, (0, cfg.n_layers), first=True, last=False)
    if last_only:
        x = x[:, -1:]
    return family.head(cfg, ctx.bind(params), x, ctx)
