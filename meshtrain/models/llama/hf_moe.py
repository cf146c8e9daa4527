"""Hugging Face targets of the llama family beyond LlamaForCausalLM: Qwen3 (per-head q/k
RMSNorm, a head dim of its own), Mixtral and Qwen3-MoE (mixture-of-experts blocks). This
module holds what is particular to them: the choice of target, config.json keys both
ways, the tensor names of the attention norms and experts, and what cannot be exported.
The rest of the llama family's format is hf.py's; the machinery (streamed export, import
by slices) is interop's.

The transformers architecture a llama-family model exports as (the whole rule):

                     no model.qk_norm                  model.qk_norm
    dense            LlamaForCausalLM (llama)          Qwen3ForCausalLM (qwen3)
    model.moe set    MixtralForCausalLM (mixtral)      Qwen3MoeForCausalLM (qwen3_moe)

Tensors, ours -> transformers (N a block, J an expert, `model.layers.N.` left out; our
stacked expert weights are (E, F, d) for w_gate / w_up and (E, d, F) for w_down, and
w[J] is expert J's slice):

  qwen3, qwen3_moe:  layers.N.attn.{q,k}_norm   self_attn.{q,k}_norm.weight   (head_dim,)
  mixtral:           layers.N.moe.router        block_sparse_moe.gate.weight  (E, d)
                     layers.N.moe.w_gate[J]     block_sparse_moe.experts.J.w1.weight (F, d)
                     layers.N.moe.w_up[J]       block_sparse_moe.experts.J.w3.weight (F, d)
                     layers.N.moe.w_down[J]     block_sparse_moe.experts.J.w2.weight (d, F)
  qwen3_moe:         layers.N.moe.router        mlp.gate.weight
                     layers.N.moe.w_{gate,up,down}[J]  mlp.experts.J.{gate,up,down}_proj.weight
                     dense blocks: layers.N.mlp.w_*, named as for llama (mlp.*_proj.weight)

That per-expert layout is the hub's and what save_pretrained of transformers 5 writes (it
converts its fused in-memory experts back, see transformers' conversion_mapping.py);
export writes it and from_pretrained fuses it on load. Import reads it, and also the
fused in-memory form that save_pretrained(save_original_format=False) writes, for both:
mlp.gate.weight (the router), mlp.experts.gate_up_proj (E, 2F, d) = [w_gate | w_up] on
dim 1, mlp.experts.down_proj (E, d, F) = w_down. Either way a rank that holds experts
[a, b) of a block reads only those experts' bytes.

config.json (besides the llama keys):
  num_local_experts (mixtral) / num_experts (qwen3_moe)  <->  model.moe.num_experts
  num_experts_per_tok                                 <->  model.moe.top_k
  intermediate_size (mixtral) / moe_intermediate_size <->  model.moe.expert_ffn_dim
  intermediate_size (qwen3, qwen3_moe)                <->  model.ffn_dim (dense blocks; a
      Mixtral import sets ffn_dim to the expert size, unused since every block is MoE)
  norm_topk_prob (qwen3_moe)                          <->  model.moe.norm_topk (Mixtral
      always renormalises the top-k gates)
  mlp_only_layers, decoder_sparse_step (qwen3_moe)    <->  model.moe.layers: block N is MoE
      unless N is in mlp_only_layers or (N + 1) % decoder_sparse_step != 0. Export writes
      decoder_sparse_step 1 and lists our dense blocks in mlp_only_layers, which expresses
      any choice of blocks; import gives "all", a slice ("1::2") or a list.
  router_aux_loss_coef                                <->  model.moe.aux_coef (0 unless
      balance aux): carried over as a hyperparameter, not an identity -- transformers' loss
      pools the whole batch and all layers, and is top_k times ours for the same routing.
  head_dim (written always)                           <->  model.head_dim
  output_router_logits false; router_jitter_noise 0; no sliding window.

Refused on export, with a ConfigError naming the field: model.moe.router sigmoid,
shared_experts > 0, route_scale != 1 and balance aux_free (a learned expert_bias steers
which experts are chosen): Mixtral and Qwen3-MoE have none of these. For Mixtral also
dense blocks (model.moe.layers other than every block), norm_topk false and top_k 1
(Mixtral gives a lone expert the gate 1, meshtrain its router probability; for Qwen3-MoE
top_k 1 exports as norm_topk_prob false, which is ours). DeepSeek-V3, the architecture
with a sigmoid router, expert bias and shared experts, is the deepseek_v3 family's target
(models/deepseek_v3/hf.py), not llama's: its attention is MLA. capacity_factor is allowed: transformers computes every
routed token (dropless), as meshtrain does at inference without one; a model trained
with dropped tokens is then evaluated without drops, the usual practice.

On import, model.moe.balance aux_free is allowed: expert_bias is not in the files and
starts at 0, which routes as the checkpoint does. Refused on import: a sliding window
shorter than max_position_embeddings, attention biases, and a single expert per token
with renormalised gates (Mixtral's num_experts_per_tok 1, or Qwen3-MoE's with
norm_topk_prob), whose gate of 1 meshtrain's router does not give.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from ...errors import ConfigError
from ..hf import get_key
from ..hf_experts import layers_spec, moe_fields

# model_type -> (the causal-LM class, the base-model class)
MODEL_TYPES = {"mixtral": ("MixtralForCausalLM", "MixtralModel"), "qwen3": ("Qwen3ForCausalLM", "Qwen3Model"),
               "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeModel")}
# transformers' defaults for keys config.json may leave out.
DEFAULTS = {"llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
            "mixtral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6},
            "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
            "qwen3_moe": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}}


def model_type(cfg) -> str:
    """The transformers model_type a LlamaConfig exports as (see the table above)."""
    if cfg.moe is not None and cfg.moe_layers:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    return "qwen3" if cfg.qk_norm else "llama"


def check_exportable(cfg) -> str:
    """The model_type of `cfg`, or a ConfigError for what that architecture cannot hold."""
    t = model_type(cfg)
    if t in ("llama", "qwen3"):
        return t
    m, cls = cfg.moe, MODEL_TYPES[t][0]

    def refuse(key: str, value: Any, why: str, fix: str) -> None:
        raise ConfigError(f"export as {cls}: model.moe.{key}={json.dumps(value)} {why}; {fix}")

    if m.router != "softmax":
        refuse("router", m.router, "cannot be exported: Mixtral and Qwen3-MoE route by a softmax over the experts",
               "train with model.moe.router softmax to export to Hugging Face")
    if m.shared_experts:
        refuse("shared_experts", m.shared_experts, "cannot be exported: Mixtral and Qwen3-MoE have no shared "
               "experts", "train with model.moe.shared_experts 0 to export to Hugging Face")
    if m.route_scale != 1:
        refuse("route_scale", m.route_scale, "cannot be exported: Mixtral and Qwen3-MoE do not scale the gates",
               "train with model.moe.route_scale 1 to export to Hugging Face")
    if m.balance == "aux_free":
        refuse("balance", m.balance, "cannot be exported: its learned expert_bias changes which experts are "
               "chosen, and Mixtral and Qwen3-MoE have no such bias", "train with model.moe.balance aux or none "
               "to export to Hugging Face")
    if t == "mixtral":
        dense = [i for i in range(cfg.n_layers) if i not in cfg.moe_layers]
        if dense:
            refuse("layers", m.layers if isinstance(m.layers, str) else list(m.layers),
                   f"leaves blocks {dense} dense, but Mixtral (the target of MoE models without model.qk_norm) "
                   "has experts in every block", "set model.moe.layers all, or use model.qk_norm true (exported "
                   "as Qwen3-MoE, which has dense blocks)")
        if m.top_k == 1:
            refuse("top_k", 1, "cannot be exported as Mixtral: Mixtral gives a token's single expert the gate 1, "
                   "meshtrain its router probability", "use top_k >= 2, or model.qk_norm true (Qwen3-MoE)")
        if not m.norm_topk:
            refuse("norm_topk", False, "cannot be exported as Mixtral, which always renormalises the top-k gates",
                   "train with model.moe.norm_topk true, or use model.qk_norm true (Qwen3-MoE has "
                   "norm_topk_prob)")
    return t


# --------------------------------------------------------------------------- config


def config_keys(cfg, t: str) -> dict:
    """config.json keys of target `t` beyond the attention and RoPE keys shared with llama."""
    no_window = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}
    if t == "qwen3":
        return {"attention_bias": False, **no_window}
    m = cfg.moe
    routing = {"num_experts_per_tok": m.top_k, "output_router_logits": False,
               "router_aux_loss_coef": float(m.aux_coef) if m.balance == "aux" else 0.0}
    if t == "mixtral":
        return {"intermediate_size": m.expert_ffn_dim, "sliding_window": None, "num_local_experts": m.num_experts,
                **routing, "router_jitter_noise": 0.0}
    moe_layers = cfg.moe_layers
    return {"attention_bias": False, **no_window, "decoder_sparse_step": 1,
            "moe_intermediate_size": m.expert_ffn_dim, "num_experts": m.num_experts, **routing,
            "norm_topk_prob": bool(m.norm_topk and m.top_k > 1),
            "mlp_only_layers": [i for i in range(cfg.n_layers) if i not in moe_layers]}


def import_fields(config: Mapping, t: str, fields: dict, source: str) -> dict:
    """Our ModelConfig fields of a mixtral / qwen3 / qwen3_moe config.json: the llama
    `fields` (read with the same keys) completed with qk_norm, head_dim and moe."""
    fields = dict(fields)
    dim, n_heads, n_layers = fields["dim"], fields["n_heads"], fields["n_layers"]
    head_dim = get_key(config, ("head_dim",), 128 if t == "qwen3" else None, source)
    if head_dim is not None and (dim % n_heads or head_dim != dim // n_heads):
        fields["head_dim"] = head_dim
    max_len = fields["max_seq_len"]
    window = get_key(config, ("sliding_window",), None, source)
    if t != "mixtral" and not get_key(config, ("use_sliding_window",), False, source, bool):
        window = None
    if window is not None and window < max_len:
        raise ConfigError(f"{source}: sliding_window={window} is not supported: meshtrain's llama attends to the "
                          f"whole context; only checkpoints without a window shorter than max_position_embeddings "
                          f"({max_len}) can be imported")
    if t != "mixtral":
        fields["qk_norm"] = True
    if t == "qwen3":
        return fields
    if t == "mixtral":
        experts = get_key(config, ("num_local_experts", "num_experts"), 8, source)
        top_k = get_key(config, ("num_experts_per_tok",), 2, source)
        if top_k == 1:
            raise ConfigError(f"{source}: num_experts_per_tok=1 is not supported: Mixtral gives a token's single "
                              "expert the gate 1, meshtrain's router its softmax probability (model.moe.norm_topk "
                              "renormalises top_k >= 2 only)")
        moe = {"num_experts": experts, "top_k": top_k, "expert_ffn_dim": fields["ffn_dim"], "norm_topk": True,
               "layers": "all"}
    else:
        experts = get_key(config, ("num_experts", "num_local_experts"), 128, source)
        top_k = get_key(config, ("num_experts_per_tok",), 8, source)
        norm = get_key(config, ("norm_topk_prob",), False, source, bool)
        if top_k == 1 and norm:
            raise ConfigError(f"{source}: norm_topk_prob=true with num_experts_per_tok=1 is not supported: it gives "
                              "a token's single expert the gate 1, meshtrain's router its softmax probability")
        step = get_key(config, ("decoder_sparse_step",), 1, source)
        if step < 1:
            raise ConfigError(f"{source}: decoder_sparse_step={step} must be at least 1")
        dense = config.get("mlp_only_layers") or []
        if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
            raise ConfigError(f"{source}: mlp_only_layers={json.dumps(dense)} must be a list of layer indices")
        layers = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0] if experts > 0 else []
        if not layers:
            return fields  # every block dense: a Qwen3 model
        moe = {"num_experts": experts, "top_k": top_k,
               "expert_ffn_dim": get_key(config, ("moe_intermediate_size",), 768, source),
               "norm_topk": bool(norm and top_k > 1), "layers": layers_spec(layers, n_layers)}
    aux = float(get_key(config, ("router_aux_loss_coef",), 0.001, source, float))
    fields["moe"] = moe_fields({**moe, "aux_coef": aux})
    return fields


# --------------------------------------------------------------------------- tensors


def check_layout(cfg) -> None:
    """Refuse parameters that have no tensor in any Hugging Face target."""
    if cfg.moe is not None and cfg.moe_layers and cfg.moe.shared_experts:
        raise ConfigError(f"model.moe.shared_experts={cfg.moe.shared_experts}: Mixtral and Qwen3-MoE have no "
                          "shared experts, so these weights have no Hugging Face form; use model.moe.shared_experts "
                          "0")


def absent(specs: Mapping) -> list[str]:
    """Our parameters that no Hugging Face file holds (the aux-free expert bias: 0 on import)."""
    return [name for name in specs if name.endswith(".moe.expert_bias")]
