"""The HF tensors of a model and which pieces of our parameters each one holds: the
family's format (models/<family>/hf.py) lists them; this checks that they cover every
parameter exactly once."""

from __future__ import annotations

import collections

from ..models.hf import HFTensor, same
from .pieces import _family_cfg, _specs, hf_format


def hf_layout(arch: str, family_cfg, experts: str = "hub") -> list[HFTensor]:
    """The Hugging Face tensors of this model, in file order, each with its pieces.
    `experts`: MoE blocks' experts one tensor per expert and weight ("hub", what export
    writes) or fused as transformers holds them in memory ("fused"; see
    models/llama/hf_moe.py)."""
    if experts not in ("hub", "fused"):
        raise ValueError(f"experts={experts!r}: choose hub or fused")
    cfg = _family_cfg(arch, family_cfg)
    fmt, specs = hf_format(arch), _specs(arch, cfg)
    out = fmt.tensors(cfg, specs, experts)
    if not cfg.tie_embeddings:  # the causal-LM head, as every transformers *ForCausalLM names it
        out.append(same(specs, "lm_head.weight", "output"))
    covered = collections.Counter((piece.ours, piece.lead) for t in out if not t.copy for piece in t.pieces)
    split = {name for name, lead in covered if lead}  # one tensor per expert: ours[j] for every j
    absent = set(fmt.absent(specs))
    expected = collections.Counter((name, lead) for name in specs if name not in absent
                                   for lead in ([(j,) for j in range(specs[name].shape[0])] if name in split else [()]))
    assert covered == expected, "hf_layout does not cover every parameter exactly once"
    return out
