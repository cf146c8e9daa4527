"""The gpt2 family's Hugging Face format (models/hf.py `HFFormat`): GPT2LMHeadModel.

Names, ours -> transformers (its Conv1D layers store weights (in, out): transposed):

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
gelu_pytorch_tanh, gelu_fast); the exact erf GELU ("gelu") is refused on import. Its
dropouts are written as 0: our model has none.
"""

from __future__ import annotations

from typing import Mapping

from ..hf import HFFormat, HFTensor, Piece, get_key, refuse_key, same, transposed


def tensors(cfg, specs: Mapping, experts: str) -> list[HFTensor]:
    d = cfg.dim
    out = [same(specs, "transformer.wte.weight", "tok_emb"), same(specs, "transformer.wpe.weight", "pos_emb")]
    for i in range(cfg.n_layers):
        p, h = f"layers.{i}.", f"transformer.h.{i}."
        out += [same(specs, h + "ln_1.weight", p + "attn_norm"), same(specs, h + "ln_1.bias", p + "attn_norm_bias")]
        out.append(HFTensor(h + "attn.c_attn.weight", (d, 3 * d), tuple(
            Piece(p + f"attn.w{w}", (d, d), (1, 0), (0, k * d)) for k, w in enumerate("qkv"))))
        out.append(HFTensor(h + "attn.c_attn.bias", (3 * d,), tuple(
            Piece(p + f"attn.b{w}", (d,), (0,), (k * d,)) for k, w in enumerate("qkv"))))
        out += [transposed(specs, h + "attn.c_proj.weight", p + "attn.wo"),
                same(specs, h + "attn.c_proj.bias", p + "attn.bo"),
                same(specs, h + "ln_2.weight", p + "mlp_norm"), same(specs, h + "ln_2.bias", p + "mlp_norm_bias"),
                transposed(specs, h + "mlp.c_fc.weight", p + "mlp.w_up"),
                same(specs, h + "mlp.c_fc.bias", p + "mlp.b_up"),
                transposed(specs, h + "mlp.c_proj.weight", p + "mlp.w_down"),
                same(specs, h + "mlp.c_proj.bias", p + "mlp.b_down")]
    out += [same(specs, "transformer.ln_f.weight", "norm"), same(specs, "transformer.ln_f.bias", "norm_bias")]
    return out


def config(cfg) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": cfg.dim, "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads, "n_inner": cfg.ffn_dim, "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len,
            "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new", "attn_pdrop": 0.0,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}


_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def fields(config: Mapping, model_type: str, source: str) -> dict:
    """model.* fields of a gpt2 config.json."""
    dim = get_key(config, ("n_embd", "hidden_size"), 768, source)
    refuse_key(config, "activation_function", lambda v: v in _TANH_GELUS, "gelu_new",
            f"meshtrain's gpt2 MLP is GELU with the tanh approximation ({', '.join(_TANH_GELUS)})", source)
    refuse_key(config, "scale_attn_weights", lambda v: v is True, True,
            "meshtrain's gpt2 scales attention scores by 1/sqrt(head_dim)", source)
    refuse_key(config, "scale_attn_by_inverse_layer_idx", lambda v: v is False, False,
            "meshtrain's gpt2 does not scale attention by layer index", source)
    refuse_key(config, "add_cross_attention", lambda v: v is False, False,
            "meshtrain's gpt2 is decoder-only, without cross-attention", source)
    n_inner = get_key(config, ("n_inner",), None, source)
    return {"arch": "gpt2", "dim": dim, "n_layers": get_key(config, ("n_layer", "num_hidden_layers"), 12, source),
            "n_heads": get_key(config, ("n_head", "num_attention_heads"), 12, source), "n_kv_heads": None,
            "ffn_dim": 4 * dim if n_inner is None else n_inner,
            "vocab_size": get_key(config, ("vocab_size",), 50257, source),
            "max_seq_len": get_key(config, ("n_positions", "max_position_embeddings"), 1024, source),
            "rope_theta": None, "norm_eps": float(get_key(config, ("layer_norm_epsilon",), 1e-5, source, float)),
            "tie_embeddings": bool(get_key(config, ("tie_word_embeddings",), True, source, bool)),
            "rope_scaling": None}


HF = HFFormat(architecture="GPT2LMHeadModel", base_prefix="transformer.",
              model_types={"gpt2": ("GPT2LMHeadModel", "GPT2Model")}, tensors=tensors, config=config, fields=fields)
