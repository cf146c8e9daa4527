"""Exact causal attention over a context-parallel (zigzag-sharded) sequence, forward and
backward: the entry point, `context_parallel_attention`, and the custom ops around it.

Context parallelism splits the sequence over the `cp` ranks of a process group, each holding
its zigzag shard (parallel/zigzag.py). The three ways to exchange what attention needs
(allgather, ring, a2a: parallel/cp_exchanges.py, over the block kernels of
parallel/cp_blocks.py) are each a forward and a backward function, behind one custom op per
direction here (opaque to torch.compile). Tensors are (batch, seq, heads, head_dim) as in
`meshtrain.models.context`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..layout.mesh import CP_COMMS
from .cp_blocks import _acc
from .cp_exchanges import _EXCHANGES, _KEPT_INPUTS, _check_a2a_heads


# ---------------------------------------------------------------- one opaque op per direction
#
# torch.compile cannot trace c10d calls, so the exchange is a custom op: opaque to dynamo
# (steps compile with fullgraph=True), with its backward registered as another custom op.
# The process group travels by name. Outputs never alias inputs or each other.

def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@torch.library.custom_op("meshtrain::cp_attention", mutates_args=())
def _cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor | None, group: str,
                  comm: str) -> list[torch.Tensor]:
    out, saved = _EXCHANGES[comm][0](q, k, v, _group(group), segments)
    return [t.contiguous() for t in (out, *saved)]  # the layout the fake promises


@_cp_attention.register_fake
def _(q, k, v, segments, group, comm):
    cp, (b, s, hq, d), hkv = _group(group).size(), q.shape, k.shape[2]
    lse_shape, S = (b, hq // cp, s * cp) if comm == "a2a" else (b, hq, s), s * cp
    saved = [q.new_empty(lse_shape, dtype=_acc(q.dtype))]
    if comm == "allgather":
        saved += [k.new_empty((2, b, S, hkv, d)), q.new_empty((S,), dtype=torch.long)]
    elif comm == "a2a":
        saved += [q.new_empty((b, S, (hq + 2 * hkv) // cp, d)), q.new_empty((b, S, hq // cp, d)),
                  q.new_empty((S,), dtype=torch.long), q.new_empty((S,), dtype=torch.long)]
    return [q.new_empty(q.shape), *saved]


@torch.library.custom_op("meshtrain::cp_attention_backward", mutates_args=())
def _cp_attention_backward(dout: torch.Tensor, inputs: list[torch.Tensor], out: torch.Tensor,
                           saved: list[torch.Tensor], segments: torch.Tensor | None, group: str, comm: str,
                           hkv: int) -> list[torch.Tensor]:
    dq, dkv = _EXCHANGES[comm][1](dout, inputs, out, saved, _group(group), segments)
    return [dq.contiguous(), dkv.contiguous()]  # dK, dV stacked: views of one output would alias


@_cp_attention_backward.register_fake
def _(dout, inputs, out, saved, segments, group, comm, hkv):
    b, s, _, d = dout.shape
    return [dout.new_empty(dout.shape), dout.new_empty((2, b, s, hkv, d))]


def _setup_context(ctx, inputs, output):
    q, k, v, segments, ctx.group, ctx.comm = inputs
    ctx.kept, ctx.hkv, ctx.documents = _KEPT_INPUTS[ctx.comm], k.shape[2], segments is not None
    ctx.save_for_backward(*(q, k, v)[:ctx.kept], *output, *([segments] if ctx.documents else []))


def _backward(ctx, grads):
    saved = list(ctx.saved_tensors)
    segments = saved.pop() if ctx.documents else None
    inputs, (out, *rest) = saved[:ctx.kept], saved[ctx.kept:]
    dq, dkv = _cp_attention_backward(grads[0].contiguous(), inputs, out, list(rest), segments, ctx.group, ctx.comm,
                                     ctx.hkv)
    return dq, dkv[0], dkv[1], None, None, None


_cp_attention.register_autograd(_backward, setup_context=_setup_context)


def context_parallel_attention(q, k, v, group, comm: str, segments: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's zigzag shard. q (b, s_local, hq, d), k/v (b, s_local, hkv, d)
    are local tensors, s_local = 2c, hq a multiple of hkv (GQA: query head h uses kv head
    h // (hq//hkv)). group: the cp ProcessGroup (None: the default group). Softmax scale 1/sqrt(d).
    Returns (b, s_local, hq, d), equal to the matching rows of full-sequence causal attention.
    Differentiable w.r.t. q, k, v. comm: one of CP_COMMS. `segments` (b, s_local): this rank's
    document ids (zigzag, as q): a query then sees only keys of its own document, and a
    block none of this rank's queries can see is skipped. Values narrower than the keys
    (MLA's v_head_dim) are zero-padded to the key width, and the output cut back: the
    exchanges move keys and values as one stacked tensor, and the padding adds zeros only."""
    if comm not in _EXCHANGES:
        raise ConfigError(f"context-parallel comm {comm!r}: choose one of {', '.join(CP_COMMS)}")
    group = group if group is not None else dist.group.WORLD
    narrow = k.shape[-1] - v.shape[-1]
    if narrow > 0:
        v = torch.nn.functional.pad(v, (0, narrow))
    if q.shape[1] % 2 or q.shape[2] % k.shape[2] or k.shape != v.shape or q.shape[:2] != k.shape[:2]:
        raise ValueError(f"context_parallel_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "expected (b, 2c, hq, d) and (b, 2c, hkv, d) with hkv dividing hq")
    if comm == "a2a":
        _check_a2a_heads(q.shape[2], k.shape[2], dist.get_world_size(group))
    out = _cp_attention(q, k, v, segments, group.group_name, comm)[0]
    return out[..., :out.shape[-1] - narrow] if narrow > 0 else out
