"""The chunked cross-entropy sum (meshtrain.models.losses) against F.cross_entropy, split
over an emulated vocab-parallel pair of ranks, compiled, and by its measured peak memory
(meshtrain.train.peak_memory, itself checked on known allocation patterns)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from meshtrain.models.losses import cross_entropy_sum
from meshtrain.train.peak_memory import peak_cpu_bytes, peak_from_events

MiB = 1 << 20


def _case(shape, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, vocab, generator=g)).to(dtype)
    targets = torch.randint(0, vocab, shape, generator=g)
    targets.view(-1)[::5] = -1  # every fifth token ignored
    return logits, targets


def _reference(logits, targets):
    """Loss and gradient from F.cross_entropy over the valid tokens, in fp32 from the same
    (possibly bf16) values."""
    x = logits.detach().float().requires_grad_()
    valid = targets >= 0
    loss = F.cross_entropy(x[valid], targets[valid], reduction="sum")
    loss.backward()
    return loss.detach(), x.grad


def _ours(logits, targets, **kw):
    x = logits.detach().clone().requires_grad_()
    loss = cross_entropy_sum(x, targets, **kw)
    loss.backward()
    return loss.detach(), x.grad


# Gradients are softmax - onehot = exp(logit - lse) - onehot. Both paths form logit - lse in
# fp32 with an absolute rounding error ~ eps * |lse| / 2 (|lse| <= ~12 for these logits, so
# ~7e-7), i.e. a relative error of that size in each softmax value, rounded differently on
# the two sides: rtol 2e-6 (worst seen over 20 seeds: 9.4e-7), plus atol 1e-7 (one fp32 ulp
# near 1, for the "- onehot" entries).
FP32_GRAD_TOL = dict(rtol=2e-6, atol=1e-7)
# bf16: both sides are the same fp32 gradient up to the rounding above; ours is then rounded
# once to bf16 (8 significant bits: relative error <= 2^-9). rtol 2^-8 (one bf16 ulp, so a
# value on a rounding tie may go the other way) and atol 1e-6 near 0.
BF16_GRAD_TOL = dict(rtol=2 ** -8, atol=1e-6)

# (token shape, chunk_rows): 2-D with chunks not dividing the rows (23 = 4 x 5 + 3),
# chunks larger than the rows, 3-D (batch, seq, V) with several chunks.
SHAPES = [((23,), 5), ((23,), 4096), ((3, 11), 7)]


@pytest.mark.parametrize("shape,chunk_rows", SHAPES)
def test_matches_cross_entropy_fp32(shape, chunk_rows):
    logits, targets = _case(shape, 97, torch.float32)
    before = logits.clone()
    loss, grad = _ours(logits, targets, chunk_rows=chunk_rows)
    ref_loss, ref_grad = _reference(logits, targets)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grad.dtype == torch.float32 and grad.shape == logits.shape
    torch.testing.assert_close(grad, ref_grad.view_as(grad), **FP32_GRAD_TOL)
    assert (grad.view(-1, 97)[targets.view(-1) < 0] == 0).all()
    torch.testing.assert_close(logits, before, rtol=0, atol=0)  # the in-place chunk math is a copy


@pytest.mark.parametrize("shape,chunk_rows", SHAPES)
def test_matches_cross_entropy_bf16(shape, chunk_rows):
    logits, targets = _case(shape, 97, torch.bfloat16)
    loss, grad = _ours(logits, targets, chunk_rows=chunk_rows)
    ref_loss, ref_grad = _reference(logits, targets)  # fp32 of the same bf16 values
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), ref_grad.view(grad.shape), **BF16_GRAD_TOL)
    assert (grad.view(-1, 97)[targets.view(-1) < 0] == 0).all()


def test_all_ignored_is_zero():
    logits, targets = _case((6,), 11, torch.float32)
    loss, grad = _ours(logits, torch.full_like(targets, -1), chunk_rows=4)
    assert loss.item() == 0 and (grad == 0).all()


class _EmulatedGroup:
    """In-process all-reduce for `world` ranks running in threads: each rank posts its
    tensor, all wait, each reads the reduction of all, all wait again before reuse."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.calls: list[tuple[int, str, tuple, torch.dtype]] = []

    def reducer(self, rank: int, op: str):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.calls.append((rank, op, tuple(t.shape), t.dtype))
            self.slots[rank] = t
            self.barrier.wait()
            stacked = torch.stack(self.slots)
            out = stacked.amax(0) if op == "max" else stacked.sum(0)
            self.barrier.wait()
            return out
        return reduce


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_two_ranks(dtype):
    """V = 97 split unevenly into [0, 40) and [40, 97): each rank's loss equals the unsplit
    loss, each rank's gradient is its slice of the unsplit gradient, and forward makes one
    all_max of (rows,) and one all_sum of (2, rows), both fp32, per rank."""
    vocab, bounds = 97, [(0, 40), (40, 97)]
    logits, targets = _case((3, 11), vocab, dtype, seed=1)
    rows = targets.numel()
    full_loss, full_grad = _ours(logits, targets, chunk_rows=7)
    group = _EmulatedGroup(len(bounds))

    def rank(r):
        lo, hi = bounds[r]
        return _ours(logits[..., lo:hi], targets, vocab_start=lo, chunk_rows=7,
                     all_max=group.reducer(r, "max"), all_sum=group.reducer(r, "sum"))

    with ThreadPoolExecutor(len(bounds)) as pool:
        results = [f.result() for f in [pool.submit(rank, r) for r in range(len(bounds))]]
    for loss, _ in results:
        torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=0)
    grad = torch.cat([g for _, g in results], -1)
    tol = FP32_GRAD_TOL if dtype == torch.float32 else BF16_GRAD_TOL
    torch.testing.assert_close(grad.float(), full_grad.float(), **tol)
    assert sorted(group.calls) == sorted((r, op, shape, torch.float32) for r in range(len(bounds))
                                         for op, shape in (("max", (rows,)), ("sum", (2, rows))))


