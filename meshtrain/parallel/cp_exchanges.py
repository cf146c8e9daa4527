"""The three ways context-parallel attention exchanges what it needs, each a forward and a
backward function over this rank's zigzag shard (parallel/cp_attention.py wraps them in
custom ops):

  allgather  all-gather K/V (one collective), attend both local q chunks to the keys before them;
             backward: one reduce-scatter of dK/dV.
  ring       K/V blocks travel around the ring with p2p while the current block is computed;
             partial results merge by log-sum-exp; backward sends dK/dV along with the blocks.
  a2a        Ulysses: one all-to-all from sequence- to head-sharded, full causal attention on
             cp-th of the heads, one all-to-all back (mirrored in backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .cp_blocks import _acc, _attend, _attend_backward, _block_backward, _block_forward, _running
from .cp_collectives import _all_gather, _all_to_all, _reduce_scatter, _ring_exchange, _wait
from .zigzag import zigzag_order


def _zigzag_segments(segments, group):
    """Every rank's document ids side by side (b, S): the zigzag order of the sequence (a
    few bytes per token, gathered once per call)."""
    cp = dist.get_world_size(group)
    shards = segments.new_empty((cp * segments.shape[0],) + segments.shape[1:])
    _all_gather(shards, segments.contiguous(), group)
    return shards.unflatten(0, (cp, -1)).movedim(0, 1).flatten(1, 2)


def _natural_segments(segments, group, perm):
    return None if segments is None else _zigzag_segments(segments, group).index_select(1, torch.argsort(perm))


def _gather_pieces(r, cp, c):
    """What local q attends to in the whole sequence (natural order): each local q chunk, at
    global chunk t, sees its diagonal block (causal) and every key before it (unmasked)."""
    pieces = []
    for i, t in enumerate((r, 2 * cp - 1 - r)):
        rows = slice(i * c, (i + 1) * c)
        pieces += [(rows, slice(t * c, (t + 1) * c), True)] + ([(rows, slice(0, t * c), False)] if t else [])
    return pieces


def _allgather_forward(q, k, v, group, segments=None):
    """Returns out and (lse, gathered K/V, zigzag order) for backward."""
    cp, r, c = dist.get_world_size(group), dist.get_rank(group), q.shape[1] // 2
    perm = zigzag_order(c * 2 * cp, cp).to(q.device)
    kv = torch.stack([k, v])  # (2, b, 2c, hkv, d): K and V in one collective
    shards = kv.new_empty((cp * 2,) + kv.shape[1:])  # the concatenated form (gloo takes no stack)
    _all_gather(shards, kv, group)
    shards = shards.unflatten(0, (cp, 2))
    # Natural order: rank blocks side by side are the zigzag order, undone by the inverse perm.
    kv = shards.movedim(0, 2).flatten(2, 3).index_select(2, torch.argsort(perm))
    out, lse = _running(q)
    full = _natural_segments(segments, group, perm)
    _attend(q, kv[0], kv[1], _gather_pieces(r, cp, c), out, lse, None if full is None else (segments, full))
    # Memory trade-off: keeping the gathered K/V (2 b S hkv d elements, cp times the local
    # shard) saves a second all-gather in backward; with GQA (hkv << hq) it is small.
    return out.to(q.dtype), [lse, kv, perm]


def _allgather_backward(dout, inputs, out, saved, group, segments=None):
    (q,), (lse, kv, perm) = inputs, saved
    cp, r, c = dist.get_world_size(group), dist.get_rank(group), q.shape[1] // 2
    dq = torch.zeros_like(q, dtype=_acc(q.dtype))
    dkv = torch.zeros_like(kv, dtype=dq.dtype)
    full = _natural_segments(segments, group, perm)
    _attend_backward(dout, q, kv[0], kv[1], out, lse, _gather_pieces(r, cp, c), dq, dkv,
                     None if full is None else (segments, full))
    # Back to zigzag rank blocks, summed over ranks in fp32 (every rank adds to every shard).
    send = dkv.index_select(2, perm).unflatten(2, (cp, -1)).movedim(2, 0).flatten(0, 1).contiguous()
    mine = send.new_empty((2,) + send.shape[1:])
    _reduce_scatter(mine, send, group)
    return dq.to(q.dtype), mine.to(q.dtype)


def _ring_pieces(j, r, c):
    """What local q attends to in the block of rank j (chunks j and 2cp-1-j), zigzag layout."""
    if j == r:  # own block: local positions increase, so plain causal on the 2c tokens is exact
        return [(slice(None), slice(None), True)]
    if j < r:  # chunk j precedes both q chunks, chunk 2cp-1-j follows both
        return [(slice(None), slice(0, c), False)]
    return [(slice(c, None), slice(None), False)]  # j > r: only the late q chunk, both chunks precede it


def _ring_blocks(segments, group, c):
    """Per rank j, (this rank's document ids, those of rank j's block), or Nones."""
    cp = dist.get_world_size(group)
    if segments is None:
        return [None] * cp
    zig = _zigzag_segments(segments, group)
    return [(segments, zig[:, j * 2 * c:(j + 1) * 2 * c]) for j in range(cp)]


def _ring_forward(q, k, v, group, segments=None):
    """Returns out and (lse,) for backward, which passes K/V around the ring again. A block
    no local query shares a document with is passed on without compute."""
    cp, r, c = dist.get_world_size(group), dist.get_rank(group), q.shape[1] // 2
    out, lse = _running(q)
    segs = _ring_blocks(segments, group, c)
    kv = torch.stack([k, v])
    for i in range(cp):  # step i holds the block of rank r - i
        if i + 1 < cp:  # posted before the compute, so the transfer overlaps it
            works, nxt = _ring_exchange(kv, group, 0)
        _attend(q, kv[0], kv[1], _ring_pieces((r - i) % cp, r, c), out, lse, segs[(r - i) % cp])
        if i + 1 < cp:
            _wait(works)
            kv = nxt
    return out.to(q.dtype), [lse]


def _ring_backward(dout, inputs, out, saved, group, segments=None):
    (q, k, v), (lse,) = inputs, saved
    cp, r, c = dist.get_world_size(group), dist.get_rank(group), q.shape[1] // 2
    segs = _ring_blocks(segments, group, c)
    dq = torch.zeros_like(q, dtype=_acc(q.dtype))
    kv, pending = torch.stack([k, v]), None
    for i in range(cp):
        if i + 1 < cp:
            works, nxt = _ring_exchange(kv, group, 0)
        dkv = torch.zeros(kv.shape, dtype=dq.dtype, device=kv.device)
        _attend_backward(dout, q, kv[0], kv[1], out, lse, _ring_pieces((r - i) % cp, r, c), dq, dkv,
                         segs[(r - i) % cp])
        # The accumulator of block r - i arrives from the previous rank (which held that block
        # one step earlier) and moves on with it: after the last step it reaches its owner.
        if pending is not None:
            _wait(pending[0])
            dkv += pending[1]
        # fp32 on the wire: partial sums of cp ranks. cp == 1: the block is already home.
        pending = _ring_exchange(dkv, group, 1) if cp > 1 else ([], dkv)
        if i + 1 < cp:
            _wait(works)
            kv = nxt
    _wait(pending[0])
    return dq.to(q.dtype), pending[1].to(k.dtype)


def _check_a2a_heads(hq, hkv, cp):
    if hq % cp or hkv % cp:
        raise ConfigError(f"context-parallel comm 'a2a' splits the attention heads over cp={cp}, but there are "
                          f"{hq} query heads (model.n_heads per tensor-parallel rank) and {hkv} kv heads "
                          f"(model.n_kv_heads per tensor-parallel rank), not both divisible by {cp}: use comm "
                          f"'allgather' or 'ring', or a cp that divides both")


def _a2a_forward(q, k, v, group, segments=None):
    """Returns out and (lse, head-split q/k/v, head-split output, zigzag order, inverse)."""
    cp, (s, hq), hkv = dist.get_world_size(group), q.shape[1:3], k.shape[2]
    perm = zigzag_order(s * cp, cp).to(q.device)
    inv = torch.argsort(perm)
    # Destination t gets head group t of q, k and v (contiguous, so GQA groups stay whole).
    send = torch.cat([t.unflatten(2, (cp, -1)) for t in (q, k, v)], 3).movedim(2, 0)
    x = _all_to_all(send, group).movedim(0, 1).flatten(1, 2).index_select(1, inv)  # (b, S, heads/cp, d)
    qh, kh, vh = x.split([hq // cp, hkv // cp, hkv // cp], 2)  # natural order
    out, lse = _block_forward(qh, kh, vh, True, _full_same(segments, group, perm))
    out = out.to(q.dtype)
    back = _all_to_all(out.index_select(1, perm).unflatten(1, (cp, s)).movedim(1, 0), group)
    return back.movedim(0, 2).flatten(2, 3), [lse, x, out, perm, inv]  # from rank t came head group t


def _full_same(segments, group, perm):
    """Which positions of the whole sequence share a document (b, S, S), or None."""
    full = _natural_segments(segments, group, perm)
    return None if full is None else full[:, :, None] == full[:, None, :]


def _a2a_backward(dout, inputs, out, saved, group, segments=None):
    lse, x, out_h, perm, inv = saved  # needs none of the inputs: the head split holds them
    cp, s, hq_cp = dist.get_world_size(group), dout.shape[1], out_h.shape[2]
    qh, kh, vh = x.split([hq_cp, (x.shape[2] - hq_cp) // 2, (x.shape[2] - hq_cp) // 2], 2)
    dh = _all_to_all(dout.unflatten(2, (cp, -1)).movedim(2, 0), group).movedim(0, 1).flatten(1, 2)
    grads = _block_backward(dh.index_select(1, inv), qh, kh, vh, out_h, lse, True, _full_same(segments, group, perm))
    send = torch.cat(grads, 2).to(dout.dtype).index_select(1, perm).unflatten(1, (cp, s)).movedim(1, 0)
    dq, dk, dv = _all_to_all(send, group).split([qh.shape[2], kh.shape[2], vh.shape[2]], 3)
    dq = dq.movedim(0, 2).flatten(2, 3)  # (b, s, hq, d), from rank t came head group t
    return dq, torch.stack([t.movedim(0, 2).flatten(2, 3) for t in (dk, dv)])


_EXCHANGES = {"allgather": (_allgather_forward, _allgather_backward),
              "ring": (_ring_forward, _ring_backward),
              "a2a": (_a2a_forward, _a2a_backward)}
# Which inputs each backward needs (q, k, v kept for backward only where used).
_KEPT_INPUTS = {"allgather": 1, "ring": 3, "a2a": 0}
