"""The per-block attention kernels of context-parallel attention, and their log-sum-exp merge.

`_block_forward` / `_block_backward` are flash-attention style: the backward recomputes the
probabilities from the final (merged) out and lse of each row, so no per-block state is kept.
`_attend` / `_attend_backward` run a list of blocks ("pieces") into a running (out, lse) and
its gradients. Tensors are (batch, seq, heads, head_dim) as in `meshtrain.models.context`.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


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
