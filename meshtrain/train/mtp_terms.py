"""One step's multi-token prediction terms (models/mtp.py): each micro-batch's inputs and
targets per depth, the global count of each depth's targets, the objective term of a
micro-batch and the step's mtp_loss."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..models.mtp import mtp_rows


class MtpTerms:
    """`inputs[m]` / `targets[m]`: micro-batch m's ids of the tokens k ahead and targets,
    per depth k. Taken from the batch's "mtp_tokens_k" / "mtp_targets_k" (lists like
    "tokens", laid out as they are; what the run's data reader gives) or, for a batch of
    whole rows without them, built here."""

    def __init__(self, batch: dict, depth: int, coef: float, count):
        self.depth, self.coef = depth, coef
        n = len(batch["tokens"])
        if "mtp_tokens_1" not in batch:
            batch = {**batch, **_whole_rows(batch, depth)}
        self.inputs = [[batch[f"mtp_tokens_{k}"][m] for k in range(1, depth + 1)] for m in range(n)]
        self.targets = [[batch[f"mtp_targets_{k}"][m] for k in range(1, depth + 1)] for m in range(n)]
        self.counts = [max(count([t[k] for t in self.targets]), 1) for k in range(depth)]
        self.total = None

    def add(self, sums: list[torch.Tensor]) -> torch.Tensor:
        """The objective term of one micro-batch's per-depth cross-entropy sums (partial
        over the ranks that split the tokens): loss_coef / depth x sum_k sum_k / count_k."""
        per_depth = torch.stack([s / n for s, n in zip(sums, self.counts)])
        self.total = per_depth.detach() if self.total is None else self.total + per_depth.detach()
        return per_depth.sum() * (self.coef / self.depth)

    def mtp_loss(self, reduce_sum) -> float:
        """The step's mean over depths of each depth's mean loss (`reduce_sum` of the
        per-depth totals, None on a rank that ran no module)."""
        return float(torch.as_tensor(reduce_sum(self.total)).sum()) / self.depth


def _whole_rows(batch: dict, depth: int) -> dict:
    """mtp_rows of each micro-batch, which must be whole rows on this rank."""
    tokens, targets, segments = batch["tokens"], batch["targets"], batch.get("segments")
    if hasattr(tokens[0], "to_local"):
        raise ConfigError("multi-token prediction needs each micro-batch's whole rows to find the tokens ahead: give "
                          "the batch as plain tensors, or its mtp_tokens_k / mtp_targets_k (meshtrain fit's reader "
                          "does)")
    out: dict[str, list] = {}
    for m in range(len(tokens)):
        rows = mtp_rows(tokens[m], targets[m], depth, None if segments is None else segments[m])
        for key, value in rows.items():
            out.setdefault(key, []).append(value)
    return out
