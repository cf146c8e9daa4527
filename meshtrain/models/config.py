"""The model.* section of a run config: the architecture keys every family reads from
(`from_fields` of models/<family>/config.py builds the family's own config), checked here.
model.moe is the MoE layer's own MoeConfig (models/moe.py), which checks its fields itself.
Torch-free, like every config section: the families and MoeConfig are imported where a
check or a family config needs them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError, check_bool, check_choice, check_float, check_int

# For the annotation only: importing models.moe here would import torch with the config.
# jsonargparse resolves the name from this block when the CLI builds its parser.
if TYPE_CHECKING:
    from .mla import MlaConfig
    from .moe import MoeConfig
    from .mtp import MtpConfig

# Upper bounds of the model sizes: far above any real model (Llama 3 405B: dim 16384, 126
# layers, ffn_dim 53248, 128 heads, vocabulary 128256), low enough that a typo fails here,
# not as an allocation, an overflow or an endless planning loop after the ranks have
# started. The vocabulary bound is the int32 token id. model.moe's are MoeConfig's own.
MAX_SIZES = {"model.dim": 2**20, "model.n_layers": 1024, "model.n_heads": 2**16, "model.n_kv_heads": 2**16,
             "model.ffn_dim": 2**22, "model.head_dim": 2**16, "model.vocab_size": 2**31 - 1,
             "model.max_seq_len": 2**24}


def _check_size(value, key: str, minimum: int) -> None:
    check_int(value, key, minimum, MAX_SIZES.get(key))


@dataclass
class ModelConfig:
    """The model architecture."""

    arch: str = "llama"
    """Model family: llama, gpt2, or deepseek_v3."""
    dim: int = 256
    """Width of the residual stream (hidden size)."""
    n_layers: int = 4
    """Number of transformer blocks (at most 1024)."""
    n_heads: int = 8
    """Number of attention (query) heads; must divide dim."""
    n_kv_heads: int | None = 4
    """Number of key/value heads (grouped-query attention; llama only). Must divide n_heads. null: as many as n_heads. gpt2 and deepseek_v3 have no GQA: leave it null or equal to n_heads."""
    ffn_dim: int | None = 688
    """Hidden size of the MLP. null: 4 * dim (gpt2 only; llama needs a value)."""
    vocab_size: int = 512
    """Rows of the embedding and output tables; at least the tokenizer's vocabulary (256 for bytes)."""
    max_seq_len: int = 256
    """Longest sequence the model supports (gpt2: rows of the learned position table); train.seq_len may not exceed it."""
    rope_theta: float | None = 10000.0
    """RoPE base frequency (llama, deepseek_v3; gpt2 uses learned positions: leave it null)."""
    norm_eps: float = 1.0e-5
    """Epsilon of RMSNorm (llama, deepseek_v3) or LayerNorm (gpt2)."""
    tie_embeddings: bool = False
    """Share the token embedding table with the output projection."""
    init_from: str | None = None
    """Start from Hugging Face weights: a directory with config.json and *.safetensors (Llama, Qwen3, Mixtral, Qwen3-MoE, GPT-2 or DeepSeek-V3); each rank reads only the slices of its own shards. Every model.* key not given (YAML or flag) is read from its config.json, model.arch and model.moe's, model.mla's and model.mtp's included; the training-only ones (model.moe.aux_coef, z_loss_coef, capacity_factor, bias_update_rate, model.mtp.loss_coef) keep their defaults. A given key that config.json contradicts is an error naming both values. The weights are ignored when resuming from a checkpoint. null: random initialisation from seed."""
    rope_scaling: dict | None = None
    """RoPE rescaling for long context. llama: Llama 3.1's {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings} with factor >= 1, low_freq_factor < high_freq_factor and an integer original_max_position_embeddings. deepseek_v3: YaRN's {type: yarn, factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim}. null: none."""
    qk_norm: bool = False
    """RMSNorm on each query and key head before RoPE (Qwen3; llama only)."""
    head_dim: int | None = None
    """Width of an attention head when it is not dim / n_heads (Qwen3; llama only); null: dim / n_heads."""
    moe: MoeConfig | None = None
    """Mixture-of-experts blocks (llama, deepseek_v3); null: every block is dense."""
    mla: MlaConfig | None = None
    """Multi-head latent attention's sizes (deepseek_v3, which needs it; null for the other families)."""
    mtp: MtpConfig | None = None
    """Multi-token prediction (deepseek_v3): {depth, loss_coef}; null: none."""

    def __post_init__(self):
        # model.moe as a mapping of its fields (the Python API, a config.json read by interop).
        if isinstance(self.moe, Mapping):
            from .moe import MoeConfig

            self.moe = MoeConfig(**self.moe)
        if isinstance(self.mla, Mapping):
            from .mla import MlaConfig

            self.mla = MlaConfig(**self.mla)
        if isinstance(self.mtp, Mapping):
            from .mtp import MtpConfig

            self.mtp = MtpConfig(**self.mtp)

    def family_config(self):
        """The model family's own config (LlamaConfig, GPT2Config, ...)."""
        from . import get_family

        return get_family(self.arch).from_fields(self)

    def check(self) -> "ModelConfig":
        """Raise ConfigError naming the model.* key and the fix for a value that cannot work."""
        from . import FAMILIES

        check_choice(self.arch, "model.arch", tuple(FAMILIES))
        for key in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
            _check_size(getattr(self, key), f"model.{key}", minimum=1)
        for key in ("n_kv_heads", "ffn_dim"):
            if getattr(self, key) is not None:
                _check_size(getattr(self, key), f"model.{key}", minimum=1)
        check_float(self.norm_eps, "model.norm_eps", positive=True)
        check_bool(self.tie_embeddings, "model.tie_embeddings")
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise ConfigError(f"model.init_from={self.init_from!r}: give the path of a Hugging Face model directory, "
                              "or null")
        check_bool(self.qk_norm, "model.qk_norm")
        if self.head_dim is not None:
            _check_size(self.head_dim, "model.head_dim", minimum=2)
        FAMILIES[self.arch].check_fields(self)  # the keys only some families read (RoPE, GQA, q/k norms, ...)
        if self.moe is not None:
            self._check_moe()
        self._check_sections()
        # The family's own checks (head divisibility, even head dim, ...).
        self.family_config()
        return self

    def _check_sections(self) -> None:
        """model.mla and model.mtp: their dataclasses (which checked their fields when built)."""
        from .mla import MlaConfig
        from .mtp import MtpConfig

        for key, kind in (("mla", MlaConfig), ("mtp", MtpConfig)):
            value = getattr(self, key)
            if value is not None and not isinstance(value, kind):
                raise ConfigError(f"model.{key}={value!r} must be a mapping of its fields, or null")

    def _check_moe(self) -> None:
        """model.moe within the model: a MoeConfig (which checked its own fields when built)
        whose layers select some of model.n_layers."""
        from .moe import MoeConfig

        e = self.moe
        if not isinstance(e, MoeConfig):
            raise ConfigError(f"model.moe={e!r} must be a mapping of its fields, or null")
        if not e.moe_layers(self.n_layers):
            raise ConfigError(f"model.moe.layers={e.layers!r} selects no block of model.n_layers={self.n_layers}: choose "
                              "some, or set model.moe null")

