"""The Hugging Face form of a mixture-of-experts block, shared by the families that export
one (llama's Mixtral / Qwen3-MoE targets, deepseek_v3): the router and routed experts'
tensors, per expert as the hub holds them or fused as transformers holds them in memory
(models/llama/hf_moe.py's docstring has the table), and model.moe as config.json
fields."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .hf import HFTensor, Piece
from .moe import MoeConfig


def moe_fields(values: Mapping) -> dict:
    """All model.moe fields (a MoeConfig as a dict): `values` over the defaults."""
    return {**dataclasses.asdict(MoeConfig()), **values}


def moe_dict(moe) -> dict:
    """model.moe as a plain dict of a MoeConfig (layers: a string or a list)."""
    fields = {f.name: getattr(moe, f.name) for f in dataclasses.fields(moe)}
    if not isinstance(fields["layers"], str):
        fields["layers"] = list(fields["layers"])
    return moe_fields(fields)


def layers_spec(layers: list[int], n_layers: int):
    """model.moe.layers for these block indices: all, a slice string, or the list."""
    if layers == list(range(n_layers)):
        return "all"
    start = layers[0]
    step = layers[1] - start if len(layers) > 1 else 1
    if step > 0 and layers == list(range(start, n_layers, step)):
        return f"{start}:" if step == 1 else f"{start}::{step}"
    return list(layers)


def same_structure(theirs: dict | None, cfg) -> list[tuple[str, Any, Any]]:
    """(field, config.json's value, ours) for the model.moe fields that shape the model;
    the training-only ones (balance, aux_coef, z_loss_coef, capacity_factor,
    bias_update_rate) are free to differ."""
    m = cfg.moe if cfg.moe is not None and cfg.moe_layers else None
    if theirs is None or m is None:
        return [("moe", theirs, None if m is None else moe_dict(m))]
    t = MoeConfig(**theirs)
    out = [(f"moe.{key}", getattr(t, key), getattr(m, key))
           for key in ("num_experts", "top_k", "expert_ffn_dim", "shared_experts", "router", "route_scale", "groups",
                       "group_top_k")]
    if t.top_k > 1 and m.top_k > 1:  # a single expert: norm_topk does nothing
        out.append(("moe.norm_topk", t.norm_topk, m.norm_topk))
    mine = m.layers if isinstance(m.layers, str) else list(m.layers)
    out.append(("moe.layers", theirs["layers"] if t.moe_layers(cfg.n_layers) != cfg.moe_layers else mine, mine))
    return out


def dense_blocks(moe: Mapping, n_layers: int) -> list[int]:
    """The dense blocks of a model.moe dict."""
    layers = MoeConfig(**moe).moe_layers(n_layers)
    return [i for i in range(n_layers) if i not in layers]


def expert_tensors(cfg, i: int, specs: Mapping, experts: str = "hub", mixtral: bool = False,
                   prefix: tuple[str, str] | None = None) -> list[HFTensor]:
    """The HF tensors of MoE block i's router and routed experts: per expert ("hub") or
    fused ("fused"); named as Qwen3-MoE and DeepSeek-V3 name them, or as Mixtral.
    `prefix`: (our parameters', the HF names') prefixes when not block i's."""
    p, h = prefix or (f"layers.{i}.moe.", f"model.layers.{i}.")
    e, f = cfg.moe.num_experts, cfg.moe.expert_ffn_dim

    def whole(ours: str, offset=None) -> Piece:
        shape = specs[ours].shape
        return Piece(ours, shape, tuple(range(len(shape))), offset or (0,) * len(shape))

    def per_expert(name: str, ours: str) -> list[HFTensor]:
        shape = specs[ours].shape
        return [HFTensor(name.format(j=j), shape[1:], (Piece(ours, shape, (0, 1), (0, 0), (j,)),))
                for j in range(e)]

    if experts == "fused":
        return [HFTensor(h + "mlp.gate.weight", specs[p + "router"].shape, (whole(p + "router"),)),
                HFTensor(h + "mlp.experts.gate_up_proj", (e, 2 * f, cfg.dim),
                         (whole(p + "w_gate"), whole(p + "w_up", (0, f, 0)))),
                HFTensor(h + "mlp.experts.down_proj", specs[p + "w_down"].shape, (whole(p + "w_down"),))]
    if mixtral:
        base = h + "block_sparse_moe."
        names = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
        router, fmt = base + "gate.weight", base + "experts.{{j}}.{w}.weight"
    else:
        names = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
        router, fmt = h + "mlp.gate.weight", h + "mlp.experts.{{j}}.{w}.weight"
    out = [HFTensor(router, specs[p + "router"].shape, (whole(p + "router"),))]
    for ours, w in names.items():  # one weight of every expert, then the next: export reads each stack once
        out += per_expert(fmt.format(w=w), p + ours)
    return out
