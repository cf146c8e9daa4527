"""What the Hugging Face side is made of: file and architecture names, the pieces of our
parameters each HF tensor holds, and typed reads of config.json keys."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..errors import ConfigError
from ..models import FAMILIES
from ..models.moe import MoeConfig

GiB = 1 << 30


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


_TORCH_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


_ST_READ_DTYPES = {"F32", "BF16", "F16", "F64"}


ARCHITECTURES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}


_BASE_PREFIX = {"llama": "model.", "gpt2": "transformer."}


# Tensors a checkpoint may carry that are not weights (buffers of older transformers).
_IGNORABLE = re.compile(r"(^|\.)(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")


TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")


SINGLE_FILE = "model.safetensors"


INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Piece:
    """Where (part of) one of our parameters lies inside a Hugging Face tensor: the HF
    tensor holds ours[lead] (all of ours when lead is empty; e.g. lead (j,): expert j of
    a stacked expert weight), whose dim perm[j] is HF dim j, starting at offset[j]
    (non-zero only in a fused tensor). `shape` is our whole parameter's."""

    ours: str
    shape: tuple[int, ...]
    perm: tuple[int, ...]
    offset: tuple[int, ...]
    lead: tuple[int, ...] = ()

    @property
    def sub_shape(self) -> tuple[int, ...]:
        """The shape of ours[lead]."""
        return self.shape[len(self.lead):]

    @property
    def inverse_perm(self) -> tuple[int, ...]:
        inv = [0] * len(self.perm)
        for j, d in enumerate(self.perm):
            inv[d] = j
        return tuple(inv)

    def hf_index(self, index: tuple[slice, ...]) -> tuple[slice, ...]:
        """The HF slices holding ours[lead][index] (slices with start/stop, step 1)."""
        return tuple(slice(o + index[d].start, o + index[d].stop) for o, d in zip(self.offset, self.perm))

    def region(self) -> tuple[slice, ...]:
        return self.hf_index(tuple(slice(0, n) for n in self.sub_shape))


@dataclass(frozen=True)
class HFTensor:
    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def plain(self) -> bool:
        """One piece, same layout: the HF tensor is our parameter as it is."""
        p = self.pieces[0]
        return len(self.pieces) == 1 and not p.lead and p.perm == tuple(range(len(p.shape)))


def _specs(arch: str, cfg) -> dict:
    return FAMILIES[arch].param_specs(cfg)


def _family_cfg(arch: str, family_cfg):
    """The family config (LlamaConfig, GPT2Config) of `arch`: `family_cfg` itself, or the
    family's from_fields of a model.* section (a ModelConfig, or a dict of its fields such
    as read_hf_config returns)."""
    if arch not in ARCHITECTURES:
        raise ConfigError(f"model.arch={arch!r}: Hugging Face interop supports {', '.join(ARCHITECTURES)}")
    family = FAMILIES[arch]
    if isinstance(family_cfg, family.config):
        return family_cfg
    if any(isinstance(family_cfg, f.config) for f in FAMILIES.values()):
        raise ConfigError(f"model.arch={arch!r} but the model config is a {type(family_cfg).__name__}: pass the "
                          f"{family.config.__name__} of the {arch} model")
    if isinstance(family_cfg, Mapping):
        moe = family_cfg.get("moe")
        fields = _ModelFields({"qk_norm": False, "head_dim": None, **family_cfg,
                               "moe": MoeConfig(**moe) if isinstance(moe, Mapping) else moe})
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


_REQUIRED = object()


def _get(config: Mapping, keys: tuple[str, ...], default: Any, source: str, kind: type = int) -> Any:
    """The first of `keys` that is set (not null), type-checked; else `default`."""
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            what = {float: "a number", int: "an integer", bool: "true or false"}.get(kind, kind.__name__)
            raise ConfigError(f"{source}: {key}={json.dumps(value)} must be {what}")
        return value
    if default is _REQUIRED:
        raise ConfigError(f"{source}: {keys[0]} is missing; it is needed to build the model")
    return default


def _refuse(config: Mapping, key: str, ok: Callable[[Any], bool], default: Any, why: str, source: str) -> None:
    value = config.get(key, default)
    if value is None:
        value = default
    if not ok(value):
        raise ConfigError(f"{source}: {key}={json.dumps(value)} is not supported: {why}")

