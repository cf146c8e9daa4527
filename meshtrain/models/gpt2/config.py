"""The gpt2 family's config, its presets, and how the run config's model.* section maps
onto it."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError


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


def from_fields(m) -> GPT2Config:
    """The GPT2Config of a model.* section (models/config.py ModelConfig)."""
    return GPT2Config(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, ffn_dim=m.ffn_dim,
                      vocab_size=m.vocab_size, max_seq_len=m.max_seq_len, norm_eps=m.norm_eps,
                      tie_embeddings=m.tie_embeddings)


def check_fields(m) -> None:
    """gpt2 reads none of the keys only llama has: no RoPE, no GQA, no q/k norms or experts."""
    if m.rope_scaling is not None:
        raise ConfigError(f"model.rope_scaling={m.rope_scaling!r} is llama-only, but model.arch={m.arch!r} "
                          "(learned positions): set model.rope_scaling null")
    if m.n_kv_heads is not None and m.n_kv_heads != m.n_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads}: model.arch=gpt2 has no grouped-query attention; set "
                          f"model.n_kv_heads to null (or to model.n_heads={m.n_heads}), e.g. "
                          "--model.n_kv_heads null")
    if m.rope_theta is not None:
        raise ConfigError(f"model.rope_theta={m.rope_theta}: model.arch=gpt2 uses learned absolute positions, not "
                          "RoPE; set model.rope_theta to null, e.g. --model.rope_theta null")
    for key, value in (("qk_norm", m.qk_norm or None), ("head_dim", m.head_dim), ("moe", m.moe), ("mla", m.mla),
                       ("mtp", m.mtp)):
        if value is not None:
            raise ConfigError(f"model.{key}={value!r} is not read by model.arch={m.arch!r}: set model.arch llama or "
                              f"deepseek_v3, or model.{key} {'false' if key == 'qk_norm' else 'null'} (gpt2 has "
                              "none of model.qk_norm, model.head_dim, model.moe, model.mla, model.mtp)")
