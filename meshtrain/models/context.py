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

from functools import partial
from typing import Mapping, NamedTuple, Protocol, Sequence

import torch
import torch.nn.functional as F

from .attention import document_attention
from .fp8 import fp8_linear
from .losses import cross_entropy_sum
from .moe import balance_loss, route, routed_experts, sequence_stats, z_loss
from .policy import Policy

Axes = Sequence[str | None]


class Documents(NamedTuple):
    """The documents packed into a batch's rows (data.document_mask, data.reset_positions):
    `segments` (batch, seq) numbers each row's documents, and attention stays among
    tokens of equal numbers; `positions` (batch, seq) is each token's position in its
    document, where RoPE and learned positions restart. Either may be None (off)."""

    segments: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    # Keys each 128-query tile of a compiled attention looks back over (attention.py
    # `document_window`); None: the whole row; 0: no row holds a boundary (causal).
    window: int | None = None


class ModelContext(Protocol):
    start_pos: int
    """Position of the first token of the sequence a forward sees: 0 in training, the
    number of cached positions when decoding (models/decode.py)."""

    def bind(self, params: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Parameters ready for compute (gathered, cast) when looked up by name."""

    def constrain(self, x: torch.Tensor, axes: Axes) -> torch.Tensor:
        """`x` with the layout the plan gives these logical axes. A plain tensor is taken
        as the full value, identical on every rank (a constant)."""

    def embedding(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Rows of `table` (vocab, embed) for `ids`; the table may be split on vocab."""

    def linear(self, x: torch.Tensor, params: Mapping[str, torch.Tensor], name: str,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ params[name].T (+ bias), in the precision the run's policy gives `name`
        (fp8 GEMMs under train.precision fp8, except where its rules say otherwise)."""

    def remat(self, fn, *args):
        """fn(*args), a transformer block, under the run's activation-checkpointing policy."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  segments: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        """Causal attention; q (batch, seq, q_heads, head_dim), k/v (batch, seq, kv_heads,
        head_dim), GQA by grouping; with `segments` (batch, seq) (constrained as
        ("batch", "seq")), a query sees only keys of its own segment, and a compiled graph
        looks back over `window` keys per tile of queries (Documents.window). Returns
        (batch, seq, q_heads, head_dim)."""

    def cached_latents(self, latent: torch.Tensor, rope_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latents multi-head latent attention expands into keys and values
        (models/mla.py): those given in training; when decoding, every cached position's
        (models/decode.py), this call's stored."""

    def cross_entropy_sum(self, logits: torch.Tensor, targets: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """Sum over tokens of -log softmax(logits)[target]; targets < 0 are ignored. With
        `reduce` False the sum may be left partial over the ranks that split the tokens,
        for the caller to reduce once per step (`reduce_sum`)."""

    def reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The whole value of a sum `cross_entropy_sum(..., reduce=False)` left partial."""

    def moe(self, h: torch.Tensor, cfg, router: torch.Tensor, bias: torch.Tensor | None, w_gate: torch.Tensor,
            w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for h (batch, seq, dim) (a MoeConfig `cfg`; expert
        weights stacked on dim 0), the fp32 router run on every token. The balancing terms
        are kept for `moe_aux`."""

    def moe_aux(self):
        """(balance loss summed over sequences, z-loss summed over tokens, tokens per
        expert (moe layers, E)) of the MoE blocks run since the last call (None for a
        term not in use), or None without MoE blocks."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     segments: torch.Tensor | None = None, key=None, window: int | None = None) -> torch.Tensor:
    """Reference causal attention on local tensors in (batch, seq, heads, head_dim);
    with `segments` (batch, seq), block-diagonal causal: a query sees the keys before it
    in its own segment (models/attention.py; `key`, the object every layer of a
    micro-batch passes, defaults to `segments`; `window`: see document_attention)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if segments is not None:
        return document_attention(q, k, v, segments, segments if key is None else key, window).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


class _CastParams(Mapping):
    def __init__(self, params, policy: Policy):
        self._params, self._policy = params, policy

    def __getitem__(self, name):
        dtype = self._policy.param_dtype(name)
        return self._params[name] if dtype is None else self._params[name].to(dtype)

    def __iter__(self):
        return iter(self._params)

    def __len__(self):
        return len(self._params)


class LocalContext:
    """One device, no layout: every call is the plain computation, under `policy` (a
    Policy, or just a compute dtype; parameters stay in their own dtype and are cast where
    used)."""

    start_pos = 0

    def __init__(self, policy: Policy | torch.dtype | None = None):
        self.policy = Policy.coerce(policy)
        self._moe = MoeRecords()

    def bind(self, params):
        return params if self.policy.dtype is None else _CastParams(params, self.policy)

    def linear(self, x, params, name, bias=None):
        recipe = self.policy.fp8_recipe(name)
        if recipe is None:
            return F.linear(x, params[name], bias)
        out = fp8_linear(x, params[name], recipe)
        return out if bias is None else out + bias

    def remat(self, fn, *args):
        return remat_recording(self.policy, self, fn, *args)

    def constrain(self, x, axes):
        return x

    def embedding(self, ids, table):
        return F.embedding(ids, table)

    def attention(self, q, k, v, segments=None, window=None):
        return causal_attention(q, k, v, segments, window=window)

    def cached_latents(self, latent, rope_key):
        return latent, rope_key

    def cross_entropy_sum(self, logits, targets, reduce=True):
        return cross_entropy_sum(logits, targets)

    def reduce_sum(self, x):
        return x

    def moe(self, h, cfg, router, bias, w_gate, w_up, w_down):
        b, s, d = h.shape
        logits = F.linear(h.float(), router.float())
        idx, gates, probs = route(logits.flatten(0, 1), cfg, bias)
        prob_sum, counts = sequence_stats(probs.view(b, s, -1), idx.view(b, s, -1), cfg.num_experts)
        self._moe.add(balance_loss(prob_sum, counts, s, cfg).sum() if cfg.balance == "aux" else None,
                      z_loss(logits, cfg) if cfg.z_loss_coef else None, counts.sum(0))
        return routed_experts(h.reshape(-1, d), idx, gates, w_gate, w_up, w_down, cfg).view(b, s, d)

    def moe_aux(self):
        return self._moe.take()


class MoeRecords:
    """What the MoE blocks of one forward leave for the loss and the metrics."""

    def __init__(self):
        self.balance, self.z, self.load = [], [], []

    # New lists, never appends: dynamo replays an append to a list that existed before the
    # compiled call, so the terms would escape the graph as extra outputs (a compiled step
    # on a mesh then waits in backward for a DTensor gradient no one sends).
    def add(self, balance: torch.Tensor | None, z: torch.Tensor | None, load: torch.Tensor) -> None:
        self.extend(([balance] if balance is not None else [], [z] if z is not None else [], [load]))

    def extend(self, other: tuple[list, list, list]) -> None:
        self.balance, self.z, self.load = (kept + list(values) for kept, values in
                                           zip((self.balance, self.z, self.load), other))

    def take(self):
        if not self.load:
            return None
        out = (sum(self.balance) if self.balance else None, sum(self.z) if self.z else None, torch.stack(self.load))
        self.balance, self.z, self.load = [], [], []
        return out



class _OwnRecords:
    """`ctx` for one checkpointed block, whose MoE layers record into records of its own
    (ctx.moe runs with this as self; every other call goes to ctx)."""

    def __init__(self, ctx):
        self._ctx, self._moe = ctx, MoeRecords()

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def moe(self, *args):
        return type(self._ctx).moe(self, *args)


def _recording(fn, ctx, *args):
    own = _OwnRecords(ctx)
    out = fn(*(own if a is ctx else a for a in args))
    return out, (own._moe.balance, own._moe.z, own._moe.load)


def remat_recording(policy: Policy, ctx, fn, *args):
    """policy.remat(fn, *args) for a block that takes `ctx` among its args: under
    checkpointing the block returns its MoE terms as values, added to ctx's records
    outside the checkpointed region. So the region has no side effect (dynamo refuses
    one there), and the recompute in backward records nothing."""
    if policy.checkpointing == "none" or not any(a is ctx for a in args):
        return policy.remat(fn, *args)
    out, records = policy.remat(partial(_recording, fn, ctx), *args)
    ctx._moe.extend(records)
    return out


def _recomputing() -> bool:
    """Inside backward: a checkpointed block being recomputed (compiled steps recompute
    inside their graph, without running Python again)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1
