"""Documents packed into a row of tokens, found from their end-of-document tokens (Megatron's
`--reset-attention-mask`, `--reset-position-ids`, `--eod-mask-loss`): a document ends
with its EOD token, and the token after it starts the next one. Pure functions of the
tokens, so a sample's documents come back exactly on resume."""

from __future__ import annotations

import torch


def document_segments(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """(..., seq) -> the index of each token's document within its row: the number of EOD
    tokens before it (an EOD belongs to the document it ends)."""
    is_eod = (tokens == eod).long()
    return is_eod.cumsum(-1) - is_eod


def document_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """(..., seq) -> each token's position within its document (0 at a row's start and after
    every EOD)."""
    seq = tokens.shape[-1]
    index = torch.arange(seq, device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[..., 1:] = tokens[..., :-1] == eod
    return index - torch.where(starts, index, 0).cummax(-1).values


def mask_after_eod(tokens: torch.Tensor, targets: torch.Tensor, eod: int) -> torch.Tensor:
    """`targets` with the target of every EOD input set to -1 (ignored): the first token of
    the next document is not predicted from the one before it."""
    return torch.where(tokens == eod, torch.full_like(targets, -1), targets)
