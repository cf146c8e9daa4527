"""The process-group collectives context-parallel attention calls, looked up on `dist` at
call time (so a test can patch them)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_gather(out, x, group):
    # torch 2.13 deprecates all_gather_into_tensor for all_gather_single (same signature); 2.11 lacks the latter.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter(out, x, group):
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)


def _all_to_all(x, group):
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _ring_exchange(send, group, tag):
    """Post: send `send` to the next rank, receive the same shape from the previous one. Batched so
    that NCCL does not deadlock on a ring of unmatched sends. Returns (works, receive buffer)."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, (r + 1) % cp), group, tag),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (r - 1) % cp), group, tag)]
    return dist.batch_isend_irecv(ops), recv


def _wait(works):
    for w in works:
        w.wait()
