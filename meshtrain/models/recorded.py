"""The stretches of a family's forward the estimators read, recorded (recording.py) once
per model, batch, length and dtype: one block on the residual stream, and the ends (the
embedding; the head, with the multi-token prediction modules after it when asked)."""

from __future__ import annotations

from dataclasses import replace

import torch

from .family import ModelDef
from .recording import Recording, RecordingContext, cached


def record_block(model: ModelDef, layer: int, batch: int, seq_len: int, dtype: torch.dtype) -> Recording:
    """Block `layer` of the model on a residual stream (batch, seq_len, dim) in `dtype`."""
    def make():
        ctx = RecordingContext(model, dtype)
        x = ctx.residual(batch, seq_len)
        out = ctx.run(model.family.forward_stage, model.cfg, {}, x, ctx, (layer, layer + 1), False, False)
        return ctx.recording(out)
    return cached((model.family.name, model.cfg, "block", layer, batch, seq_len, dtype), make)


def record_ends(model: ModelDef, embedding: bool, head: bool, batch: int, seq_len: int,
                dtype: torch.dtype, mtp: bool = False) -> tuple[Recording, Recording]:
    """The embedding (tokens to the residual stream) and the head (the residual stream to
    the logits) of a rank that runs them, recorded together: a tied table looked up by
    both is one parameter used twice. Either is empty where the rank does not run it.
    `mtp`: the head with the model's multi-token prediction modules after it (their
    logits in the head recording's `outs`)."""
    def make():
        ctx = RecordingContext(model, dtype)
        family, cfg = model.family, model.cfg
        if embedding:
            x = ctx.run(family.forward_stage, cfg, {}, ctx.ids(batch, seq_len), ctx, (0, 0), True, False)
        else:
            x = ctx.residual(batch, seq_len)
        front, split = ctx.recording(x), ctx.mark_point()
        depth = mtp_depth(model) if mtp else 0
        if head and depth:
            ahead = [ctx.ids(batch, seq_len) for _ in range(depth)]
            layers = (cfg.n_layers, cfg.n_layers)
            out, outs = ctx.run(family.forward_mtp, cfg, {}, x, ctx, layers, False, ahead)
            return front, replace(ctx.recording(out, split), outs=tuple(ctx.info(o).layout for o in outs))
        out = ctx.run(family.head, cfg, ctx.bind({}), x, ctx) if head else x
        return front, ctx.recording(out, split)
    return cached((model.family.name, model.cfg, "ends", embedding, head, batch, seq_len, dtype, mtp), make)


def mtp_depth(model: ModelDef) -> int:
    """How many multi-token prediction modules the model runs after its head."""
    mtp = getattr(model.cfg, "mtp", None)
    return mtp.depth if mtp is not None and model.family.forward_mtp is not None else 0

