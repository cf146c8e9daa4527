"""What every Hugging Face directory shares: file names, dtypes, tensors that are not
weights; and the way from a model arch to its family's format and config (the formats
themselves are in the families' folders, models/<family>/hf.py)."""

from __future__ import annotations

import re
from typing import Mapping

import torch

from ..errors import ConfigError
from ..models import FAMILIES
from ..models.hf import HFFormat
from ..models.mla import MlaConfig
from ..models.moe import MoeConfig
from ..models.mtp import MtpConfig

GiB = 1 << 30


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


_TORCH_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


_ST_READ_DTYPES = {"F32", "BF16", "F16", "F64"}


# Tensors a checkpoint may carry that are not weights (buffers of older transformers).
_IGNORABLE = re.compile(r"(^|\.)(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")


TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")


SINGLE_FILE = "model.safetensors"


INDEX_FILE = "model.safetensors.index.json"


def hf_format(arch: str) -> HFFormat:
    """The Hugging Face format of the family `arch` (models/hf.py)."""
    family = FAMILIES.get(arch)
    if family is None or family.hf is None:
        supported = [name for name, f in FAMILIES.items() if f.hf is not None]
        raise ConfigError(f"model.arch={arch!r}: Hugging Face interop supports {', '.join(supported)}")
    return family.hf


def _specs(arch: str, cfg) -> dict:
    return FAMILIES[arch].param_specs(cfg)


def _family_cfg(arch: str, family_cfg):
    """The family config (LlamaConfig, GPT2Config) of `arch`: `family_cfg` itself, or the
    family's from_fields of a model.* section (a ModelConfig, or a dict of its fields such
    as read_hf_config returns)."""
    hf_format(arch)
    family = FAMILIES[arch]
    if isinstance(family_cfg, family.config):
        return family_cfg
    if any(isinstance(family_cfg, f.config) for f in FAMILIES.values()):
        raise ConfigError(f"model.arch={arch!r} but the model config is a {type(family_cfg).__name__}: pass the "
                          f"{family.config.__name__} of the {arch} model")
    if isinstance(family_cfg, Mapping):
        sections = {key: cls(**family_cfg[key]) for key, cls in (("moe", MoeConfig), ("mla", MlaConfig),
                                                                  ("mtp", MtpConfig))
                    if isinstance(family_cfg.get(key), Mapping)}
        fields = _ModelFields({"qk_norm": False, "head_dim": None, "moe": None, "mla": None, "mtp": None, **family_cfg,
                               **sections})
    elif hasattr(family_cfg, "arch") and hasattr(family_cfg, "dim"):  # a model.* section
        fields = family_cfg
    else:
        raise ConfigError(f"model config {family_cfg!r}: pass a {family.config.__name__}, a ModelConfig or a dict "
                          "of model.* fields")
    if getattr(fields, "arch", arch) != arch:
        raise ConfigError(f"model.arch={fields.arch!r} differs from the requested arch {arch!r}: pass "
                          "matching ones")
    return family.from_fields(fields)


class _ModelFields:
    """A dict of model.* fields read as a model section (attributes)."""

    def __init__(self, fields: Mapping):
        self._fields = dict(fields)

    def __getattr__(self, key: str):
        try:
            return self._fields[key]
        except KeyError:
            raise ConfigError(f"model config dict has no model.{key}: give every model.* field (as read_hf_config "
                              "returns them), or pass a ModelConfig") from None


