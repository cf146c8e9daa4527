"""Model FLOPs of a training step, for `meshtrain plan`: train/metrics.py's count (what fit's
MFU divides by), with attention over documents where data.document_mask is on.

Per token, 6 x the weight-matrix parameters plus 12 x layers x dim x the keys a query's
attention spans, counted over the full square as Megatron and TorchTitan count it (causal
masking halves the work actually done, in both cases alike). Over the whole row that span
is train.seq_len; over packed documents of data.mean_doc_len tokens it is that length: a
row holds seq_len / mean_doc_len documents, each attending within itself, so the work
grows with the sum of the documents' squared lengths (the pieces a row's ends cut off
are not counted apart).
"""

from __future__ import annotations

from typing import NamedTuple

from ..config import RunConfig
from ..models.attention import TILE, window_for
from ..train.metrics import attention_flops_per_token, flops_per_token


def attention_span(cfg: RunConfig) -> int:
    """Keys per query in the FLOP count: the mean document length when documents are
    masked and it is given, else the sequence."""
    d, seq = cfg.data, cfg.train.seq_len
    return min(d.mean_doc_len, seq) if d.document_mask and d.mean_doc_len else seq


class MaskKeys(NamedTuple):
    """What the document masks of models/attention.py keep for backward, per query."""

    keys: float = 0  # keys of the masks, once per micro-batch: every layer shares them
    tiled: bool = False  # eager tiles, which join their outputs into one more tensor per layer
    padded: int = 0  # compiled windows: positions of keys and values each layer pads in front


def mask_keys(cfg: RunConfig, cp: int) -> MaskKeys:
    """Eager: the tiles, each over its queries' documents' span, about a tile plus half a
    document of keys. Compiled: a window per tile, a tile plus a document rounded up to a
    tile x a power of two (documents of data.mean_doc_len tokens), or one dense mask over
    the row. Nothing (MaskKeys()) without data.document_mask or under cp, whose blocks
    rebuild their masks in backward from the segment ids. Measured on CPU: see estimate/activation_memory.py."""
    if not cfg.data.document_mask or cp > 1:
        return MaskKeys()
    seq = cfg.train.seq_len
    if cfg.train.compile:
        window = window_for(TILE + attention_span(cfg) - 1, seq) if seq % TILE == 0 and seq > TILE else None
        return MaskKeys(seq) if window is None else MaskKeys(window, padded=window - TILE)
    tile = min(TILE, seq)
    return MaskKeys(tile + max(0, min(attention_span(cfg), seq - tile)) / 2, tiled=True)


def step_compute(cfg: RunConfig, model, world: int) -> dict:
    """The step's model FLOPs: per token (with the attention term apart, masked and over the
    whole row), per step and per rank (the step's over the world)."""
    t = cfg.train
    span = attention_span(cfg)
    per_token = flops_per_token(model, span)
    step = per_token * t.global_batch * t.seq_len
    return {"attention_span": span, "model_flops_per_token": per_token,
            "attention_flops_per_token": attention_flops_per_token(model, span),
            "attention_flops_per_token_whole_row": attention_flops_per_token(model, t.seq_len),
            "step_flops": step, "step_flops_per_rank": step / world}
