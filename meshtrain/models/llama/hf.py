"""The llama family's Hugging Face format (models/hf.py `HFFormat`): LlamaForCausalLM,
and through hf_moe.py Qwen3ForCausalLM, MixtralForCausalLM and Qwen3MoeForCausalLM.

Names, ours -> transformers (both store Linear weights (out, in), and our RoPE already
uses the half-split convention, so no q/k permutation):

    tok_emb                   model.embed_tokens.weight
    layers.N.attn_norm        model.layers.N.input_layernorm.weight
    layers.N.attn.w{q,k,v,o}  model.layers.N.self_attn.{q,k,v,o}_proj.weight
    layers.N.mlp_norm         model.layers.N.post_attention_layernorm.weight
    layers.N.mlp.w_{gate,up,down}  model.layers.N.mlp.{gate,up,down}_proj.weight
    norm                      model.norm.weight
    output                    lm_head.weight (absent when tied)

RoPE is written in the transformers 4.x form (rope_theta, rope_scaling with rope_type
"llama3"), which transformers 5 also reads; both forms import.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from ...errors import ConfigError
from ..hf import REQUIRED, HFFormat, HFTensor, get_key, refuse_key, same
from ..hf_experts import dense_blocks, expert_tensors, moe_dict, same_structure
from . import hf_moe

# model_type -> (causal-LM class, base-model class); the order of the import error's list.
MODEL_TYPES = {"llama": ("LlamaForCausalLM", "LlamaModel"), "qwen3": hf_moe.MODEL_TYPES["qwen3"],
               "mixtral": hf_moe.MODEL_TYPES["mixtral"], "qwen3_moe": hf_moe.MODEL_TYPES["qwen3_moe"]}


def tensors(cfg, specs: Mapping, experts: str) -> list[HFTensor]:
    hf_moe.check_layout(cfg)
    model_type, moe_layers = hf_moe.model_type(cfg), cfg.moe_layers
    out = [same(specs, "model.embed_tokens.weight", "tok_emb")]
    for i in range(cfg.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        out += [same(specs, h + "input_layernorm.weight", p + "attn_norm")]
        out += [same(specs, h + f"self_attn.{w}_proj.weight", p + f"attn.w{w}") for w in "qkvo"]
        if cfg.qk_norm:
            out += [same(specs, h + f"self_attn.{w}_norm.weight", p + f"attn.{w}_norm") for w in "qk"]
        out += [same(specs, h + "post_attention_layernorm.weight", p + "mlp_norm")]
        if i in moe_layers:
            out += expert_tensors(cfg, i, specs, experts, mixtral=model_type == "mixtral")
        else:
            out += [same(specs, h + f"mlp.{w}_proj.weight", p + f"mlp.w_{w}") for w in ("gate", "up", "down")]
    out.append(same(specs, "model.norm.weight", "norm"))
    return out


def config(cfg) -> dict:
    """config.json keys: LlamaForCausalLM's, or the Qwen3 / Mixtral / Qwen3-MoE target's
    (hf_moe.model_type chooses; hf_moe.check_exportable refuses what it cannot hold)."""
    model_type = hf_moe.check_exportable(cfg)
    rope_scaling = None
    if cfg.rope_scaling:
        s = cfg.rope_scaling
        rope_scaling = {"rope_type": "llama3", "factor": float(s["factor"]),
                        "low_freq_factor": float(s["low_freq_factor"]),
                        "high_freq_factor": float(s["high_freq_factor"]),
                        "original_max_position_embeddings": int(s["original_max_position_embeddings"])}
    keys = {"architectures": [MODEL_TYPES[model_type][0]], "model_type": model_type,
            "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": float(cfg.rope_theta), "rope_scaling": rope_scaling, "attention_bias": False,
            "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1}
    if model_type != "llama":
        for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
            del keys[key]
        keys.update(hf_moe.config_keys(cfg, model_type))
    return keys


def fields(config: Mapping, model_type: str, source: str) -> dict:
    """model.* fields of a llama, qwen3, mixtral or qwen3_moe config.json."""
    out = _llama_fields(config, source, model_type)
    if model_type in hf_moe.MODEL_TYPES:
        out = hf_moe.import_fields(config, model_type, out, source)
    return out


def _llama_fields(config: Mapping, source: str, model_type: str = "llama") -> dict:
    """The fields llama, qwen3, mixtral and qwen3_moe share (hf_moe adds the rest)."""
    defaults = hf_moe.DEFAULTS[model_type]
    dim = get_key(config, ("hidden_size",), REQUIRED, source)
    n_heads = get_key(config, ("num_attention_heads",), REQUIRED, source)
    n_kv = get_key(config, ("num_key_value_heads",), n_heads, source)
    head_dim = get_key(config, ("head_dim",), None, source) if model_type == "llama" else None
    if head_dim is not None and n_heads and head_dim * n_heads != dim:
        raise ConfigError(f"{source}: head_dim={head_dim} differs from hidden_size / num_attention_heads = "
                          f"{dim} / {n_heads}: meshtrain's llama derives the head size from dim and n_heads, so "
                          "this checkpoint cannot be imported")
    refuse_key(config, "hidden_act", lambda v: v == "silu", "silu", "meshtrain's llama MLP is SwiGLU (silu); only "
            "hidden_act silu checkpoints can be imported", source)
    for key in ("attention_bias", "mlp_bias"):
        refuse_key(config, key, lambda v: v is False, False, f"meshtrain's llama has no biases; only {key} false "
                "checkpoints can be imported", source)
    max_seq_len = get_key(config, ("max_position_embeddings",), defaults["max_position_embeddings"], source)
    theta, scaling = _rope(config, source, max_seq_len, defaults["rope_theta"])
    return {"arch": "llama", "dim": dim, "n_layers": get_key(config, ("num_hidden_layers",), REQUIRED, source),
            "n_heads": n_heads, "n_kv_heads": n_kv, "ffn_dim": get_key(config, ("intermediate_size",), REQUIRED, source),
            "vocab_size": get_key(config, ("vocab_size",), REQUIRED, source), "max_seq_len": max_seq_len,
            "rope_theta": theta,
            "norm_eps": float(get_key(config, ("rms_norm_eps",), defaults["rms_norm_eps"], source, float)),
            "tie_embeddings": bool(get_key(config, ("tie_word_embeddings",), False, source, bool)),
            "rope_scaling": scaling}


def _rope(config: Mapping, source: str, max_seq_len: int,
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


def model_fields(cfg) -> dict:
    out: dict[str, Any] = {}
    if cfg.qk_norm:
        out["qk_norm"] = True
    if cfg.attn_head_dim is not None:
        out["head_dim"] = cfg.attn_head_dim
    if cfg.moe is not None:
        out["moe"] = moe_dict(cfg.moe)
    return out


def compare(theirs: dict, ours: dict, cfg) -> list[tuple[str, Any, Any]]:
    """The head size, q/k norms and the model.moe fields that shape the model; ffn_dim does
    not matter when every block is MoE."""
    their_moe = theirs.pop("moe", None)
    ours.pop("moe", None)
    out = [("qk_norm", theirs.pop("qk_norm", False), ours.pop("qk_norm", False)),
           ("head_dim", theirs.pop("head_dim", None) or theirs["dim"] // theirs["n_heads"], cfg.head_dim)]
    ours.pop("head_dim", None)
    out += same_structure(their_moe, cfg)
    if their_moe is not None and not dense_blocks(their_moe, cfg.n_layers):
        del theirs["ffn_dim"]  # every block is MoE: unused
    return out


def fused_probe(cfg) -> str | None:
    """transformers' in-memory (fused) expert tensor of the first MoE block."""
    if cfg.moe is None or not cfg.moe_layers:
        return None
    return f"model.layers.{cfg.moe_layers[0]}.mlp.experts.gate_up_proj"


HF = HFFormat(architecture="LlamaForCausalLM", base_prefix="model.", model_types=MODEL_TYPES, tensors=tensors,
              config=config, fields=fields, absent=hf_moe.absent, model_fields=model_fields, compare=compare,
              free=frozenset({"max_seq_len"}),  # not a weight shape: RoPE works at any length
              fused_probe=fused_probe)
