"""Pieces of a decoder block that several families share, written once: the RoPE tables of
a stage (positions restarting per document), the SwiGLU MLP, the mixture-of-experts
feed-forward (routed experts plus shared ones) with their parameters, and the RMSNorm
head. The families' own model.py compose them with their attention."""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from .context import Documents, ModelContext
from .layers import rms_norm, rope_cos_sin
from .spec import ParamSpec


def rope_tables(ctx: ModelContext, x: torch.Tensor, docs: Documents | None, rope_dim: int, theta: float,
                scaling: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for the positions a stage sees: ("seq", None), or per row ("batch",
    "seq", None) when packed documents restart their positions."""
    seq_len, start = x.shape[1], ctx.start_pos
    # On the activations' device: a plain tensor on the CPU would meet CUDA q/k under the
    # LocalContext (the ShardedContext moves constants to the mesh's device itself).
    cos, sin = rope_cos_sin(start + seq_len, rope_dim, theta, scaling, x.device)
    if start:  # decoding: the angles of the new positions
        cos, sin = cos[start:], sin[start:]
    if docs is not None and docs.positions is not None:  # each row's angles: positions restart
        positions = ctx.constrain(docs.positions, ("batch", "seq"))
        return tuple(ctx.constrain(ctx.embedding(positions, ctx.constrain(t.to(x.dtype), (None, None))),
                                   ("batch", "seq", None)) for t in (cos, sin))
    return tuple(ctx.constrain(t.to(x.dtype), ("seq", None)) for t in (cos, sin))


def swiglu_specs(p: str, d: int, f: int, std: float, out_std: float) -> dict[str, ParamSpec]:
    """A SwiGLU of width f on the embed dim d: w_gate, w_up (f, d), w_down (d, f)."""
    return {p + "w_gate": ParamSpec((f, d), ("mlp", "embed"), std=std),
            p + "w_up": ParamSpec((f, d), ("mlp", "embed"), std=std),
            p + "w_down": ParamSpec((d, f), ("embed", "mlp"), std=out_std)}


def moe_specs(m, d: int, p: str, std: float, out_std: float) -> dict[str, ParamSpec]:
    """Router (E, dim); experts stacked on a leading `experts` dim (E, ffn, dim) and
    (E, dim, ffn); shared experts as one SwiGLU of shared_experts x expert_ffn_dim (a
    MoeConfig `m`)."""
    e, f = m.num_experts, m.expert_ffn_dim
    specs = {p + "router": ParamSpec((e, d), (None, "embed"), std=std),
             p + "w_gate": ParamSpec((e, f, d), ("experts", "mlp", "embed"), std=std),
             p + "w_up": ParamSpec((e, f, d), ("experts", "mlp", "embed"), std=std),
             p + "w_down": ParamSpec((e, d, f), ("experts", "embed", "mlp"), std=out_std)}
    if m.balance == "aux_free":
        specs[p + "expert_bias"] = ParamSpec((e,), (None,), init="zeros", trainable=False)
    if m.shared_experts:
        specs.update(swiglu_specs(p + "shared.", d, m.shared_experts * f, std, out_std))
    return specs


def swiglu(p, prefix: str, h: torch.Tensor, ctx: ModelContext) -> torch.Tensor:
    gate = F.silu(ctx.linear(h, p, prefix + "w_gate")) * ctx.linear(h, p, prefix + "w_up")
    return ctx.linear(gate, p, prefix + "w_down")


def mlp(p, prefix: str, x: torch.Tensor, eps: float, ctx: ModelContext) -> torch.Tensor:
    """The dense feed-forward of block `prefix` on the residual stream x: norm, SwiGLU."""
    h = ctx.constrain(rms_norm(x, p[prefix + "mlp_norm"], eps), ("batch", "seq", None))
    return ctx.constrain(swiglu(p, prefix + "mlp.", h, ctx), ("batch", "seq_sp", None))


def moe(m, p, prefix: str, x: torch.Tensor, eps: float, ctx: ModelContext) -> torch.Tensor:
    """The mixture-of-experts feed-forward of block `prefix` (a MoeConfig `m`): norm, the
    routed experts, plus the shared ones."""
    h = ctx.constrain(rms_norm(x, p[prefix + "mlp_norm"], eps), ("batch", "seq", None))
    e = prefix + "moe."
    bias = p[e + "expert_bias"] if m.balance == "aux_free" else None
    out = ctx.moe(h, m, p[e + "router"], bias, p[e + "w_gate"], p[e + "w_up"], p[e + "w_down"])
    if m.shared_experts:
        out = out + swiglu(p, e + "shared.", h, ctx)
    return ctx.constrain(out, ("batch", "seq_sp", None))


def rms_head(p: Mapping[str, torch.Tensor], x: torch.Tensor, eps: float, output: str,
             ctx: ModelContext, norm: str = "norm") -> torch.Tensor:
    """Final RMSNorm `norm` and output projection `output`: logits of the residual stream x."""
    x = ctx.constrain(rms_norm(x, p[norm], eps), ("batch", "seq", None))
    return ctx.constrain(ctx.linear(x, p, output), ("batch", "seq", "vocab"))
