"""The llama family's config, its presets, and how the run config's model.* section maps
onto it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ConfigError, check_float, check_int
from ..moe import MoeConfig


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


def from_fields(m) -> LlamaConfig:
    """The LlamaConfig of a model.* section (models/config.py ModelConfig)."""
    return LlamaConfig(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads or m.n_heads,
                       ffn_dim=m.ffn_dim, vocab_size=m.vocab_size, max_seq_len=m.max_seq_len,
                       rope_theta=m.rope_theta, norm_eps=m.norm_eps, tie_embeddings=m.tie_embeddings,
                       rope_scaling=m.rope_scaling, qk_norm=m.qk_norm, attn_head_dim=m.head_dim,
                       moe=m.moe)


_SCALING_KEYS = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}


def check_fields(m) -> None:
    """The model.* keys llama reads beyond those every family has: RoPE (theta, scaling,
    an even head dim) and an explicit MLP size."""
    if m.rope_scaling is not None:
        if not isinstance(m.rope_scaling, dict) or set(m.rope_scaling) != _SCALING_KEYS:
            raise ConfigError(f"model.rope_scaling={m.rope_scaling!r}: give null, or (llama only) a mapping with "
                              f"exactly the keys {', '.join(sorted(_SCALING_KEYS))}")
        for key, value in m.rope_scaling.items():
            check_float(value, f"model.rope_scaling.{key}", positive=True)
        s = m.rope_scaling
        if s["factor"] < 1:
            raise ConfigError(f"model.rope_scaling.factor={s['factor']} must be at least 1 (it stretches the "
                              "low frequencies for a longer context, e.g. 8)")
        if s["low_freq_factor"] >= s["high_freq_factor"]:
            raise ConfigError(f"model.rope_scaling.low_freq_factor={s['low_freq_factor']} must be below "
                              f"model.rope_scaling.high_freq_factor={s['high_freq_factor']} (the frequencies "
                              "between them are interpolated; Llama 3.1: 1 and 4)")
        check_int(s["original_max_position_embeddings"], "model.rope_scaling.original_max_position_embeddings",
                  minimum=1)
    for key, what in (("mla", "multi-head latent attention"), ("mtp", "multi-token prediction")):
        if getattr(m, key) is not None:
            raise ConfigError(f"model.{key}={getattr(m, key)!r} is {what}, which model.arch=llama does not have: set "
                              f"model.arch deepseek_v3, or model.{key} null")
    if m.ffn_dim is None:
        raise ConfigError("model.ffn_dim is null, but llama needs an explicit MLP size: set model.ffn_dim "
                          "(e.g. about 8/3 * dim rounded to a multiple of 16)")
    if m.rope_theta is None:
        raise ConfigError("model.rope_theta is null, but llama uses RoPE: set model.rope_theta "
                          "(10000.0 for Llama-2-style models, 500000.0 for Llama-3)")
    check_float(m.rope_theta, "model.rope_theta", positive=True)
    # RoPE rotates pairs of dims: the head dim must be even (said here in terms of the keys).
    if m.head_dim is not None and m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} is odd: RoPE rotates pairs of dims; choose an even "
                          "head_dim")
    if m.head_dim is None and m.dim % m.n_heads == 0 and (m.dim // m.n_heads) % 2:
        raise ConfigError(f"model.dim={m.dim} / model.n_heads={m.n_heads} = {m.dim // m.n_heads} is odd, but "
                          "RoPE needs an even head dim: choose dim and n_heads with an even ratio, or set "
                          "model.head_dim")
