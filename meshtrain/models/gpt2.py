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
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .context import ModelContext
from .layers import KVCache, cached_attention, layer_norm
from .spec import ParamSpec


@dataclass(frozen=True)
class GPT2Config:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    ffn_dim: int | None = None  # None: 4 * dim
    vocab_size: int = 512
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self) -> None:
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", 4 * self.dim)
        for name in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"model.{name}={value}: must be a positive integer")
        if self.dim % self.n_heads:
            raise ConfigError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: "
                              "choose a dim that is a multiple of n_heads")


PRESETS: dict[str, GPT2Config] = {
    "tiny": GPT2Config(),
    "gpt2": GPT2Config(dim=768, n_layers=12, n_heads=12, vocab_size=50257, max_seq_len=1024),
    "gpt2-medium": GPT2Config(dim=1024, n_layers=24, n_heads=16, vocab_size=50257, max_seq_len=1024),
    "gpt2-large": GPT2Config(dim=1280, n_layers=36, n_heads=20, vocab_size=50257, max_seq_len=1024),
    "gpt2-xl": GPT2Config(dim=1600, n_layers=48, n_heads=25, vocab_size=50257, max_seq_len=1024),
}


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


def forward(cfg: GPT2Config, params: Mapping[str, torch.Tensor], tokens: torch.Tensor,
            ctx: ModelContext) -> torch.Tensor:
    """Logits (batch, seq, vocab) for `tokens` (batch, seq)."""
    return forward_stage(cfg, params, tokens, ctx, (0, cfg.n_layers), first=True, last=True)


def forward_stage(cfg: GPT2Config, params: Mapping[str, torch.Tensor], x: torch.Tensor, ctx: ModelContext,
                  layers: tuple[int, int], first: bool, last: bool) -> torch.Tensor:
    """One pipeline stage: layers [start, stop), after the token and position embeddings
    when `first` (x is then the tokens, else the residual stream (batch, seq, dim)),
    ending with the final norm and the head when `last` (logits, else the residual
    stream). `params` needs only the stage's own."""
    seq_len = x.shape[1]
    if seq_len > cfg.max_seq_len:
        raise ConfigError(f"sequence length {seq_len} exceeds model.max_seq_len={cfg.max_seq_len} "
                          "(GPT-2 learns one embedding per position): use shorter sequences or a "
                          "larger max_seq_len")
    p = ctx.bind(params)
    if first:
        tokens = ctx.constrain(x, ("batch", "seq"))
        x = ctx.constrain(ctx.embedding(tokens, p["tok_emb"]), ("batch", "seq_sp", None))
        positions = ctx.constrain(torch.arange(seq_len, device=tokens.device), ("seq",))
        pos = ctx.constrain(ctx.embedding(positions, p["pos_emb"]), ("seq_sp", None))
        x = x + pos
    for i in range(*layers):
        x = ctx.remat(_block, cfg, p, f"layers.{i}.", x, ctx)
    if not last:
        return x
    x = ctx.constrain(layer_norm(x, p["norm"], p["norm_bias"], cfg.norm_eps), ("batch", "seq", None))
    logits = ctx.linear(x, p, "tok_emb" if cfg.tie_embeddings else "output")
    return ctx.constrain(logits, ("batch", "seq", "vocab"))


def _block(cfg, p, prefix, x, ctx):
    x = x + _attention(cfg, p, prefix, x, ctx)
    return x + _mlp(cfg, p, prefix, x, ctx)


def _attention(cfg, p, prefix, x, ctx):
    h = layer_norm(x, p[prefix + "attn_norm"], p[prefix + "attn_norm_bias"], cfg.norm_eps)
    h = ctx.constrain(h, ("batch", "seq", None))
    hd = cfg.head_dim
    q, k, v = (ctx.constrain(ctx.linear(h, p, prefix + f"attn.w{w}", p[prefix + f"attn.b{w}"]).unflatten(-1, (-1, hd)),
                             ("batch", "seq", "q_heads", None)) for w in ("q", "k", "v"))
    out = ctx.attention(q, k, v).flatten(-2)
    return ctx.constrain(ctx.linear(out, p, prefix + "attn.wo"), ("batch", "seq_sp", None)) + p[prefix + "attn.bo"]


def _mlp(cfg, p, prefix, x, ctx):
    h = layer_norm(x, p[prefix + "mlp_norm"], p[prefix + "mlp_norm_bias"], cfg.norm_eps)
    h = ctx.constrain(h, ("batch", "seq", None))
    up = F.gelu(ctx.linear(h, p, prefix + "mlp.w_up", p[prefix + "mlp.b_up"]), approximate="tanh")
    return ctx.constrain(ctx.linear(up, p, prefix + "mlp.w_down"), ("batch", "seq_sp", None)) + p[prefix + "mlp.b_down"]


# --------------------------------------------------------------------------- decoding
# See llama.decode: the same KV-cache inference path, with learned positions.


def init_cache(cfg: GPT2Config, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> KVCache:
    """An empty cache for `max_len` positions (at most cfg.max_seq_len)."""
    return KVCache.empty(cfg.n_layers, batch, max_len, cfg.n_heads, cfg.head_dim, dtype, device)


def decode(cfg: GPT2Config, params: Mapping[str, torch.Tensor], tokens: torch.Tensor, cache: KVCache,
           start_pos: int, last_only: bool = False) -> torch.Tensor:
    """Logits (batch, t, vocab) for `tokens` (batch, t) at positions start_pos..start_pos+t-1,
    given that the cache holds positions 0..start_pos-1; stores these positions' keys and
    values in the cache. last_only: logits of the last position only (batch, 1, vocab)."""
    p = params
    t = tokens.shape[1]
    end = start_pos + t
    if end > cfg.max_seq_len:
        raise ConfigError(f"position {end - 1} exceeds model.max_seq_len={cfg.max_seq_len} (GPT-2 learns one "
                          "embedding per position): generate fewer tokens")
    positions = torch.arange(start_pos, end, device=tokens.device)
    x = F.embedding(tokens, p["tok_emb"]) + F.embedding(positions, p["pos_emb"])
    hd = cfg.head_dim
    for i in range(cfg.n_layers):
        prefix = f"layers.{i}."
        h = layer_norm(x, p[prefix + "attn_norm"], p[prefix + "attn_norm_bias"], cfg.norm_eps)
        q, k, v = (F.linear(h, p[prefix + f"attn.w{w}"], p[prefix + f"attn.b{w}"]).unflatten(-1, (-1, hd))
                   for w in ("q", "k", "v"))
        out = cached_attention(q, k, v, cache, i, start_pos).flatten(-2)
        x = x + (F.linear(out, p[prefix + "attn.wo"]) + p[prefix + "attn.bo"])
        h = layer_norm(x, p[prefix + "mlp_norm"], p[prefix + "mlp_norm_bias"], cfg.norm_eps)
        up = F.gelu(F.linear(h, p[prefix + "mlp.w_up"], p[prefix + "mlp.b_up"]), approximate="tanh")
        x = x + (F.linear(up, p[prefix + "mlp.w_down"]) + p[prefix + "mlp.b_down"])
    if last_only:
        x = x[:, -1:]
    x = layer_norm(x, p["norm"], p["norm_bias"], cfg.norm_eps)
    return F.linear(x, p["tok_emb" if cfg.tie_embeddings else "output"])
