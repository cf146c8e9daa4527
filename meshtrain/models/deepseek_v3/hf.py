"""The deepseek_v3 family's Hugging Face format: DeepseekV3ForCausalLM.

Names, ours -> transformers (N a block, `model.layers.N.` left out; Linear weights are
(out, in) in both, and the rotary dims keep the released interleaved layout, which our
forward applies as it is, so nothing is permuted):

    tok_emb                 model.embed_tokens.weight
    layers.N.attn_norm      input_layernorm.weight
    layers.N.attn.wq_a      self_attn.q_a_proj.weight        (q_lora_rank set)
    layers.N.attn.q_norm    self_attn.q_a_layernorm.weight
    layers.N.attn.wq_b      self_attn.q_b_proj.weight
    layers.N.attn.wq        self_attn.q_proj.weight          (q_lora_rank null)
    layers.N.attn.wkv_a     self_attn.kv_a_proj_with_mqa.weight
    layers.N.attn.kv_norm   self_attn.kv_a_layernorm.weight
    layers.N.attn.wkv_b     self_attn.kv_b_proj.weight
    layers.N.attn.wo        self_attn.o_proj.weight
    layers.N.mlp_norm       post_attention_layernorm.weight
    layers.N.mlp.w_*        mlp.{gate,up,down}_proj.weight   (dense blocks)
    layers.N.moe.router     mlp.gate.weight                  (MoE blocks)
    layers.N.moe.expert_bias  mlp.gate.e_score_correction_bias
    layers.N.moe.w_*[J]     mlp.experts.J.{gate,up,down}_proj.weight (or fused: models/hf_experts.py)
    layers.N.moe.shared.w_* mlp.shared_experts.{gate,up,down}_proj.weight
    norm, output            model.norm.weight, lm_head.weight
    mtp.K.*                 model.layers.{n_layers + K}.*: enorm, hnorm, eh_proj, the block's tensors
                            as above, shared_head.norm (mtp.K.norm), and copies of the embedding and
                            head (embed_tokens, shared_head.head) that export writes and import skips;
                            absent ones start from the seed (transformers' model ignores these layers)

config.json: the release's keys (q_lora_rank, kv_lora_rank, qk_{nope,rope}_head_dim,
v_head_dim, n_routed_experts, num_experts_per_tok, moe_intermediate_size,
n_shared_experts, n_group, topk_group, routed_scaling_factor, norm_topk_prob,
first_k_dense_replace, rope_scaling {type: yarn, ...}, rope_interleave, scoring_func
sigmoid, topk_method noaux_tc). What DeepseekV3ForCausalLM cannot hold is refused on
export with the key named: a softmax router, no shared expert, MoE blocks other than
"all after the first k". A model trained without the aux-free bias exports a zero bias
(transformers starts the missing buffer at zero: the same routing).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from ...errors import ConfigError
from ..hf import REQUIRED, HFFormat, HFTensor, get_key, refuse_key, same
from ..hf_experts import expert_tensors, layers_spec, moe_dict, moe_fields, same_structure

MODEL_TYPES = {"deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Model")}
_ATTN = {"attn.wq_a": "q_a_proj", "attn.q_norm": "q_a_layernorm", "attn.wq_b": "q_b_proj", "attn.wq": "q_proj",
         "attn.wkv_a": "kv_a_proj_with_mqa", "attn.kv_norm": "kv_a_layernorm", "attn.wkv_b": "kv_b_proj",
         "attn.wo": "o_proj"}


def tensors(cfg, specs: Mapping, experts: str) -> list[HFTensor]:
    out = [same(specs, "model.embed_tokens.weight", "tok_emb")]
    for i in range(cfg.n_layers):
        out += _block(cfg, specs, experts, f"layers.{i}.", f"model.layers.{i}.", i in cfg.moe_layers, i)
    out.append(same(specs, "model.norm.weight", "norm"))
    for k in range(cfg.mtp.depth):  # the release's layers n_layers + k: a module, and copies of embedding and head
        p, h = f"mtp.{k}.", f"model.layers.{cfg.n_layers + k}."
        out += [same(specs, h + "enorm.weight", p + "enorm"), same(specs, h + "hnorm.weight", p + "hnorm"),
                same(specs, h + "eh_proj.weight", p + "eh_proj")]
        out += _block(cfg, specs, experts, p, h, cfg.moe is not None, cfg.n_layers + k)
        out += [same(specs, h + "shared_head.norm.weight", p + "norm"),
                same(specs, h + "embed_tokens.weight", "tok_emb", copy=True),
                same(specs, h + "shared_head.head.weight", "tok_emb" if cfg.tie_embeddings else "output", copy=True)]
    return out


def _block(cfg, specs: Mapping, experts: str, p: str, h: str, moe_block: bool, index: int) -> list[HFTensor]:
    """The tensors of the block whose parameters are under `p`, named under `h`."""
    out = [same(specs, h + "input_layernorm.weight", p + "attn_norm")]
    out += [same(specs, h + f"self_attn.{theirs}.weight", p + ours) for ours, theirs in _ATTN.items() if p + ours in specs]
    out.append(same(specs, h + "post_attention_layernorm.weight", p + "mlp_norm"))
    if not moe_block:
        return out + [same(specs, h + f"mlp.{w}_proj.weight", p + f"mlp.w_{w}") for w in ("gate", "up", "down")]
    out += expert_tensors(cfg, index, specs, experts, prefix=(p + "moe.", h))
    if p + "moe.expert_bias" in specs:
        out.append(same(specs, h + "mlp.gate.e_score_correction_bias", p + "moe.expert_bias"))
    return out + [same(specs, h + f"mlp.shared_experts.{w}_proj.weight", p + f"moe.shared.w_{w}")
                  for w in ("gate", "up", "down")]


def _first_dense(cfg) -> int:
    """first_k_dense_replace: the dense blocks must be the first k."""
    layers = cfg.moe_layers
    k = layers[0] if layers else cfg.n_layers
    if layers != tuple(range(k, cfg.n_layers)):
        raise ConfigError(f"export as DeepseekV3ForCausalLM: model.moe.layers={cfg.moe.layers!r} is not 'k:' (the "
                          "first k blocks dense, then every block MoE), the only pattern DeepSeek-V3 holds; train "
                          "with such a model.moe.layers to export")
    return k


def config(cfg) -> dict:
    """config.json keys of DeepseekV3ForCausalLM (module docstring)."""
    m, a = cfg.moe, cfg.mla
    if m is not None and cfg.moe_layers:
        for key, bad, why in (("router", m.router != "sigmoid", "DeepSeek-V3 scores experts by a sigmoid"),
                              ("shared_experts", m.shared_experts < 1, "DeepSeek-V3 always has a shared expert")):
            if bad:
                raise ConfigError(f"export as DeepseekV3ForCausalLM: model.moe.{key}={json.dumps(getattr(m, key))} "
                                  f"cannot be exported: {why}; train with another model.moe.{key} to export")
    moe = m if m is not None else moe_fields({})
    get = (lambda k: getattr(moe, k)) if m is not None else moe.get
    scaling = None
    if cfg.rope_scaling:
        scaling = {**cfg.rope_scaling, "rope_type": "yarn"}
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": cfg.dim,
            "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_heads, "q_lora_rank": a.q_lora_rank, "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim, "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim, "rope_interleave": a.rope_interleave,
            "n_routed_experts": get("num_experts"), "num_experts_per_tok": get("top_k"),
            "moe_intermediate_size": get("expert_ffn_dim"), "n_shared_experts": max(get("shared_experts"), 1),
            "n_group": get("groups"), "topk_group": get("group_top_k"),
            "routed_scaling_factor": float(get("route_scale")), "norm_topk_prob": bool(get("norm_topk")),
            "first_k_dense_replace": _first_dense(cfg) if m is not None else cfg.n_layers, "moe_layer_freq": 1,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": float(cfg.rope_theta), "rope_scaling": scaling, "attention_bias": False,
            "attention_dropout": 0.0, "num_nextn_predict_layers": cfg.mtp.depth}


def fields(config: Mapping, model_type: str, source: str) -> dict:
    """model.* fields of a deepseek_v3 config.json."""
    n_heads = get_key(config, ("num_attention_heads",), REQUIRED, source)
    refuse_key(config, "num_key_value_heads", lambda v: v == n_heads, n_heads, "DeepSeek-V3 attention has as many "
               "key/value heads as query heads (MLA)", source)
    refuse_key(config, "hidden_act", lambda v: v == "silu", "silu", "meshtrain's experts are SwiGLU (silu)", source)
    refuse_key(config, "attention_bias", lambda v: v is False, False, "meshtrain's MLA has no biases", source)
    refuse_key(config, "scoring_func", lambda v: v == "sigmoid", "sigmoid", "DeepSeek-V3 routes by sigmoid scores",
               source)
    refuse_key(config, "topk_method", lambda v: v == "noaux_tc", "noaux_tc", "meshtrain routes as DeepSeek-V3 "
               "(noaux_tc: group-limited, bias-balanced); DeepSeek-V2's greedy methods are not implemented", source)
    refuse_key(config, "moe_layer_freq", lambda v: v == 1, 1, "every block after the first dense ones is MoE",
               source)
    n_layers = get_key(config, ("num_hidden_layers",), REQUIRED, source)
    max_len = get_key(config, ("max_position_embeddings",), 4096, source)
    theta, scaling = _rope(config, source)
    mla = {"q_lora_rank": get_key(config, ("q_lora_rank",), None, source),
           "kv_lora_rank": get_key(config, ("kv_lora_rank",), REQUIRED, source),
           "qk_nope_head_dim": get_key(config, ("qk_nope_head_dim",), REQUIRED, source),
           "qk_rope_head_dim": get_key(config, ("qk_rope_head_dim",), REQUIRED, source),
           "v_head_dim": get_key(config, ("v_head_dim",), REQUIRED, source),
           "rope_interleave": bool(get_key(config, ("rope_interleave",), True, source, bool))}
    out = {"arch": "deepseek_v3", "dim": get_key(config, ("hidden_size",), REQUIRED, source), "n_layers": n_layers,
           "n_heads": n_heads, "n_kv_heads": None, "ffn_dim": get_key(config, ("intermediate_size",), REQUIRED, source),
           "vocab_size": get_key(config, ("vocab_size",), REQUIRED, source), "max_seq_len": max_len,
           "rope_theta": theta, "norm_eps": float(get_key(config, ("rms_norm_eps",), 1e-6, source, float)),
           "tie_embeddings": bool(get_key(config, ("tie_word_embeddings",), False, source, bool)),
           "rope_scaling": scaling, "mla": mla,
           "mtp": {"depth": get_key(config, ("num_nextn_predict_layers", "num_mtp_layers"), 0, source)}}
    first_dense = get_key(config, ("first_k_dense_replace",), 3, source)
    experts = get_key(config, ("n_routed_experts", "num_local_experts"), 256, source)
    if first_dense < n_layers and experts:
        out["moe"] = moe_fields({
            "num_experts": experts, "top_k": get_key(config, ("num_experts_per_tok",), 8, source),
            "expert_ffn_dim": get_key(config, ("moe_intermediate_size",), REQUIRED, source),
            "shared_experts": get_key(config, ("n_shared_experts",), 1, source), "router": "sigmoid",
            "balance": "aux_free", "aux_coef": 0.0, "layers": layers_spec(list(range(first_dense, n_layers)), n_layers),
            "norm_topk": bool(get_key(config, ("norm_topk_prob",), True, source, bool)),
            "route_scale": float(get_key(config, ("routed_scaling_factor",), 1.0, source, float)),
            "groups": get_key(config, ("n_group",), 1, source), "group_top_k": get_key(config, ("topk_group",), 1, source)})
    return out


def _rope(config: Mapping, source: str) -> tuple[float, dict | None]:
    """(rope_theta, our YaRN rope_scaling or None) from the 4.x keys or 5.x rope_parameters."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"{source}: {key}={json.dumps(rope)} must be a mapping")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{source}: rope_theta={theta!r} must be a positive number")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind != "yarn":
        raise ConfigError(f"{source}: {key}.rope_type={kind!r} is not supported: meshtrain's deepseek_v3 implements "
                          "plain RoPE and YaRN only")
    defaults = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    scaling: dict[str, Any] = {"type": "yarn"}
    for name in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        value = rope.get(name, defaults.get(name))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: {key}.{name}={value!r}: YaRN needs a number")
        scaling[name] = int(value) if name == "original_max_position_embeddings" else float(value)
    return float(theta), scaling


