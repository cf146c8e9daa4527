"""A memory-lean cross-entropy sum, optionally over a vocab-parallel head.

The plain path `F.cross_entropy(logits.float(), ...)` holds an fp32 copy of the logits and
an fp32 log-softmax of them (2 x 4 x rows x V bytes) until backward, on top of the logits
themselves. `cross_entropy_sum` keeps for backward only what the caller holds anyway (the
logits, the targets) and one fp32 log-sum-exp per row, and works `chunk_rows` rows at a
time, so no fp32 (rows x V) tensor ever exists: forward needs one fp32 chunk, backward one
fp32 chunk plus the gradient in the logits' own dtype.

Vocab parallel: `logits` may be this rank's slice [vocab_start, vocab_start + V_local) of
the full vocab. Forward then makes exactly two reductions over the ranks that split the
vocab, for the whole input: `all_max` of the per-row maxima (rows,) and `all_sum` of the
stacked (sum of exp, target logit) (2, rows), both fp32. Backward needs no communication:
d loss / d logit_j = softmax_j - onehot_j, and softmax_j = exp(logit_j - lse) with the
full-vocab lse saved from forward.

Works under torch.compile(fullgraph=True): dynamo unrolls the python loop over chunks (the
row count is specialised, one graph per shape).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

Reduce = Callable[[Tensor], Tensor]


CHUNK_ROWS = 4096  # rows upcast to fp32 at a time: 4096 x 128k vocab is 2 GiB


def cross_entropy_sum(logits: Tensor, targets: Tensor, *, vocab_start: int = 0, chunk_rows: int = CHUNK_ROWS,
                      all_max: Reduce | None = None, all_sum: Reduce | None = None) -> Tensor:
    """fp32 scalar: the sum over tokens with target >= 0 of -log softmax(logits)[target],
    the softmax taken over the full vocab.

    logits (..., V_local) in any float dtype, this rank's vocab slice starting at global id
    `vocab_start` (the whole vocab when `vocab_start=0` and no reductions are given);
    targets (...) int64 global ids, < 0 ignored. `all_max(t)` / `all_sum(t)` all-reduce a
    (rows,) / (2, rows) fp32 tensor over the ranks that split the vocab (None: one rank);
    each is called once. Gradients flow to `logits` only, in the logits' dtype."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    return _CrossEntropySum.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), vocab_start,
                                  chunk_rows, all_max, all_sum)


def _local_index(targets: Tensor, vocab_start: int, v_local: int) -> tuple[Tensor, Tensor]:
    """Targets as indices into this slice (clamped into range) and whether they fall in it."""
    local = targets - vocab_start
    in_slice = (local >= 0) & (local < v_local)  # implies target >= 0 since vocab_start >= 0
    return local.clamp(0, v_local - 1), in_slice


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, vocab_start: int, chunk_rows: int,
                all_max: Reduce | None, all_sum: Reduce | None) -> Tensor:
        rows, v_local = logits.shape
        index, in_slice = _local_index(targets, vocab_start, v_local)
        # Max and the target logit are exact in the logits' dtype: no fp32 copy needed.
        row_max = logits.amax(-1).float()
        if all_max is not None:
            row_max = all_max(row_max)
        target_logit = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1).float() * in_slice
        # One expression per chunk: its fp32 copy is freed before the next one is made.
        # (copy=True: for fp32 logits .float() would alias them, and the in-place ops would
        # overwrite the caller's tensor.)
        sums = [logits[start:start + chunk_rows].to(torch.float32, copy=True)
                .sub_(row_max[start:start + chunk_rows].unsqueeze(-1)).exp_().sum(-1)
                for start in range(0, rows, chunk_rows)]
        both = torch.stack([torch.cat(sums), target_logit])
        if all_sum is not None:
            both = all_sum(both)
        lse = both[0].log() + row_max
        valid = targets >= 0
        ctx.save_for_backward(logits, targets, lse)
        ctx.vocab_start, ctx.chunk_rows = vocab_start, chunk_rows
        return torch.where(valid, lse - both[1], 0.0).sum()

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, targets, lse = ctx.saved_tensors
        rows, v_local = logits.shape
        index, in_slice = _local_index(targets, ctx.vocab_start, v_local)
        scale = torch.where(targets >= 0, grad_out.float(), 0.0)  # (rows,)
        grad = torch.empty_like(logits)
        for start in range(0, rows, ctx.chunk_rows):
            _grad_chunk(grad[start:start + ctx.chunk_rows], logits[start:start + ctx.chunk_rows],
                        lse[start:start + ctx.chunk_rows], index[start:start + ctx.chunk_rows],
                        in_slice[start:start + ctx.chunk_rows], scale[start:start + ctx.chunk_rows])
        return grad, None, None, None, None, None


def _grad_chunk(out: Tensor, logits: Tensor, lse: Tensor, index: Tensor, in_slice: Tensor, scale: Tensor) -> None:
    """out = (softmax - onehot) * scale for one chunk of rows, through one fp32 chunk that
    dies on return."""
    softmax = logits.to(torch.float32, copy=True).sub_(lse.unsqueeze(-1)).exp_()
    softmax.scatter_add_(-1, index.unsqueeze(-1), -in_slice.to(torch.float32).unsqueeze(-1))
    out.copy_(softmax.mul_(scale.unsqueeze(-1)))
