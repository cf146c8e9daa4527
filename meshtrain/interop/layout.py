"""The HF tensors of a model and which pieces of our parameters each one holds (the name
and layout mapping of meshtrain/interop/hf.py)."""

from __future__ import annotations

import collections

from . import hf_moe
from .pieces import HFTensor, Piece, _family_cfg, _specs


def hf_layout(arch: str, family_cfg, experts: str = "hub") -> list[HFTensor]:
    """The Hugging Face tensors of this model, in file order, each with its pieces.
    `experts`: MoE blocks' experts one tensor per expert and weight ("hub", what export
    writes) or fused as transformers holds them in memory ("fused"; see hf_moe)."""
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

