"""Multi-token prediction (DeepSeek-V3): configuration, and the inputs and targets of each
depth, built from whole rows.

Depth k (1..depth) predicts, at position i, the token k + 1 positions ahead, t_{i+k+1}:
its module takes the previous depth's hidden state at i (the main model's final one,
before the final norm, for k = 1) and the embedding of t_{i+k}, the token k ahead. Those
ids and targets come from the row's whole sequence, so they are found where whole rows
are (the data reader, or the step for batches given whole) and then laid out as the
tokens are. A target is kept where the row has it, the main targets do not mask it (loss
masks, the target after an EOD), and, with packed documents, it lies in position i's
document. The module itself is the family's (models/deepseek_v3/model.py `forward_mtp`).

MtpConfig is the model.mtp section of a run config itself, checked when built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import check_float, check_int

MAX_DEPTH = 16  # DeepSeek-V3 trains with 1; far above any published model


@dataclass(frozen=True)
class MtpConfig:
    """Multi-token prediction modules after the last block (model.arch deepseek_v3)."""

    depth: int = 0
    """Modules, each predicting one token further ahead (DeepSeek-V3: 1); 0: off."""
    loss_coef: float = 0.3
    """Weight of the modules' mean loss in the objective: loss + loss_coef / depth x sum of the depths' losses (DeepSeek-V3: 0.3, later 0.1). metrics.jsonl's loss stays the main next-token loss; mtp_loss is the depths' mean."""

    def __post_init__(self) -> None:
        check_int(self.depth, "model.mtp.depth", 0, MAX_DEPTH)
        check_float(self.loss_coef, "model.mtp.loss_coef", minimum=0.0)


def mtp_rows(tokens: torch.Tensor, targets: torch.Tensor, depth: int,
             segments: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """For whole rows (batch, seq) of tokens and their targets (targets[i] = tokens[i+1]
    or < 0 when masked): per depth k, "mtp_tokens_k" (the id of t_{i+k}; 0 past the row's
    end, where no target follows) and "mtp_targets_k" (t_{i+k+1}, or -1)."""
    seq = tokens.shape[1]
    ids = torch.cat([tokens, targets[:, -1:].clamp(min=0)], 1)  # t_0 .. t_seq
    out = {}
    for k in range(1, depth + 1):
        ahead = torch.zeros_like(tokens)
        ahead[:, :seq + 1 - k] = ids[:, k:]
        wanted = torch.full_like(targets, -1)
        wanted[:, :seq - k] = targets[:, k:]
        if segments is not None:  # t_{i+k+1} is position i+k's target: in i's document only
            same = torch.zeros_like(wanted, dtype=torch.bool)
            same[:, :seq - k] = segments[:, k:] == segments[:, :seq - k]
            wanted = torch.where(same, wanted, -1)
        out[f"mtp_tokens_{k}"], out[f"mtp_targets_{k}"] = ahead, wanted
    return out
