"""Hugging Face interop for the llama and gpt2 families: config.json both ways, export of
parameters (in memory, or streamed from a DCP checkpoint) to safetensors, and import of
safetensors weights as plain tensors or as DTensors laid out by a Plan.

A llama-family model exports as LlamaForCausalLM, or, with per-head q/k norms and/or
mixture-of-experts blocks, as Qwen3ForCausalLM, MixtralForCausalLM or
Qwen3MoeForCausalLM; all four import. hf_moe.py has that choice, their extra tensors
(attention norms, experts) and config keys, and what cannot be exported.

Name and layout mapping (ours -> transformers):

  llama (LlamaForCausalLM; both store Linear weights (out, in), and our RoPE already uses
  the half-split convention, so no q/k permutation):
    tok_emb                   model.embed_tokens.weight
    layers.N.attn_norm        model.layers.N.input_layernorm.weight
    layers.N.attn.w{q,k,v,o}  model.layers.N.self_attn.{q,k,v,o}_proj.weight
    layers.N.mlp_norm         model.layers.N.post_attention_layernorm.weight
    layers.N.mlp.w_{gate,up,down}  model.layers.N.mlp.{gate,up,down}_proj.weight
    norm                      model.norm.weight
    output                    lm_head.weight (absent when tied)

  gpt2 (GPT2LMHeadModel; its Conv1D layers store weights (in, out): transposed):
    tok_emb, pos_emb          transformer.wte.weight, transformer.wpe.weight
    layers.N.attn_norm(_bias) transformer.h.N.ln_1.weight / .bias
    layers.N.attn.w{q,k,v}    transformer.h.N.attn.c_attn.weight (d, 3d) = [wq.T | wk.T | wv.T]
    layers.N.attn.b{q,k,v}    transformer.h.N.attn.c_attn.bias (3d,) = [bq | bk | bv]
    layers.N.attn.wo, bo      transformer.h.N.attn.c_proj.weight (= wo.T), .bias
    layers.N.mlp_norm(_bias)  transformer.h.N.ln_2.weight / .bias
    layers.N.mlp.w_up, b_up   transformer.h.N.mlp.c_fc.weight (= w_up.T), .bias
    layers.N.mlp.w_down, b_down  transformer.h.N.mlp.c_proj.weight (= w_down.T), .bias
    norm, norm_bias           transformer.ln_f.weight / .bias
    output                    lm_head.weight (absent when tied)

  Our GPT-2 MLP is GELU with the tanh approximation: transformers' gelu_new (also
  gelu_pytorch_tanh, gelu_fast); the exact erf GELU ("gelu") is refused on import.

Import also accepts base-model files whose names lack the "model." / "transformer."
prefix (as the original GPT-2 release has them). Weights are read with
`safetensors.safe_open` only: pickle files (pytorch_model.bin) are never loaded.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import os
import re
import secrets
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..errors import ConfigError
from ..models import gpt2 as _gpt2
from ..models import llama as _llama
from .safetensors_stream import StreamWriter, nbytes

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


# --------------------------------------------------------------------------- layout


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


def hf_layout(arch: str, family_cfg, experts: str = "hub") -> list[HFTensor]:
    """The Hugging Face tensors of this model, in file order, each with its pieces.
    `experts`: MoE blocks' experts one tensor per expert and weight ("hub", what export
    writes) or fused as transformers holds them in memory ("fused"; see hf_moe)."""
    from . import hf_moe

    if experts not in ("hub", "fused"):
        raise ValueError(f"experts={experts!r}: choose hub or fused")
    cfg = _family_cfg(arch, family_cfg)
    specs = _specs(arch, cfg)

    def same(hf: str, ours: str) -> HFTensor:
        shape = specs[ours].shape
        return HFTensor(hf, shape, (Piece(ours, shape, tuple(range(len(shape))), (0,) * len(shape)),))

    def transposed(hf: str, ours: str) -> HFTensor:
        shape = specs[ours].shape
        return HFTensor(hf, shape[::-1], (Piece(ours, shape, (1, 0), (0, 0)),))

    out: list[HFTensor] = []
    if arch == "llama":
        hf_moe.check_layout(cfg)
        model_type, moe_layers = hf_moe.model_type(cfg), cfg.moe_layers
        out.append(same("model.embed_tokens.weight", "tok_emb"))
        for i in range(cfg.n_layers):
            p, h = f"layers.{i}.", f"model.layers.{i}."
            out += [same(h + "input_layernorm.weight", p + "attn_norm")]
            out += [same(h + f"self_attn.{w}_proj.weight", p + f"attn.w{w}") for w in "qkvo"]
            if cfg.qk_norm:
                out += [same(h + f"self_attn.{w}_norm.weight", p + f"attn.{w}_norm") for w in "qk"]
            out += [same(h + "post_attention_layernorm.weight", p + "mlp_norm")]
            if i in moe_layers:
                out += hf_moe.expert_tensors(cfg, model_type, i, specs, experts)
            else:
                out += [same(h + f"mlp.{w}_proj.weight", p + f"mlp.w_{w}") for w in ("gate", "up", "down")]
        out.append(same("model.norm.weight", "norm"))
    else:
        d = cfg.dim
        out += [same("transformer.wte.weight", "tok_emb"), same("transformer.wpe.weight", "pos_emb")]
        for i in range(cfg.n_layers):
            p, h = f"layers.{i}.", f"transformer.h.{i}."
            out += [same(h + "ln_1.weight", p + "attn_norm"), same(h + "ln_1.bias", p + "attn_norm_bias")]
            out.append(HFTensor(h + "attn.c_attn.weight", (d, 3 * d), tuple(
                Piece(p + f"attn.w{w}", (d, d), (1, 0), (0, k * d)) for k, w in enumerate("qkv"))))
            out.append(HFTensor(h + "attn.c_attn.bias", (3 * d,), tuple(
                Piece(p + f"attn.b{w}", (d,), (0,), (k * d,)) for k, w in enumerate("qkv"))))
            out += [transposed(h + "attn.c_proj.weight", p + "attn.wo"), same(h + "attn.c_proj.bias", p + "attn.bo"),
                    same(h + "ln_2.weight", p + "mlp_norm"), same(h + "ln_2.bias", p + "mlp_norm_bias"),
                    transposed(h + "mlp.c_fc.weight", p + "mlp.w_up"), same(h + "mlp.c_fc.bias", p + "mlp.b_up"),
                    transposed(h + "mlp.c_proj.weight", p + "mlp.w_down"),
                    same(h + "mlp.c_proj.bias", p + "mlp.b_down")]
        out += [same("transformer.ln_f.weight", "norm"), same("transformer.ln_f.bias", "norm_bias")]
    if not cfg.tie_embeddings:
        out.append(same("lm_head.weight", "output"))
    covered = collections.Counter((piece.ours, piece.lead) for t in out for piece in t.pieces)
    split = {name for name, lead in covered if lead}  # one tensor per expert: ours[j] for every j
    absent = set(hf_moe.absent(specs))
    expected = collections.Counter((name, lead) for name in specs if name not in absent
                                   for lead in ([(j,) for j in range(specs[name].shape[0])] if name in split else [()]))
    assert covered == expected, "hf_layout does not cover every parameter exactly once"
    return out


def _specs(arch: str, cfg) -> dict:
    return (_llama if arch == "llama" else _gpt2).param_specs(cfg)


def _family_cfg(arch: str, family_cfg):
    """A LlamaConfig / GPT2Config; also accepts ModelConfig or a dict of its fields."""
    if arch not in ARCHITECTURES:
        raise ConfigError(f"model.arch={arch!r}: Hugging Face interop supports {', '.join(ARCHITECTURES)}")
    want = _llama.LlamaConfig if arch == "llama" else _gpt2.GPT2Config
    if isinstance(family_cfg, want):
        return family_cfg
    if isinstance(family_cfg, (_llama.LlamaConfig, _gpt2.GPT2Config)):
        raise ConfigError(f"model.arch={arch!r} but the model config is a {type(family_cfg).__name__}: pass the "
                          f"{want.__name__} of the {arch} model")
    from ..config.schema import ModelConfig, RunConfig

    if isinstance(family_cfg, ModelConfig):
        fields = dict(vars(family_cfg))
    elif isinstance(family_cfg, Mapping):
        fields = dict(family_cfg)
    else:
        raise ConfigError(f"model config {family_cfg!r}: pass a {want.__name__}, a ModelConfig or a dict of "
                          "model.* fields")
    if fields.setdefault("arch", arch) != arch:
        raise ConfigError(f"model.arch={fields['arch']!r} differs from the requested arch {arch!r}: pass "
                          "matching ones")
    return RunConfig(model=ModelConfig(**fields)).family_config()


# --------------------------------------------------------------------------- config


def to_hf_config(arch: str, family_cfg, *, dtype: str = "bf16", bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> dict:
    """config.json for transformers (LlamaForCausalLM, Qwen3ForCausalLM,
    MixtralForCausalLM or Qwen3MoeForCausalLM for the llama family, as hf_moe.model_type
    chooses; GPT2LMHeadModel). Llama-family RoPE is written in the transformers 4.x form
    (rope_theta, rope_scaling with rope_type "llama3"), which transformers 5 also reads.
    GPT-2 dropouts are 0: our model has none. A ConfigError names what the target cannot
    represent (hf_moe.check_exportable)."""
    from . import hf_moe

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
    from . import hf_moe

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
    from . import hf_moe

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


def _llama_fields(config: Mapping, source: str, model_type: str = "llama") -> dict:
    """The fields llama, qwen3, mixtral and qwen3_moe share (hf_moe adds the rest)."""
    from . import hf_moe

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
        from . import hf_moe

        if cfg.qk_norm:
            fields["qk_norm"] = True
        if cfg.attn_head_dim is not None:
            fields["head_dim"] = cfg.attn_head_dim
        if cfg.moe is not None:
            fields["moe"] = hf_moe.moe_dict(cfg.moe)
    return fields


# --------------------------------------------------------------------------- export


def save_hf(params: Mapping[str, torch.Tensor], arch: str, family_cfg, out: str | os.PathLike,
            dtype: str = "bf16", max_shard_bytes: int = 2 * GiB, *, tokenizer: str | None = None,
            bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict:
    """Write `params` (our names) as a Hugging Face model directory `out`: config.json,
    generation_config.json, model.safetensors (or model-0000i-of-0000n.safetensors and
    model.safetensors.index.json when larger than max_shard_bytes) and, when `tokenizer`
    is a tokenizer.json path (or its directory), tokenizer.json plus the
    tokenizer_config.json / special_tokens_map.json beside it; for "bytes", those three
    files generated to encode as the bytes tokenizer does. bos/eos ids come from the
    tokenizer ("bytes": 256/257) unless given.

    Tensors are converted and appended to their file one at a time (headers are written
    first), so beyond `params` the extra memory is one converted tensor. DTensors are
    gathered one at a time with full_tensor(): then every rank must call save_hf, and
    rank 0 alone writes. `out` must not exist or be empty; it appears complete or not at
    all (written in a temporary sibling directory, then renamed). Returns a summary dict.
    """
    cfg = _family_cfg(arch, family_cfg)
    specs = _specs(arch, cfg)
    for name, spec in specs.items():
        if name not in params:
            raise ConfigError(f"save_hf: parameter {name} {spec.shape} of the {arch} model is missing from params")
        if tuple(params[name].shape) != tuple(spec.shape):
            raise ConfigError(f"save_hf: parameter {name} has shape {tuple(params[name].shape)} but the model "
                              f"config gives {spec.shape}: pass the config the parameters were built with")
    extra = sorted(set(params) - set(specs))
    if extra:
        raise ConfigError(f"save_hf: parameter {extra[0]} is not part of the {arch} model config: pass the config "
                          "the parameters were built with")
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    gathered = any(isinstance(t, DTensor) for t in params.values()) and dist.is_initialized()

    def fetch(name: str) -> torch.Tensor:
        t = params[name]
        if isinstance(t, DTensor):
            t = t.full_tensor()
        return t.detach().cpu()

    summary = _export(arch, cfg, fetch, out, dtype, max_shard_bytes, tokenizer, bos_token_id, eos_token_id,
                      write=not gathered or dist.get_rank() == 0)
    if gathered:
        dist.barrier()  # no rank returns before rank 0 has published `out`
    return summary


def export_dtype(precision: str) -> str:
    """The dtype an export of a run trained in `precision` is written in unless told
    otherwise: fp32 runs keep their fp32 weights, bf16 and fp8 runs get bf16."""
    return "fp32" if precision == "fp32" else "bf16"


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str | None = None,
                      max_shard_bytes: int = 2 * GiB) -> dict:
    """Export a meshtrain DCP checkpoint to a Hugging Face directory (see save_hf for what
    is written). `checkpoint` is a step_XXXXXXXX directory, a checkpoints root, or a run
    directory (its newest complete checkpoint). The model comes from meta.json's
    extra.config (the RunConfig); tokenizer files come from its data.tokenizer; dtype None
    is export_dtype of its train.precision, as checkpoint.export writes.

    Streaming: parameters are read from the checkpoint one at a time (a dcp.load of a
    state dict holding only that tensor, with meshtrain's safe metadata reader), converted
    and appended to the current safetensors file, whose header was written up front; no
    shard is assembled in memory. Peak memory is therefore a few copies of the largest
    parameter, whatever the model's size or max_shard_bytes: about three fp32 copies (the
    bytes DCP reads, the tensor torch.load makes of them, the target they are copied
    into) plus the converted tensor when the dtype or layout changes (for GPT-2's fused
    c_attn, the whole (d, 3d) tensor; a stacked expert weight is read once and kept while
    its per-expert tensors are written). Measured (tests/test_hf.py): exporting a 100 MiB
    checkpoint whose largest parameter is 4 MiB raises peak RSS by about 20 MiB.
    Nothing is written under `out` unless the export completes.
    Returns a summary dict: out, checkpoint, step, arch, dtype, files, total_bytes, config.
    """
    from ..config.schema import RunConfig
    from ..checkpoint import CheckpointError, read_meta

    path = resolve_checkpoint(checkpoint)
    meta = read_meta(path)
    if meta is None:
        raise CheckpointError(f"checkpoint {path}: meta.json is missing or corrupt: export a complete checkpoint")
    config = (meta.get("extra") or {}).get("config")
    if not isinstance(config, Mapping):
        raise CheckpointError(f"checkpoint {path}: meta.json has no extra.config (the run's RunConfig), so the "
                              "model is unknown; export a checkpoint written by meshtrain fit, or use save_hf")
    run = RunConfig.from_dict(config)
    arch, cfg = run.model.arch, run.family_config()
    shapes = _checkpoint_params(path)
    for name, spec in _specs(arch, cfg).items():
        if name not in shapes:
            raise CheckpointError(f"checkpoint {path}: parameter {name} {spec.shape} of the {arch} model in its "
                                  "config is not in the checkpoint; the checkpoint is damaged or from another model")
        if shapes[name][0] != tuple(spec.shape):
            raise CheckpointError(f"checkpoint {path}: parameter {name} has shape {shapes[name][0]} but its "
                                  f"config gives {spec.shape}; the checkpoint is damaged or from another model")

    def fetch(name: str) -> torch.Tensor:
        return _read_checkpoint_param(path, name, *shapes[name])

    dtype = export_dtype(run.train.precision) if dtype is None else dtype
    summary = _export(arch, cfg, fetch, out, dtype, max_shard_bytes, run.data.tokenizer, None, None)
    return {**summary, "checkpoint": str(path), "step": meta["step"]}


def resolve_checkpoint(checkpoint: str | os.PathLike) -> Path:
    """A step directory as it is; a run directory or a checkpoints root: its newest
    complete checkpoint. CheckpointError when there is none."""
    from ..checkpoint import META, CheckpointError, latest

    path = Path(checkpoint)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist: give a run directory or one of its "
                              "checkpoints/step_XXXXXXXX directories")
    if (path / META).is_file() or (path / ".metadata").is_file():
        return path
    for root in (path / "checkpoints", path):
        found = latest(root)
        if found is not None:
            return found
    raise CheckpointError(f"checkpoint {path}: no complete checkpoint in it or under {path / 'checkpoints'}: "
                          "train with checkpoint.every > 0, or give a step_XXXXXXXX directory")


def _checkpoint_params(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global shape and dtype of every parameter in a DCP checkpoint (metadata only)."""
    from ..checkpoint import SafeReader

    metadata = SafeReader(path).read_metadata()
    planner_data = getattr(metadata, "planner_data", None) or {}
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        key = tuple(planner_data.get(fqn, tuple(fqn.split(".", 1))))
        if len(key) == 2 and key[0] == "params" and hasattr(md, "size"):
            out[key[1]] = (tuple(md.size), md.properties.dtype)
    return out


