"""Context-parallel causal attention (meshtrain.parallel.cp_attention) against full-sequence
attention on one process, for every comm type, with cp = 4, 2 and 1.

Each rank feeds its zigzag shard of the same random q, k, v and upstream gradient; the output
shard and the q/k/v gradient shards must equal the matching rows of the reference
(F.scaled_dot_product_attention, is_causal=True, enable_gqa) to fp64 round-off (fp32 cases:
1e-5). One spawn of 4 gloo ranks runs every case (cp=4 on the world group, cp=2 on the groups
{0,1} and {2,3}, cp=1 on single ranks); the parent checks the results.

The collectives of one forward+backward are counted by patching the `torch.distributed`
functions the module calls (EXPECTED_CALLS, bytes by `expected_bytes`; docs/parallelism.md
quotes the same numbers). Bytes per rank and layer: all_gather = gathered output,
reduce_scatter and all_to_all = input, p2p = each tensor sent.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtrain.errors import ConfigError
from meshtrain.models.attention import dense_document_attention
from meshtrain.parallel import cp_attention as cpa, cp_blocks, cp_exchanges
from meshtrain.parallel.zigzag import zigzag_order
from meshtrain.testing import run_ranks

# (phase, op) -> calls per layer, for a context-parallel group of cp ranks.
EXPECTED_CALLS = {
    "allgather": lambda cp: {("fwd", "all_gather"): 1, ("bwd", "reduce_scatter"): 1},
    # ring bwd: cp-1 K/V hops + cp dK/dV hops (the last one brings each block's gradient home)
    "ring": lambda cp: {("fwd", "send"): cp - 1, ("bwd", "send"): 2 * cp - 1},
    "a2a": lambda cp: {("fwd", "all_to_all"): 2, ("bwd", "all_to_all"): 2},
}


def expected_bytes(comm, b, S, cp, hq, hkv, d, B):
    """(phase, op) -> bytes per rank per layer. B bytes/element of q/k/v; gradients summed
    over ranks (allgather's reduce-scatter, ring's dK/dV) travel in fp32 (max(B, 4))."""
    Bacc, kv = max(B, 4), 2 * b * S * hkv * d  # kv: elements of the whole sequence's K and V
    if comm == "allgather":
        return {("fwd", "all_gather"): kv * B, ("bwd", "reduce_scatter"): kv * Bacc}
    if comm == "ring":
        return {("fwd", "send"): (cp - 1) * kv // cp * B, ("bwd", "send"): (cp - 1) * kv // cp * B + kv * Bacc}
    tokens = b * S // cp
    return {("fwd", "all_to_all"): tokens * d * ((hq + 2 * hkv) + hq) * B,
            ("bwd", "all_to_all"): tokens * d * (hq + (hq + 2 * hkv)) * B}


def _full(b, S, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, S, h, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv, hq)]


def _segments(b, S, seed):
    """Document ids (b, S): random lengths from 1 to S // 2, one row a single document."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.zeros(S, dtype=torch.long)]
    for _ in range(b - 1):
        ends = (torch.rand(S, generator=g) < 0.3).long()
        ends[0] = 0
        rows.append(ends.cumsum(0))
    return torch.stack(rows[:b])