def model_fields(cfg) -> dict:
    a = cfg.mla
    out: dict[str, Any] = {"mla": {"q_lora_rank": a.q_lora_rank, "kv_lora_rank": a.kv_lora_rank,
                                   "qk_nope_head_dim": a.qk_nope_head_dim, "qk_rope_head_dim": a.qk_rope_head_dim,
                                   "v_head_dim": a.v_head_dim, "rope_interleave": a.rope_interleave}}
    if cfg.moe is not None:
        out["moe"] = moe_dict(cfg.moe)
    out["mtp"] = {"depth": cfg.mtp.depth}
    return out


def compare(theirs: dict, ours: dict, cfg) -> list[tuple[str, Any, Any]]:
    """model.moe's fields that shape the model, and whether the aux-free bias (which the
    files hold) routes; ffn_dim does not matter when every block is MoE."""
    their_moe = theirs.pop("moe", None)
    ours.pop("moe", None)
    out = [("mtp.depth", theirs.pop("mtp")["depth"], ours.pop("mtp")["depth"])]
    out += same_structure(their_moe, cfg)
    if their_moe is not None and cfg.moe is not None:
        out.append(("moe.balance", their_moe["balance"], cfg.moe.balance))
    return out


def fused_probe(cfg) -> str | None:
    return f"model.layers.{cfg.moe_layers[0]}.mlp.experts.gate_up_proj" if cfg.moe_layers else None


HF = HFFormat(architecture="DeepseekV3ForCausalLM", base_prefix="model.", model_types=MODEL_TYPES, tensors=tensors,
              config=config, fields=fields, model_fields=model_fields, compare=compare,
              free=frozenset({"max_seq_len"}), fused_probe=fused_probe,
              seeded=lambda cfg: tuple(f"mtp.{k}." for k in range(cfg.mtp.depth)))
