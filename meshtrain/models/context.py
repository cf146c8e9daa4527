"""What a model may ask of its surroundings, and the single-device answer.

A model is a pure function `forward(params, tokens, ctx)`. It knows nothing of meshes:
it names logical axes and calls `ctx` at the few places where layout matters. Logical
activation axes used by the models:

  batch     the batch dim
  seq       the sequence dim where every position is needed (attention, MLP inputs)
  seq_sp    the sequence dim of the residual stream (sequence-parallel regions)
  q_heads, kv_heads, mlp, vocab   the dims that tensor parallelism splits
  None      a dim that is never split

The parallel runtime (`meshtrain.parallel.context.ShardedContext`) answers the same
calls with DTensor layouts and collectives.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F

Axes = Sequence[str | None]


class ModelContext(Protocol):
    def bind(self, params: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Parameters ready for compute (gathered, cast) when looked up by name."""

    def constrain(self, x: torch.Tensor, axes: Axes) -> torch.Tensor:
        """`x` with the layout the plan gives these logical axes. A plain tensor is taken
        as the full value, identical on every rank (a constant)."""

    def embedding(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Rows of `table` (vocab, embed) for `ids`; the table may be split on vocab."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention; q (batch, seq, q_heads, head_dim), k/v (batch, seq, kv_heads,
        head_dim), GQA by grouping. Returns (batch, seq, q_heads, head_dim)."""

    def cross_entropy_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum over tokens of -log softmax(logits)[target]; targets < 0 are ignored."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference causal attention on local tensors in (batch, seq, heads, head_dim)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


class _CastParams(Mapping):
    def __init__(self, params, dtype):
        self._params, self._dtype = params, dtype

    def __getitem__(self, name):
        return self._params[name].to(self._dtype)

    def __iter__(self):
        return iter(self._params)

    def __len__(self):
        return len(self._params)


class LocalContext:
    """One device, no layout: every call is the plain computation, in `compute_dtype`
    when given (parameters stay in their own dtype and are cast where used)."""

    def __init__(self, compute_dtype: torch.dtype | None = None):
        self.compute_dtype = compute_dtype

    def bind(self, params):
        return params if self.compute_dtype is None else _CastParams(params, self.compute_dtype)

    def constrain(self, x, axes):
        return x

    def embedding(self, ids, table):
        return F.embedding(ids, table)

    def attention(self, q, k, v):
        return causal_attention(q, k, v)

    def cross_entropy_sum(self, logits, targets):
        valid = targets.flatten() >= 0
        per_token = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten().clamp(min=0), reduction="none")
        return (per_token * valid).sum()