def _reference(q, k, v, dout, segments=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if segments is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True).transpose(1, 2)
    else:
        out = dense_document_attention(qt, kt, vt, segments).transpose(1, 2)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _max_errors(comm, group, b, S, hq, hkv, d, dtype, seed=0, documents=False):
    """Max abs error of this rank's output and q/k/v gradient shards against the reference;
    `documents`: with random packed documents, against one dense document mask."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    full = _full(b, S, hq, hkv, d, dtype, seed)
    perm = zigzag_order(S, cp)
    segments = _segments(b, S, seed) if documents else None
    q, k, v, dout = (t.index_select(1, perm).chunk(cp, 1)[r].clone() for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    local = None if segments is None else segments.index_select(1, perm).chunk(cp, 1)[r].clone()
    out = cpa.context_parallel_attention(q, k, v, group, comm, local)
    out.backward(dout)
    ref = [t.index_select(1, perm).chunk(cp, 1)[r] for t in _reference(*full, segments)]
    return max((a - e).abs().max().item() for a, e in zip((out, q.grad, k.grad, v.grad), ref))


_NAMES = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
          "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
          "all_to_all_single": "all_to_all"}


def _count(comm, group, b, S, hq, hkv, d):
    """Collective calls and bytes of one fp32 forward+backward, by (phase, op)."""
    calls, nbytes, phase, saved = {}, {}, ["fwd"], {}

    def log(op, t):
        key = (phase[0], op)
        calls[key] = calls.get(key, 0) + 1
        nbytes[key] = nbytes.get(key, 0) + t.numel() * t.element_size()

    def collective(name):
        def f(*args, **kw):
            log(_NAMES[name], args[0] if _NAMES[name] == "all_gather" else args[1])
            return saved[name](*args, **kw)
        return f

    def p2p(ops):
        for op in ops:
            if op.op is dist.isend:
                log("send", op.tensor)
        return saved["batch_isend_irecv"](ops)

    for name in [n for n in _NAMES if hasattr(dist, n)] + ["batch_isend_irecv"]:
        saved[name] = getattr(dist, name)
        setattr(dist, name, p2p if name == "batch_isend_irecv" else collective(name))
    try:
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        q, k, v, dout = (t.chunk(cp, 1)[r].clone() for t in _full(b, S, hq, hkv, d, torch.float32, 1))
        q.requires_grad_()
        out = cpa.context_parallel_attention(q, k.requires_grad_(), v.requires_grad_(), group, comm)
        phase[0] = "bwd"
        out.backward(dout)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return calls, nbytes


def _ring_blocks_computed():
    """Forward block kernels the ring runs at cp 4 when every chunk is a document of its own:
    only the own block's diagonal (the other blocks are skipped)."""
    calls, kernel = [0], cp_blocks._block_forward

    def counted(*args):
        calls[0] += 1
        return kernel(*args)

    cp_blocks._block_forward = counted
    try:
        perm = zigzag_order(16, 4)
        segments = (torch.arange(16) // 2)[None].index_select(1, perm).chunk(4, 1)[dist.get_rank()]
        q = torch.randn(1, 4, 2, 8)
        cpa.context_parallel_attention(q, q, q, None, "ring", segments)
    finally:
        cp_blocks._block_forward = kernel
    return calls[0]


def _worker(cases, a2a_errors, count_shapes):
    """All cases of one spawn of 4 ranks: cp=4 on the world group, cp=2 on the groups {0,1} and
    {2,3} (p2p peers are global ranks that differ from group ranks), cp=1 on single ranks."""
    rank = dist.get_rank()
    pairs = [dist.new_group([i, i + 1]) for i in (0, 2)]
    singles = [dist.new_group([i]) for i in range(4)]
    groups = {4: None, 2: pairs[rank // 2], 1: singles[rank]}
    errors = {case: _max_errors(case[1], groups[case[0]], *case[2:-1], documents=case[-1] == "documents")
              for case in cases}
    messages = {}
    for cp, hq, hkv in a2a_errors:
        q, kv = torch.zeros(1, 4, hq, 8), torch.zeros(1, 4, hkv, 8)
        try:
            cpa.context_parallel_attention(q, kv, kv, groups[cp], "a2a")
        except ConfigError as e:
            messages[cp] = str(e)
    counts = {(cp, comm): _count(comm, groups[cp], *shape) for cp, shape in count_shapes.items()
              for comm in cpa.CP_COMMS}
    # The ring's j > r rule broken on purpose: the comparison must see it.
    rule = cp_exchanges._ring_pieces
    cp_exchanges._ring_pieces = lambda j, r, c: [(slice(c, None), slice(0, c), False)] if j > r else rule(j, r, c)
    try:
        mutated = _max_errors("ring", None, 1, 16, 2, 2, 8, torch.float64)
    finally:
        cp_exchanges._ring_pieces = rule
    return errors, messages, counts, _ring_blocks_computed(), mutated


@pytest.mark.slow
def test_all_comms_match_full_attention_cp4_cp2_cp1():
    f64, f32 = torch.float64, torch.float32
    cases = [(4, comm, 2, 24, 8, 4, 8, f64) for comm in cpa.CP_COMMS]               # GQA 8:4
    cases += [(4, comm, 1, 16, 6, 2, 4, f64) for comm in ("allgather", "ring")]      # a2a: 6 % 4 != 0
    cases += [(4, "ring", 1, 8, 4, 4, 4, f64)]                                       # one token per chunk
    cases += [(2, comm, 2, 12, hq, hkv, 8, dt) for comm in cpa.CP_COMMS
              for hq, hkv, dt in ((4, 4, f64), (4, 2, f64), (4, 2, f32))]            # MHA, GQA, fp32
    cases += [(2, comm, 1, 8, 3, 1, 4, f64) for comm in ("allgather", "ring")]       # MQA; a2a: 3 % 2 != 0
    cases += [(1, comm, 1, 6, 4, 2, 4, f64) for comm in cpa.CP_COMMS]
    cases = [(*c, "causal") for c in cases]
    # Packed documents (issue 24), random lengths from 1, a row that is one document
    cases += [(cp, comm, 3, 24, 8, 4, 8, f64, "documents") for cp in (4, 2) for comm in cpa.CP_COMMS]
    a2a_errors = [(4, 6, 2), (2, 3, 1)]
    count_shapes = {4: (1, 16, 8, 4, 4), 2: (2, 8, 4, 2, 4)}
    results = run_ranks(_worker, 4, cases, a2a_errors, count_shapes)
    for rank, (errors, messages, counts, ring_blocks, _) in enumerate(results):
        for case, err in errors.items():
            assert err < (1e-10 if case[-2] == f64 else 1e-5), f"rank {rank} {case}: max error {err:.3g}"
        assert ring_blocks == 1, (rank, ring_blocks)  # blocks no local query can see: skipped
        for cp, _, _ in a2a_errors:
            assert cp in messages and all(s in messages[cp] for s in (
                "model.n_heads", "model.n_kv_heads", f"cp={cp}", "allgather", "ring")), messages
        for (cp, comm), (calls, nbytes) in counts.items():
            assert calls == EXPECTED_CALLS[comm](cp), (cp, comm, calls)
            assert nbytes == expected_bytes(comm, *count_shapes[cp][:2], cp, *count_shapes[cp][2:], 4), \
                (cp, comm, nbytes)
    mutated = max(r[-1] for r in results)
    assert mutated > 1e-2, f"a wrong j > r block went unnoticed (error {mutated:.3g})"


def test_zigzag_order_layout_and_errors():
    cp, c = 3, 2
    perm = zigzag_order(2 * cp * c, cp)
    assert perm.dtype == torch.long and sorted(perm.tolist()) == list(range(2 * cp * c))
    chunks = torch.arange(2 * cp * c).view(2 * cp, c)
    for r, block in enumerate(perm.view(cp, 2, c)):
        assert torch.equal(block[0], chunks[r]) and torch.equal(block[1], chunks[2 * cp - 1 - r])
    assert torch.equal(zigzag_order(4, 1), torch.arange(4))
    for seq_len, cp in ((10, 2), (6, 2), (7, 1)):
        with pytest.raises(ConfigError) as e:
            zigzag_order(seq_len, cp)
        assert all(s in str(e.value) for s in (str(seq_len), f"cp={cp}", f"multiple of 2*cp={2 * cp}")), e.value


def test_unknown_comm_is_a_config_error():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ConfigError, match="allgather, ring, a2a"):
        cpa.context_parallel_attention(q, q, q, None, "p2p")


def test_block_kernels_match_autograd(one_thread):
    """The math block kernels (GQA 6:2, causal and not, sq != sk) against autograd of SDPA."""
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, 5, 6, 4, generator=g, dtype=torch.float64) for _ in range(2))
    for causal, sk in ((True, 5), (False, 7)):
        k, v = (torch.randn(2, sk, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
        out, lse = cp_blocks._block_forward(q, k, v, causal)
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qs, ks, vs)), is_causal=causal,
                                             enable_gqa=True).transpose(1, 2)
        ref.backward(dout)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(3, 2)) / 2
        if causal:
            scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=0, atol=1e-12)
        torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-12)
        grads = cp_blocks._block_backward(dout, q, k, v, out, lse, causal)
        for got, want in zip(grads, (qs.grad, ks.grad, vs.grad)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
