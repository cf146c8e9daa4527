"""config.json both ways: our family config to a transformers config, and an HF config to
our model.* fields (refusing what our forward does not compute)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from ..errors import ConfigError
from . import hf_moe
from .pieces import (
    _REQUIRED,
    _TORCH_DTYPE_NAMES,
    ARCHITECTURES,
    DTYPES,
    _family_cfg,
    _get,
    _refuse,
)


def to_hf_config(arch: str, family_cfg, *, dtype: str = "bf16", bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> dict:
    """config.json for transformers (LlamaForCausalLM, Qwen3ForCausalLM,
    MixtralForCausalLM or Qwen3MoeForCausalLM for the llama family, as hf_moe.model_type
    chooses; GPT2LMHeadModel). Llama-family RoPE is written in the transformers 4.x form
    (rope_theta, rope_scaling with rope_type "llama3"), which transformers 5 also reads.
    GPT-2 dropouts are 0: our model has none. A ConfigError names what the target cannot
    represent (hf_moe.check_exportable)."""
    cfg = _family_cfg(arch, family_cfg)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
    model_type = hf_moe.check_exportable(cfg) if arch == "llama" else arch
    cls = ARCHITECTURES[arch] if model_type == arch else hf_moe.MODEL_TYPES[model_type][0]
    common = {"architectures": [cls], "model_type": model_type,
              "torch_dtype": _TORCH_DTYPE_NAMES[DTYPES[dtype]], "vocab_size": cfg.vocab_size,
              "tie_word_embeddings": bool(cfg.tie_embeddings), "initializer_range": cfg.init_std, "use_cache": True}
    if arch == "llama":
        rope_scaling = None
        if cfg.rope_scaling:
            s = cfg.rope_scaling
            rope_scaling = {"rope_type": "llama3", "factor": float(s["factor"]),
                            "low_freq_factor": float(s["low_freq_factor"]),
                            "high_freq_factor": float(s["high_freq_factor"]),
                            "original_max_position_embeddings": int(s["original_max_position_embeddings"])}
        config = {**common, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
                  "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
                  "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
                  "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
                  "rope_theta": float(cfg.rope_theta), "rope_scaling": rope_scaling, "attention_bias": False,
                  "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1}
        if model_type != "llama":
            for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
                del config[key]
            config.update(hf_moe.config_keys(cfg, model_type))
    else:
        config = {**common, "n_embd": cfg.dim, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
                  "n_inner": cfg.ffn_dim, "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len,
                  "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new", "attn_pdrop": 0.0,
                  "resid_pdrop": 0.0, "embd_pdrop": 0.0, "scale_attn_weights": True,
                  "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
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
    model_type = _detect_model_type(config, source)
    if config.get("quantization_config"):
        raise ConfigError(f"{source}: quantization_config is set: quantized weights cannot be imported; use an "
                          "unquantized (fp32/bf16/fp16) checkpoint")
    arch = "gpt2" if model_type == "gpt2" else "llama"
    fields = _gpt2_fields(config, source) if arch == "gpt2" else _llama_fields(config, source, model_type)
    if model_type in hf_moe.MODEL_TYPES:
        fields = hf_moe.import_fields(config, model_type, fields, source)
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


def _detect_model_type(config: Mapping, source: str) -> str:
    """The transformers model_type: llama, gpt2, or one of hf_moe.MODEL_TYPES."""
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    allowed = {"llama": ("LlamaForCausalLM", "LlamaModel"), "gpt2": ("GPT2LMHeadModel", "GPT2Model"),
               **hf_moe.MODEL_TYPES}
    arch = model_type if model_type in allowed else None
    if arch is None and model_type is None:
        arch = next((a for a, names in allowed.items() for n in archs if n in names), None)
    if arch is None:
        raise ConfigError(f"{source}: model_type={model_type!r} (architectures {list(archs)}) is not supported: "
                          "meshtrain imports llama (LlamaForCausalLM), qwen3 (Qwen3ForCausalLM), mixtral "
                          "(MixtralForCausalLM), qwen3_moe (Qwen3MoeForCausalLM) and gpt2 (GPT2LMHeadModel) "
                          "checkpoints only")
    other = [n for n in archs if n not in allowed[arch]]
    if other:
        raise ConfigError(f"{source}: architectures={list(archs)}: {other[0]} is not supported for model_type "
                          f"{arch}; only {allowed[arch][0]} (or {allowed[arch][1]}) weights can be imported")
    return arch


def _llama_fields(config: Mapping, source: str, model_type: str = "llama") -> dict:
    """The fields llama, qwen3, mixtral and qwen3_moe share (hf_moe adds the rest)."""
    defaults = hf_moe.DEFAULTS[model_type]
    dim = _get(config, ("hidden_size",), _REQUIRED, source)
    n_heads = _get(config, ("num_attention_heads",), _REQUIRED, source)
    n_kv = _get(config, ("num_key_value_heads",), n_heads, source)
    head_dim = _get(config, ("head_dim",), None, source) if model_type == "llama" else None
    if head_dim is not None and n_heads and head_dim * n_heads != dim:
        raise ConfigError(f"{source}: head_dim={head_dim} differs from hidden_size / num_attention_heads = "
                          f"{dim} / {n_heads}: meshtrain's llama derives the head size from dim and n_heads, so "
                          "this checkpoint cannot be imported")
    _refuse(config, "hidden_act", lambda v: v == "silu", "silu", "meshtrain's llama MLP is SwiGLU (silu); only "
            "hidden_act silu checkpoints can be imported", source)
    for key in ("attention_bias", "mlp_bias"):
        _refuse(config, key, lambda v: v is False, False, f"meshtrain's llama has no biases; only {key} false "
                "checkpoints can be imported", source)
    max_seq_len = _get(config, ("max_position_embeddings",), defaults["max_position_embeddings"], source)
    theta, scaling = _llama_rope(config, source, max_seq_len, defaults["rope_theta"])
    return {"arch": "llama", "dim": dim, "n_layers": _get(config, ("num_hidden_layers",), _REQUIRED, source),
            "n_heads": n_heads, "n_kv_heads": n_kv, "ffn_dim": _get(config, ("intermediate_size",), _REQUIRED, source),
            "vocab_size": _get(config, ("vocab_size",), _REQUIRED, source), "max_seq_len": max_seq_len,
            "rope_theta": theta,
            "norm_eps": float(_get(config, ("rms_norm_eps",), defaults["rms_norm_eps"], source, float)),
            "tie_embeddings": bool(_get(config, ("tie_word_embeddings",), False, source, bool)),
            "rope_scaling": scaling}


def _llama_rope(config: Mapping, source: str, max_seq_len: int,
                default_theta: float = 10000.0) -> tuple[float, dict | None]:
    """(rope_theta, our rope_scaling) from transformers 4.x keys (rope_theta, rope_scaling)
    or 5.x ones (rope_parameters)."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    if not isinstance(rope, Mapping) or any(isinstance(v, Mapping) for v in rope.values()):
        raise ConfigError(f"{source}: {key}={json.dumps(rope)} is not supported: only one RoPE for all layers "
                          "(a flat mapping) can be imported")
    theta = rope.get("rope_theta", config.get("rope_theta"))
    theta = default_theta if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{source}: rope_theta={theta!r} must be a positive number")
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{source}: partial_rotary_factor={partial} is not supported: meshtrain's llama rotates "
                          "the whole head dim (partial_rotary_factor 1)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise ConfigError(f"{source}: {key}.rope_type={rope_type!r} is not supported: meshtrain's llama implements "
                          "plain RoPE (rope_type default) and Llama 3.1 scaling (rope_type llama3) only")
    scaling = {}
    for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        value = rope.get(name, max_seq_len if name == "original_max_position_embeddings" else None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{source}: {key}.{name}={value!r}: rope_type llama3 needs a positive number")
        scaling[name] = int(value) if name == "original_max_position_embeddings" else float(value)
    return float(theta), scaling


_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _gpt2_fields(config: Mapping, source: str) -> dict:
    dim = _get(config, ("n_embd", "hidden_size"), 768, source)
    _refuse(config, "activation_function", lambda v: v in _TANH_GELUS, "gelu_new",
            f"meshtrain's gpt2 MLP is GELU with the tanh approximation ({', '.join(_TANH_GELUS)})", source)
    _refuse(config, "scale_attn_weights", lambda v: v is True, True,
            "meshtrain's gpt2 scales attention scores by 1/sqrt(head_dim)", source)
    _refuse(config, "scale_attn_by_inverse_layer_idx", lambda v: v is False, False,
            "meshtrain's gpt2 does not scale attention by layer index", source)
    _refuse(config, "add_cross_attention", lambda v: v is False, False,
            "meshtrain's gpt2 is decoder-only, without cross-attention", source)
    n_inner = _get(config, ("n_inner",), None, source)
    return {"arch": "gpt2", "dim": dim, "n_layers": _get(config, ("n_layer", "num_hidden_layers"), 12, source),
            "n_heads": _get(config, ("n_head", "num_attention_heads"), 12, source), "n_kv_heads": None,
            "ffn_dim": 4 * dim if n_inner is None else n_inner,
            "vocab_size": _get(config, ("vocab_size",), 50257, source),
            "max_seq_len": _get(config, ("n_positions", "max_position_embeddings"), 1024, source),
            "rope_theta": None, "norm_eps": float(_get(config, ("layer_norm_epsilon",), 1e-5, source, float)),
            "tie_embeddings": bool(_get(config, ("tie_word_embeddings",), True, source, bool)),
            "rope_scaling": None}


def _model_fields(arch: str, cfg) -> dict:
    """Our ModelConfig fields of a family config (what from_hf_config returns)."""
    fields = {"arch": arch, "dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
              "n_kv_heads": getattr(cfg, "n_kv_heads", None), "ffn_dim": cfg.ffn_dim, "vocab_size": cfg.vocab_size,
              "max_seq_len": cfg.max_seq_len, "rope_theta": getattr(cfg, "rope_theta", None),
              "norm_eps": cfg.norm_eps, "tie_embeddings": cfg.tie_embeddings,
              "rope_scaling": getattr(cfg, "rope_scaling", None)}
    if arch == "llama":
        if cfg.qk_norm:
            fields["qk_norm"] = True
        if cfg.attn_head_dim is not None:
            fields["head_dim"] = cfg.attn_head_dim
        if cfg.moe is not None:
            fields["moe"] = hf_moe.moe_dict(cfg.moe)
    return fields

