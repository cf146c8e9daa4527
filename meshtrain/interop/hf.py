"""Hugging Face interop for the llama and gpt2 families, the public API: config.json both
ways (hf_config.py), export of parameters in memory or streamed from a DCP checkpoint to
safetensors (export.py), and import of safetensors weights as plain tensors or as
DTensors laid out by a Plan (load.py); the tensor layout below is layout.py's.

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

from .export import export_dcp, export_dtype, resolve_checkpoint, save_hf
from .hf_config import from_hf_config, read_hf_config, to_hf_config
from .layout import hf_layout
from .load import check_same_model, load_hf_params
from .pieces import ARCHITECTURES, DTYPES, HFTensor, Piece

__all__ = ["ARCHITECTURES", "DTYPES", "HFTensor", "Piece", "check_same_model", "export_dcp", "export_dtype",
           "from_hf_config", "hf_layout", "load_hf_params", "read_hf_config", "resolve_checkpoint", "save_hf",
           "to_hf_config"]
