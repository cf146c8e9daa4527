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
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
              v_dim: int | None = None) -> "KVCache":
        """`v_dim`: the width of v when not head_dim (MLA caches its latent as k and its
        rotary key as v: models/mla.py)."""
        k, v = (batch, max_len, kv_heads, head_dim), (batch, max_len, kv_heads, v_dim or head_dim)
        return KVCache([torch.zeros(k, dtype=dtype, device=device) for _ in range(n_layers)],
                       [torch.zeros(v, dtype=dtype, device=device) for _ in range(n_layers)])

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


def _check_fits(cache: KVCache, start_pos: int, t: int) -> int:
    end = start_pos + t
    if start_pos < 0 or end > cache.max_len:
        raise ConfigError(f"decoding positions {start_pos}..{end - 1} do not fit the KV cache of "
                          f"{cache.max_len} positions: allocate a longer cache")
    return end


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                     start_pos: int) -> torch.Tensor:
    """Store k/v (batch, t, kv_heads, head_dim) at positions start_pos.. of `layer` in the
    cache, then causal attention of q (batch, t, q_heads, head_dim) at those positions over
    every cached position up to its own. GQA by grouping (no repeated K/V). Returns
    (batch, t, q_heads, head_dim)."""
    end = _check_fits(cache, start_pos, q.shape[1])
    cache.k[layer][:, start_pos:end] = k
    cache.v[layer][:, start_pos:end] = v
    return attend_cached(q, cache.k[layer][:, :end], cache.v[layer][:, :end], start_pos)


def attend_cached(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int) -> torch.Tensor:
    """Causal attention of q (batch, t, q_heads, d) at positions start_pos.. over keys and
    values of every position up to the last query's (batch, end, kv_heads, d / d_v)."""
    t, end = q.shape[1], keys.shape[1]
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
        self.cache, self.start_pos, self._layer, self._expanded = cache, start_pos, 0, False

    def cached_latents(self, latent, rope_key):
        """MLA's compressed cache: store this call's latent (batch, t, rank) and rotary key
        (batch, t, 1, rope) in the layer's cache; every cached position's come back, for
        the layer to expand into keys and values (its `attention` then caches nothing)."""
        end = _check_fits(self.cache, self.start_pos, latent.shape[1])
        layer = self._layer
        self.cache.k[layer][:, self.start_pos:end, 0] = latent
        self.cache.v[layer][:, self.start_pos:end] = rope_key
        self._expanded = True
        return self.cache.k[layer][:, :end, 0], self.cache.v[layer][:, :end]

    def attention(self, q, k, v, segments=None, window=None):
        assert segments is None, "decoding generates one sequence per row: no packed documents"
        if self._expanded:  # k, v expanded from cached latents: every position's already
            out = attend_cached(q, k, v, self.start_pos)
        else:
            out = cached_attention(q, k, v, self.cache, self._layer, self.start_pos)
        self._layer, self._expanded = self._layer + 1, False
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