def _read_checkpoint_param(path: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One parameter, read alone from the DCP checkpoint (any saved layout, no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ..checkpoint import CheckpointError, quiet_dcp, SafeReader

    target = torch.empty(shape, dtype=dtype)
    try:
        with quiet_dcp(), torch.no_grad():
            dcp.load({"params": {name: target}}, storage_reader=SafeReader(path), no_dist=True)
    except CheckpointException as e:  # a missing, damaged or hostile tensor file: one line, no traceback
        failure = next(iter(e.failures.values()))
        cause = failure[0] if isinstance(failure, tuple) else getattr(failure, "exc", failure)
        detail = str(cause).splitlines()[0].split(". ")[0] if str(cause) else "no detail"
        raise CheckpointError(f"checkpoint {path}: reading parameter {name} failed ({type(cause).__name__}: "
                              f"{detail}); the tensor files are damaged or not written by meshtrain: export "
                              "another checkpoint") from None
    return target


def _export(arch: str, cfg, fetch: Callable[[str], torch.Tensor], out, dtype: str, max_shard_bytes: int,
            tokenizer: str | None, bos: int | None, eos: int | None, write: bool = True) -> dict:
    if dtype not in DTYPES:
        raise ConfigError(f"export dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ConfigError(f"export max_shard_bytes={max_shard_bytes!r} must be a positive integer (bytes)")
    torch_dtype = DTYPES[dtype]
    to_hf_config(arch, cfg, dtype=dtype)  # what the target cannot hold: refused before any work
    layout = hf_layout(arch, cfg)
    tok_files, tok_bos, tok_eos = _tokenizer_files(tokenizer)
    bos = tok_bos if bos is None else bos
    eos = tok_eos if eos is None else eos
    config = to_hf_config(arch, cfg, dtype=dtype, bos_token_id=bos, eos_token_id=eos)
    fetch = _split_cache(layout, fetch)
    shards = _plan_shards(layout, torch_dtype, max_shard_bytes)
    files = [SINGLE_FILE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(nbytes(t.shape, torch_dtype) for t in layout)
    out = Path(out)
    _check_out(out)  # on every rank, before any collective a DTensor fetch makes

    def build(tmp: Path | None) -> None:
        for file, shard in zip(files, shards):
            writer = StreamWriter(tmp / file, [(t.name, t.shape, torch_dtype) for t in shard]) if tmp else None
            try:
                for t in shard:
                    tensor = _assemble(t, fetch, torch_dtype)
                    if writer:
                        writer.write(t.name, tensor)
                    del tensor
            except BaseException:
                if writer:
                    writer.abort()
                raise
            if writer:
                writer.close()
        if tmp is None:
            return
        if len(files) > 1:
            weight_map = {t.name: file for file, shard in zip(files, shards) for t in shard}
            _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        _write_json(tmp / "config.json", config)
        generation = {"_from_model_config": True}
        generation.update({k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None})
        _write_json(tmp / "generation_config.json", generation)
        for name, content in tok_files.items():
            with open(tmp / name, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())

    if write:
        _publish(out, build)
    else:
        build(None)
    return {"out": str(out), "arch": arch, "dtype": dtype, "files": files, "total_bytes": total, "config": config}


def _plan_shards(layout: list[HFTensor], dtype: torch.dtype, max_bytes: int) -> list[list[HFTensor]]:
    """Greedy, in order: a file takes tensors while it stays within max_bytes (a tensor
    larger than that gets a file of its own)."""
    shards: list[list[HFTensor]] = [[]]
    size = 0
    for t in layout:
        n = nbytes(t.shape, dtype)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def _split_cache(layout: list[HFTensor], fetch: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """`fetch`, keeping the last parameter that is split over several HF tensors (a
    stacked expert weight, one HF tensor per expert, which the layout lists in a row) so
    that it is fetched once, not once per expert. Others are fetched each time, as before."""
    split = {p.ours for t in layout for p in t.pieces if p.lead}
    kept: dict[str, torch.Tensor] = {}

    def cached(name: str) -> torch.Tensor:
        if name not in kept:
            kept.clear()
            if name not in split:
                return fetch(name)
            kept[name] = fetch(name)
        return kept[name]

    return cached


def _assemble(t: HFTensor, fetch: Callable[[str], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The HF tensor `t` in `dtype`, fetching its pieces one at a time."""
    if t.plain:
        src = fetch(t.pieces[0].ours)
        _check_piece(t.pieces[0], src)
        return src.to(dtype).contiguous()
    buf = torch.empty(t.shape, dtype=dtype)
    for piece in t.pieces:
        src = fetch(piece.ours)
        _check_piece(piece, src)
        buf[piece.region()].copy_(src[piece.lead].permute(piece.perm))
        del src
    return buf


def _check_piece(piece: Piece, src: torch.Tensor) -> None:
    if tuple(src.shape) != piece.shape:
        raise ConfigError(f"parameter {piece.ours} has shape {tuple(src.shape)}, expected {piece.shape}")


def _tokenizer_files(tokenizer: str | None) -> tuple[dict[str, bytes], int | None, int | None]:
    """({file name: content}, bos id, eos id) for data.tokenizer. Contents are read here, so
    what is checked below is what is written."""
    if tokenizer is None:
        return {}, None, None
    if tokenizer == "bytes":
        from ..data.tokenizer import ByteTokenizer

        files = {name: text.encode("utf-8") for name, text in ByteTokenizer().hf_files().items()}
        return files, ByteTokenizer.bos_id, ByteTokenizer.eos_id
    path = Path(tokenizer)
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        warnings.warn(f"export: tokenizer {tokenizer} not found, so no tokenizer files are exported; copy "
                      "tokenizer.json next to the weights yourself", stacklevel=3)
        return {}, None, None
    # The path comes from the checkpoint's meta.json: a damaged or hostile one must not get
    # an arbitrary file copied into the export, which may then be published.
    try:
        files = {"tokenizer.json": path.read_bytes()}
        content = json.loads(files["tokenizer.json"])
        is_tokenizer = isinstance(content, dict) and "model" in content
    except (OSError, ValueError):
        is_tokenizer = False
    if not is_tokenizer:
        warnings.warn(f"export: tokenizer {path} is not a Hugging Face tokenizer.json (JSON with a model key), so "
                      "no tokenizer files are exported; copy the right tokenizer.json next to the weights yourself",
                      stacklevel=3)
        return {}, None, None
    files.update({n: (path.parent / n).read_bytes() for n in TOKENIZER_FILES if (path.parent / n).is_file()})
    try:
        from ..data.tokenizer import load_tokenizer

        tok = load_tokenizer(str(path))
        return files, tok.bos_id, tok.eos_id
    except Exception as e:  # tokenizers missing or unreadable file: still copy, without ids
        warnings.warn(f"export: could not read {path} ({e}); bos/eos ids are left out of config.json",
                      stacklevel=3)
        return files, None, None


def _write_json(path: Path, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _publish(out: Path, build: Callable[[Path], None]) -> None:
    """build(tmp) in a temporary sibling of `out`, then rename it to `out`."""
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # mkdir, not tempfile.mkdtemp: the published directory gets the umask's mode (0o755
    # under umask 022), as one made by hand would, not mkdtemp's private 0o700.
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        build(tmp)
        _fsync_dir(tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"export: {out} already exists and is not an empty directory: choose a new output "
                          "directory or delete it")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- import


def load_hf_params(hf_dir: str | os.PathLike, arch: str, family_cfg, plan=None, mesh=None,
                   device: str | torch.device = "cpu", *, check_config: bool = True,
                   names=None) -> dict[str, torch.Tensor]:
    """Our parameters from a Hugging Face directory of safetensors weights.

    Every tensor the model needs must be present with its shape (else a one-line
    ConfigError naming the tensor, both shapes and the file), and no unknown weight may be
    left over. When config.json is there and `check_config`, it must describe the same
    model as `family_cfg` (max_position_embeddings may differ for llama).

    Without `plan`: full fp32 tensors on `device`. With `plan` (and `mesh`, the
    DeviceMesh; built from plan.mesh when None): fp32 DTensors laid out by the plan, as
    init_params makes them (requires_grad as the spec's `trainable`), each rank reading
    only the elements of its own local shard with `get_slice` (for GPT-2's fused c_attn
    and transposed Conv1D weights, the matching rows and columns of the file's tensor;
    for stacked expert weights, only the tensors of the rank's experts). `names`: load
    only these parameters (a pipeline stage's), still checking that the file has all of
    them. Parameters no HF file holds (the aux-free expert_bias) come back as zeros.
    """
    cfg = _family_cfg(arch, family_cfg)
    hf_dir = Path(hf_dir)
    if check_config and (hf_dir / "config.json").is_file():
        check_same_model(hf_dir, arch, cfg)
    with _WeightFiles(hf_dir) as files:
        layout = _pick_layout(files, arch, cfg)
        where = files.match(layout, arch, cfg.tie_embeddings)
        specs = _specs(arch, cfg)
        wanted = set(specs if names is None else names)
        pieces = _pieces_of(layout)
        if plan is None:
            return {name: _read_param(files, where, pieces.get(name, ()), tuple(slice(0, n) for n in spec.shape))
                    .to(device) for name, spec in specs.items() if name in wanted}
        return _load_planned(files, where, pieces, specs, plan, mesh, device, wanted)


def _pick_layout(files: "_WeightFiles", arch: str, cfg) -> list[HFTensor]:
    """The layout the files hold: for MoE models, experts per expert (the hub's, what
    save_pretrained writes) or fused (save_pretrained(save_original_format=False))."""
    layout = hf_layout(arch, cfg)
    if arch != "llama" or cfg.moe is None or not cfg.moe_layers:
        return layout
    fused = hf_layout(arch, cfg, experts="fused")
    i = cfg.moe_layers[0]
    probe = f"model.layers.{i}.mlp.experts.gate_up_proj"
    return fused if probe in files.names or probe[len("model."):] in files.names else layout


def _pieces_of(layout: list[HFTensor]) -> dict[str, list[tuple[str, Piece]]]:
    """Our parameter -> the (HF tensor, piece) pairs holding it."""
    out: dict[str, list[tuple[str, Piece]]] = {}
    for t in layout:
        for piece in t.pieces:
            out.setdefault(piece.ours, []).append((t.name, piece))
    return out


def _read_param(files: "_WeightFiles", where, pieces, index: tuple[slice, ...]) -> torch.Tensor:
    """ours[index] (fp32) from the HF tensors holding it, reading only those elements: a
    parameter split over tensors (one per expert) reads only the experts in `index`. No
    pieces: a parameter the files do not hold (hf_moe.absent), zeros."""
    if len(pieces) == 1 and not pieces[0][1].lead:
        hf_name, piece = pieces[0]
        return files.read(where[hf_name], piece, index)
    out = torch.zeros(tuple(s.stop - s.start for s in index), dtype=torch.float32)
    for hf_name, piece in pieces:
        n = len(piece.lead)
        if all(s.start <= j < s.stop for s, j in zip(index, piece.lead)):
            at = tuple(j - s.start for s, j in zip(index, piece.lead))
            out[at] = files.read(where[hf_name], piece, index[n:])
    return out


def check_same_model(hf_dir: Path, arch: str, cfg) -> None:
    """`<hf_dir>/config.json` describes the model `cfg` (a family config): the same
    architecture and shapes. Free to differ: max_seq_len (llama), ffn_dim when every
    block is MoE, and model.moe's training-only fields (balance, aux_coef, z_loss_coef,
    capacity_factor, bias_update_rate)."""
    from . import hf_moe

    cfg = _family_cfg(arch, cfg)
    theirs = read_hf_config(hf_dir)
    ours = _model_fields(arch, cfg)
    extra: list[tuple[str, Any, Any]] = []
    if arch == "llama":
        their_moe = theirs.pop("moe", None)
        ours.pop("moe", None)
        extra.append(("qk_norm", theirs.pop("qk_norm", False), ours.pop("qk_norm", False)))
        extra.append(("head_dim", theirs.pop("head_dim", None) or theirs["dim"] // theirs["n_heads"], cfg.head_dim))
        ours.pop("head_dim", None)
        extra += hf_moe.same_structure(their_moe, cfg)
        if their_moe is not None and not hf_moe.dense_blocks(their_moe, cfg.n_layers):
            del theirs["ffn_dim"]  # every block is MoE: unused
    diffs = []
    for key, value in theirs.items():
        if key == "max_seq_len" and arch == "llama":
            continue  # not a weight shape; RoPE works at any length
        diffs.append((key, value, ours[key]))
    for key, value, mine in diffs + extra:
        same = math.isclose(value, mine, rel_tol=1e-6) if isinstance(value, float) and isinstance(mine, (int, float)) \
            else value == mine
        if not same:
            raise ConfigError(f"{hf_dir / 'config.json'} gives model.{key}={json.dumps(value)} but the model config "
                              f"has model.{key}={json.dumps(mine)}: set model.{key} to {json.dumps(value)} (see "
                              "read_hf_config) or use weights of this model")


class _WeightFiles:
    """The safetensors files of a directory, opened lazily with safe_open."""

    def __init__(self, hf_dir: Path):
        self.dir = hf_dir
        self._open: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()
        self.names = self._index()

    def __enter__(self) -> "_WeightFiles":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _index(self) -> dict[str, Path]:
        if not self.dir.is_dir():
            raise ConfigError(f"{self.dir} is not a directory: give a Hugging Face model directory (config.json and "
                              "*.safetensors)")
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                entries = {str(k): v for k, v in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"{index}: not a safetensors index with a weight_map ({e}); restore it") from None
            # Every entry is checked before any file is touched: the index is data, and
            # must not make the loader open files elsewhere.
            names = {k: self._inside(v, f"{index}: weight_map entry {v!r} (tensor {k})") for k, v in entries.items()}
            for path in sorted(set(names.values())):
                if not path.is_file():
                    raise ConfigError(f"{index} names {path.name}, which is missing: restore the file")
            return names
        paths = sorted(self.dir.glob("*.safetensors"))
        if not paths:
            pickles = sorted(p.name for p in self.dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            found = f" (found {', '.join(pickles)}: pickle files, never loaded since they can run code)" if pickles \
                else ""
            raise ConfigError(f"{self.dir}: no *.safetensors weights{found}; save the model with transformers' "
                              "save_pretrained(..., safe_serialization=True)")
        names = {}
        for path in paths:
            self._inside(path.name, str(path))
            for name in self.handle(path).keys():
                if name in names:
                    raise ConfigError(f"{self.dir}: tensor {name} is in both {names[name].name} and {path.name}; "
                                      "keep one copy")
                names[name] = path
        return names

    def _inside(self, entry, what: str) -> Path:
        """<dir>/entry, refused unless it is a relative path that stays in the directory,
        symbolic links resolved. A Hugging Face hub snapshot (<repo>/snapshots/<revision>)
        may also link into its own <repo>/blobs, as the hub's cache does."""
        rule = f"weights are read only from inside {self.dir}"
        if not isinstance(entry, str) or not entry or "\0" in entry:
            raise ConfigError(f"{what} is not a file name; {rule}: restore the index")
        if os.path.isabs(entry):
            raise ConfigError(f"{what} is an absolute path; {rule}: restore the index")
        if ".." in Path(entry).parts:
            raise ConfigError(f"{what} leaves the model directory (..); {rule}: restore the index")
        root = Path(os.path.realpath(self.dir))
        roots = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
        real = Path(os.path.realpath(self.dir / entry))  # unlike resolve(), no error on a link loop
        if not any(real.is_relative_to(r) for r in roots):
            raise ConfigError(f"{what} resolves to {real}, outside the model directory (a symbolic link); {rule}: "
                              "copy the file into the directory instead of linking to it")
        return self.dir / entry

    def handle(self, path: Path):
        if path not in self._open:
            from safetensors import safe_open

            try:
                self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            except Exception as e:  # the library raises its own error types for a bad file
                raise ConfigError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); restore "
                                  "it") from None
        return self._open[path]

    def match(self, layout: list[HFTensor], arch: str, tied: bool) -> dict[str, tuple[Path, str]]:
        """Expected name -> (file, name in the file), shapes and dtypes checked, nothing left over."""
        prefix = _BASE_PREFIX[arch]
        where: dict[str, tuple[Path, str]] = {}
        for t in layout:
            candidates = [t.name] + ([t.name[len(prefix):]] if t.name.startswith(prefix) else [])
            found = next((c for c in candidates if c in self.names), None)
            if found is None:
                raise ConfigError(f"{self.dir}: tensor {t.name} (shape {t.shape}) is missing from "
                                  f"{self._file_list()}: the weights do not match config.json / the model config")
            path = self.names[found]
            sl = self.handle(path).get_slice(found)
            shape, st_dtype = tuple(sl.get_shape()), sl.get_dtype()
            if shape != t.shape:
                raise ConfigError(f"{self.dir}: tensor {found} has shape {shape} in {path.name} but the model config "
                                  f"expects {t.shape}: the weights do not match config.json / the model config")
            if st_dtype not in _ST_READ_DTYPES:
                raise ConfigError(f"{self.dir}: tensor {found} in {path.name} has dtype {st_dtype}: only float "
                                  f"weights ({', '.join(sorted(_ST_READ_DTYPES))}) can be imported")
            where[t.name] = (path, found)
        used = {name for _, name in where.values()}
        left = sorted(n for n in self.names if n not in used and not _IGNORABLE.search(n)
                      and not (tied and n == "lm_head.weight"))
        if left:
            raise ConfigError(f"{self.dir}: tensor {left[0]} in {self.names[left[0]].name} is not part of the "
                              f"{arch} model ({len(left)} such tensors): the checkpoint has features meshtrain's "
                              f"{arch} lacks; use a matching checkpoint")
        return where

    def _file_list(self) -> str:
        names = sorted({p.name for p in self.names.values()})
        return ", ".join(names) if len(names) <= 3 else f"{names[0]} ... ({len(names)} files)"

    def read(self, where: tuple[Path, str], piece: Piece, index: tuple[slice, ...]) -> torch.Tensor:
        """ours[index] (fp32) of `piece`, reading only those elements of the file's tensor."""
        path, name = where
        block = self.handle(path).get_slice(name)[piece.hf_index(index)]
        return block.permute(piece.inverse_perm).to(torch.float32).contiguous()


def _load_planned(files: _WeightFiles, where, pieces, specs, plan, mesh, device, wanted) -> dict[str, torch.Tensor]:
    from torch._prims_common import make_contiguous_strides_for
    from torch.distributed.tensor import DTensor

    if set(plan.params) != set(specs):
        missing = sorted(set(specs) ^ set(plan.params))[0]
        raise ConfigError(f"plan and model config differ at parameter {missing}: make the plan from this model's "
                          "specs (make_plan(build(arch, cfg).specs, ...))")
    from ..parallel.mesh import device_mesh_for

    if mesh is None:
        mesh = plan.mesh.build()
    device_mesh_for(mesh, plan.mesh.experts())  # built on every rank, holding experts or not
    out = {}
    for name, pp in plan.params.items():
        if name not in wanted:
            continue
        spec = pp.spec
        mesh_of = device_mesh_for(mesh, pp.mesh)
        runs = [_runs(_local_indices(n, d, mesh_of, pp.placements)) for d, n in enumerate(spec.shape)]
        local = torch.empty(tuple(sum(r[2] for r in dim_runs) for dim_runs in runs), dtype=spec.dtype)
        for combo in itertools.product(*runs):
            local_index = tuple(slice(lo, lo + n) for lo, _, n in combo)
            global_index = tuple(slice(go, go + n) for _, go, n in combo)
            local[local_index] = _read_param(files, where, pieces.get(name, ()), global_index)
        dt = DTensor.from_local(local.to(device), mesh_of, pp.placements, run_check=False,
                                shape=torch.Size(spec.shape), stride=make_contiguous_strides_for(spec.shape))
        out[name] = dt.requires_grad_(spec.trainable) if dt.is_floating_point() else dt
    return out


def _local_indices(size: int, dim: int, mesh, placements) -> list[int]:
    """Global indices along `dim` of this rank's local shard, in local order (handles
    nested and strided shards: the placements are applied to the index vector itself)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    one_dim = []
    for p in placements:
        if isinstance(p, _StridedShard) and p.dim == dim:
            one_dim.append(_StridedShard(0, split_factor=p.split_factor))
        elif isinstance(p, Shard) and p.dim == dim:
            one_dim.append(Shard(0))
        else:
            one_dim.append(Replicate())
    if all(isinstance(p, Replicate) for p in one_dim):
        return list(range(size))
    coords = torch.arange(size, device=mesh.device_type)
    return distribute_tensor(coords, mesh, one_dim, src_data_rank=None).to_local().cpu().tolist()


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs of `indices` as (local start, global start, length)."""
    runs: list[tuple[int, int, int]] = []
    for local, g in enumerate(indices):
        if runs and runs[-1][1] + runs[-1][2] == g:
            lo, go, n = runs[-1]
            runs[-1] = (lo, go, n + 1)
        else:
            runs.append((local, g, 1))
    return runs
