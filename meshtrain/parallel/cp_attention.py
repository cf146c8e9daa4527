"""Exact causal attention over a context-parallel (zigzag-sharded) sequence, forward and backward.

Context parallelism splits the sequence over the `cp` ranks of a process group. With a causal
mask a contiguous split would leave the first rank almost idle and the last one with most of the
work, so the sequence is cut into 2*cp chunks of c tokens and rank r holds chunks r and 2cp-1-r
(one early, one late: every rank does the same work). `zigzag_order` gives that layout.

Three ways to exchange what attention needs, each a forward and a backward function behind one
custom op per direction (opaque to torch.compile):

  allgather  all-gather K/V (one collective), attend both local q chunks to the keys before them;
             backward: one reduce-scatter of dK/dV.
  ring       K/V blocks travel around the ring with p2p while the current block is computed;
             partial results merge by log-sum-exp; backward sends dK/dV along with the blocks.
  a2a        Ulysses: one all-to-all from sequence- to head-sharded, full causal attention on
             cp-th of the heads, one all-to-all back (mirrored in backward).

The per-block kernels `_block_forward` / `_block_backward` are flash-attention style: the backward
recomputes the probabilities from the final (merged) out and lse of each row, so no per-block state
is kept. Tensors are (batch, seq, heads, head_dim) as in `meshtrain.models.context`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..layout.mesh import CP_COMMS

aten = torch.ops.aten


def zigzag_order(seq_len: int, cp: int) -> torch.Tensor:
    """LongTensor perm of length seq_len: x.index_select(seq_dim, perm) puts the sequence in
    zigzag order, so that its cp equal contiguous blocks are the ranks' shards (block r = chunks
    r and 2cp-1-r). Raises ConfigError if seq_len is not a multiple of 2*cp."""
    if cp < 1 or seq_len < 1 or seq_len % (2 * cp):
        step = 2 * max(cp, 1)
        raise ConfigError(f"sequence length {seq_len} cannot be split zigzag over cp={cp}: it must be a "
                          f"multiple of 2*cp={step}; use a seq_len like {max(seq_len // step, 1) * step}")
    chunks = torch.arange(seq_len).view(2 * cp, -1)
    ranks = torch.arange(cp)
    return chunks[torch.stack([ranks, 2 * cp - 1 - ranks], 1).flatten()].flatten()


# ---------------------------------------------------------------- block kernels

def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32 accumulation, fp64 stays fp64


def _use_fused(q: torch.Tensor) -> bool:
    # The flash kernel: CUDA, half precision, head_dim a multiple of 8 up to 256.
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def _heads_first(q, k, v):
    """(b, heads, s, d) views for the aten kernels; kv heads repeated locally to hq (a block-sized
    copy, never communicated), so that GQA needs nothing of the kernel."""
    g = q.shape[2] // k.shape[2]
    k, v = (t if g == 1 else t.repeat_interleave(g, 2) for t in (k, v))
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _scores(q, k, causal, same=None):
    """Scaled scores (b, hkv, g, sq, sk) in the accumulation dtype; query head h uses kv head h // g.
    `same` (b, sq, sk): where query and key are in one document (None: everywhere)."""
    acc, hkv = _acc(q.dtype), k.shape[2]
    s = torch.einsum("bqhgd,bkhd->bhgqk", q.to(acc).unflatten(2, (hkv, -1)), k.to(acc)) * q.shape[-1] ** -0.5
    if causal:  # only square diagonal blocks are causal: query i sees keys <= i
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    if same is not None:
        s = s.masked_fill(~same[:, None, None], float("-inf"))
    return s


def _block_forward(q, k, v, causal, same=None):
    """Attention of q (b, sq, hq, d) to k/v (b, sk, hkv, d); `causal` needs sq == sk; `same`
    as for `_scores`. Returns out (b, sq, hq, d) and its log-sum-exp (b, hq, sq) (fp32 or
    fp64); a row that sees no key here gets out 0 and lse -inf."""
    if _use_fused(q) and same is None:
        out, lse = aten._scaled_dot_product_flash_attention(*_heads_first(q, k, v), 0.0, causal,
                                                            scale=q.shape[-1] ** -0.5)[:2]
        return out.transpose(1, 2), lse
    s = _scores(q, k, causal, same)
    lse = torch.logsumexp(s, -1)
    finite = lse.masked_fill(lse == float("-inf"), 0)  # a row with no key: exp(-inf) = 0, not nan
    out = torch.einsum("bhgqk,bkhd->bqhgd", torch.exp(s - finite.unsqueeze(-1)), v.to(s.dtype))
    return out.flatten(2, 3), lse.flatten(1, 2)


def _block_backward(dout, q, k, v, out, lse, causal, same=None):
    """Gradients (dq, dk, dv) of one block, in the accumulation dtype (the fused path's dq: in
    the kernel's dtype, for the caller to add into its accumulator). `out` and `lse` are the
    FINAL rows of the whole attention (not this block's): then P = exp(S - lse) is this block's
    share of the softmax and D = rowsum(dout * out), so the blocks' gradients simply add up."""
    scale, hkv = q.shape[-1] ** -0.5, k.shape[2]
    if _use_fused(q) and same is None:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout.transpose(1, 2), *_heads_first(q, k, v), out.transpose(1, 2), lse.contiguous(),
            None, None, q.shape[1], k.shape[1], 0.0, causal, None, None, scale=scale)  # dense, no dropout
        # Summed over each kv head's query group in fp32; dq stays in the kernel's dtype and
        # is added into the fp32 accumulator by the caller (one pass instead of two).
        dk, dv = (t.transpose(1, 2).unflatten(2, (hkv, -1)).sum(3, dtype=torch.float32) for t in (dk, dv))
        return dq.transpose(1, 2), dk, dv
    s = _scores(q, k, causal, same)
    acc = s.dtype
    p = torch.exp(s - lse.to(acc).unflatten(1, (hkv, -1)).unsqueeze(-1))
    do = dout.to(acc).unflatten(2, (hkv, -1))                               # (b, sq, hkv, g, d)
    delta = (do * out.to(acc).unflatten(2, (hkv, -1))).sum(-1).permute(0, 2, 3, 1)
    dv = torch.einsum("bhgqk,bqhgd->bkhd", p, do)
    ds = p * (torch.einsum("bqhgd,bkhd->bhgqk", do, v.to(acc)) - delta.unsqueeze(-1)) * scale
    dq = torch.einsum("bhgqk,bkhd->bqhgd", ds, k.to(acc)).flatten(2, 3)
    dk = torch.einsum("bhgqk,bqhgd->bkhd", ds, q.to(acc).unflatten(2, (hkv, -1)))
    return dq, dk, dv


def _same(segs, rows, keys):
    """Which queries `rows` see which keys `keys` by document (b, sq, sk), False where none
    does (the block is skipped: no work, and no -inf rows); None without documents."""
    if segs is None:
        return None
    seg_q, seg_k = segs
    same = seg_q[:, rows, None] == seg_k[:, None, keys]
    return same if bool(same.any()) else False


def _attend(q, k, v, pieces, out, lse, segs=None):
    """Add the blocks `pieces` = [(q rows, key positions, causal)] into the running (out, lse),
    in place, by log-sum-exp: out = sum_i exp(lse_i - lse) out_i, lse = logsumexp_i lse_i.
    `segs`: (query, key) document ids (b, sq) and (b, sk), or None."""
    for rows, keys, causal in pieces:
        same = _same(segs, rows, keys)
        if same is False:
            continue
        o, l = _block_forward(q[:, rows], k[:, keys], v[:, keys], causal, same)
        old = lse[:, :, rows]
        new = torch.logaddexp(old, l)  # stable; the first block meets lse = -inf, weight 0
        # The two weights exp(old - new) and exp(l - new) sum to 1: one in-place lerp. A row
        # no key has reached yet (new = -inf) keeps out 0.
        weight = torch.exp(l - new).nan_to_num(0.0)
        out[:, rows].lerp_(o.to(out.dtype), weight.transpose(1, 2).unsqueeze(-1))
        lse[:, :, rows] = new


def _attend_backward(dout, q, k, v, out, lse, pieces, dq, dkv, segs=None):
    """Accumulate the pieces' gradients into dq and dkv = stacked (dk, dv)."""
    for rows, keys, causal in pieces:
        same = _same(segs, rows, keys)
        if same is False:
            continue
        gq, gk, gv = _block_backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys],
                                     out[:, rows], lse[:, :, rows], causal, same)
        dq[:, rows] += gq
        dkv[0, :, keys] += gk
        dkv[1, :, keys] += gv


def _running(q):
    """Empty running (out, lse) for q's rows: out 0, lse -inf, in the accumulation dtype."""
    out = torch.zeros(q.shape, dtype=_acc(q.dtype), device=q.device)
    return out, out.new_full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"))


# ---------------------------------------------------------------- collectives (looked up on `dist` at call time)

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


# ---------------------------------------------------------------- the three exchanges

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
    block none of this rank's queries can see is skipped."""
    if comm not in _EXCHANGES:
        raise ConfigError(f"context-parallel comm {comm!r}: choose one of {', '.join(CP_COMMS)}")
    group = group if group is not None else dist.group.WORLD
    if q.shape[1] % 2 or q.shape[2] % k.shape[2] or k.shape != v.shape or q.shape[:2] != k.shape[:2]:
        raise ValueError(f"context_parallel_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "expected (b, 2c, hq, d) and (b, 2c, hkv, d) with hkv dividing hq")
    if comm == "a2a":
        _check_a2a_heads(q.shape[2], k.shape[2], dist.get_world_size(group))
    return _cp_attention(q, k, v, segments, group.group_name, comm)[0]
