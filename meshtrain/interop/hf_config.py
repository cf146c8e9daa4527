"""config.json both ways: our family config to a transformers config, and an HF config to
our model.* fields (refusing what our forward does not compute)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from ..errors import ConfigError
from ..models import FAMILIES
from .pieces import _TORCH_DTYPE_NAMES, DTYPES, _family_cfg, hf_format


def to_hf_config(arch: str, family_cfg, *, dtype: str = "bf16", bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> dict:
    """config.json for transformers: the family's keys (models/<family>/hf.py; for the
    llama family LlamaForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM or
    Qwen3MoeForCausalLM as models/llama/hf_moe.py chooses; GPT2LMHeadModel) and the keys
    every family shares. A ConfigError names what the target cannot represent."""
    cfg = _family_cfg(arch, family_cfg)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
    own = hf_format(arch).config(cfg)
    config = {"architectures": own.pop("architectures"), "model_type": own.pop("model_type"),
              "torch_dtype": _TORCH_DTYPE_NAMES[DTYPES[dtype]], "vocab_size": cfg.vocab_size,
              "tie_word_embeddings": bool(cfg.tie_embeddings), "initializer_range": cfg.init_std, "use_cache": True,
              **own}
    # Always written, null when unknown: transformers' own defaults (llama 1/2, gpt2 50256)
    # would otherwise stand in for ids this model never used.
    config["bos_token_id"] = None if bos_token_id is None else int(bos_token_id)
    config["eos_token_id"] = None if eos_token_id is None else int(eos_token_id)
    return config


def from_hf_config(config: Mapping, source: str = "config.json") -> dict:
    """Our ModelConfig fields (arch, dim, n_layers, n_heads, n_kv_heads, ffn_dim,
    vocab_size, max_seq_len, rope_theta, norm_eps, tie_embeddings, rope_scaling; for
    Qwen3 / Mixtral / Qwen3-MoE also qk_norm, head_dim (when not dim / n_heads) and moe,
    a dict of all model.moe fields) for a transformers config.json dict. Unsupported
    architectures or features are a one-line ConfigError naming the key (`source`
    prefixes it)."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"{source}: expected a JSON object, got {type(config).__name__}")
    arch, model_type = _detect_model_type(config, source)
    if config.get("quantization_config"):
        raise ConfigError(f"{source}: quantization_config is set: quantized weights cannot be imported; use an "
                          "unquantized (fp32/bf16/fp16) checkpoint")
    fields = {"arch": arch, **hf_format(arch).fields(config, model_type, source)}
    try:
        _family_cfg(arch, fields)  # the family's own checks (divisibility, even head dim)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return fields


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    """from_hf_config of `<hf_dir>/config.json`."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{hf_dir}: no config.json; give a Hugging Face model directory (config.json and "
                          "*.safetensors, as save_pretrained writes it)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e}); restore the file") from None
    return from_hf_config(config, str(path))


def _detect_model_type(config: Mapping, source: str) -> tuple[str, str]:
    """(our arch, the transformers model_type) of a config.json: the registered family
    whose format imports that model_type (models/<family>/hf.py)."""
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    owner = {t: name for name, f in FAMILIES.items() if f.hf is not None for t in f.hf.model_types}
    allowed = {t: FAMILIES[name].hf.model_types[t] for t, name in owner.items()}
    found = model_type if model_type in allowed else None
    if found is None and model_type is None:
        found = next((t for t, names in allowed.items() for n in archs if n in names), None)
    if found is None:
        known = [f"{t} ({names[0]})" for t, names in allowed.items()]
        raise ConfigError(f"{source}: model_type={model_type!r} (architectures {list(archs)}) is not supported: "
                          f"meshtrain imports {', '.join(known[:-1])} and {known[-1]} checkpoints only")
    other = [n for n in archs if n not in allowed[found]]
    if other:
        raise ConfigError(f"{source}: architectures={list(archs)}: {other[0]} is not supported for model_type "
                          f"{found}; only {allowed[found][0]} (or {allowed[found][1]}) weights can be imported")
    return owner[found], found


def _model_fields(arch: str, cfg) -> dict:
    """Our ModelConfig fields of a family config (what from_hf_config returns)."""
    fields = {"arch": arch, "dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
              "n_kv_heads": getattr(cfg, "n_kv_heads", None), "ffn_dim": cfg.ffn_dim, "vocab_size": cfg.vocab_size,
              "max_seq_len": cfg.max_seq_len, "rope_theta": getattr(cfg, "rope_theta", None),
              "norm_eps": cfg.norm_eps, "tie_embeddings": cfg.tie_embeddings,
              "rope_scaling": getattr(cfg, "rope_scaling", None)}
    return {**fields, **hf_format(arch).model_fields(cfg)}