def test_compiled_fullgraph_matches_eager(backend="aot_eager"):
    """Dynamo traces the chunk loop (3 chunks of 4 rows over 10) and the reductions (here
    identities, as on one rank) without a graph break: fullgraph=True raises on one.
    aot_eager runs the forward and backward graphs that inductor would get (seconds);
    inductor's code for this loss runs in every compiled step of test_equivalence."""
    logits, targets = _case((2, 5), 97, torch.bfloat16)
    kw = dict(vocab_start=0, chunk_rows=4, all_max=lambda t: t * 1, all_sum=lambda t: t * 1)
    loss, grad = _ours(logits, targets, **kw)
    compiled = torch.compile(lambda x, t: cross_entropy_sum(x, t, **kw), fullgraph=True, backend=backend)
    x = logits.detach().clone().requires_grad_()
    c_loss = compiled(x, targets)
    c_loss.backward()
    torch.testing.assert_close(c_loss, loss, rtol=1e-6, atol=0)
    # Equal up to one bf16 rounding flip (inductor's vectorised exp rounds differently).
    torch.testing.assert_close(x.grad.float(), grad.float(), **BF16_GRAD_TOL)


# ---------------------------------------------------------------- peak memory

def test_peak_known_pattern():
    """1 + 2 + 3 MiB live, free the 2, allocate 4, free the 3: the peak is 1 + 3 + 4 = 8 MiB
    exactly (above the 5 MiB still live at the end); tensors alive before fn starts do not
    count."""
    before = torch.empty(16 * MiB, dtype=torch.uint8)

    def pattern():
        a = torch.empty(1 * MiB, dtype=torch.uint8)
        b = torch.empty(2 * MiB, dtype=torch.uint8)
        c = torch.empty(3 * MiB, dtype=torch.uint8)
        del b
        d = torch.empty(4 * MiB, dtype=torch.uint8)
        del c
        return a, d

    result, peak = peak_cpu_bytes(pattern)
    assert peak == 8 * MiB
    assert [t.numel() for t in result] == [MiB, 4 * MiB]
    del before


def test_peak_events_walk():
    # (time, ptr, bytes): frees of blocks not allocated in the window are ignored; at equal
    # times allocations are counted before frees.
    events = [(0, 1, 10), (1, 99, -50), (2, 2, 20), (3, 1, -10), (3, 3, 5), (4, 4, 7)]
    assert peak_from_events(events) == 35


def test_peak_autograd_exact():
    """x.exp().exp().sum() backward: both exps are saved (2 N), the first backward product is
    made before the second saved exp is freed (3 N); plus a few scalars."""
    n = 4 * (1 << 18)
    x = torch.randn(n // 4, requires_grad=True)
    _, peak = peak_cpu_bytes(lambda: x.exp().exp().sum().backward())
    assert 3 * n <= peak <= 3 * n + 64


def test_peak_sees_checkpointing():
    """Eight layers (h * w).tanh().sin() on 1 MiB activations: autograd keeps two per layer
    (tanh's output, which sin also saves, and the layer output, the next layer's input);
    checkpointing each layer keeps only the layer outputs. Measured: 18 MiB without (16
    saved + 2 in backward), 12 MiB with (8 outputs + one layer recomputed + 2 in backward);
    the gradient is the same."""
    n = 1 << 18
    w = torch.randn(n, requires_grad=True)
    x = torch.randn(n)

    def layer(h):
        return (h * w).tanh().sin()

    def step(ckpt):
        h = x
        for _ in range(8):
            h = checkpoint(layer, h, use_reentrant=False) if ckpt else layer(h)
        h.sum().backward()

    peaks, grads = [], []
    for ckpt in (False, True):
        w.grad = None
        peaks.append(peak_cpu_bytes(step, ckpt)[1])
        grads.append(w.grad)
    torch.testing.assert_close(grads[0], grads[1])
    act = 4 * n
    assert peaks[0] >= 16 * act
    assert peaks[1] <= 13 * act < peaks[0] - 4 * act


def test_loss_peak_memory_far_below_plain():
    """Forward + backward on bf16 logits (2048 x 8192, 32 MiB):
    plain path holds an fp32 copy and an fp32 log-softmax, >= 2 x 4 x rows x V = 128 MiB
    (measured 192 MiB: backward adds an fp32 gradient of the same size);
    ours holds the bf16 gradient (32 MiB) + one fp32 chunk (256 rows: 8 MiB) + (rows,)
    vectors (measured 40.04 MiB)."""
    rows, vocab, chunk_rows = 2048, 8192, 256
    logits, targets = _case((rows,), vocab, torch.bfloat16)
    logits.requires_grad_()

    def ours():
        cross_entropy_sum(logits, targets, chunk_rows=chunk_rows).backward()

    def plain():
        valid = targets >= 0
        per_token = F.cross_entropy(logits.float(), targets.clamp(min=0), reduction="none")
        (per_token * valid).sum().backward()

    _, ours_peak = peak_cpu_bytes(ours)
    logits.grad = None
    _, plain_peak = peak_cpu_bytes(plain)
    grad_bytes = rows * vocab * logits.element_size()
    fp32_full, fp32_chunk = 4 * rows * vocab, 4 * chunk_rows * vocab
    assert ours_peak >= grad_bytes  # the measurement sees the gradient
    assert ours_peak <= grad_bytes + fp32_chunk + 1 * MiB
    assert plain_peak >= 2 * fp32_full
