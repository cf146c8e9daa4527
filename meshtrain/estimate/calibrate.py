"""Measure the device this process runs on, and fit the hardware model's curves and links
to what was measured (`meshtrain calibrate`; run/calibrate.py launches the ranks).

Every timing is the median of repeats after warm-up runs (on CUDA, synchronised). Fits:
- matmul: time = a + flops / P by least squares on relative error (small products weigh
  as much as large ones), a >= 0; that is the curve tflops = P f / (f + a P), so
  max_tflops = P and half_flops = a P;
- attention: 1 / tflops = 1 / M + h / (M s), a line in 1 / s, so max_tflops = M and
  half_seq = h;
- collectives: timed as a step meets them, issued as the runtime does (functional
  collectives), each right after a small product on every rank, CHAIN in a row, less
  the products alone. A barrier before each (as this did first) lines the ranks up and
  flatters: gloo's all-gather of 512 KiB took 0.4 ms so, where a tensor-parallel step
  waits 1.3 ms for one, as this measures. Per op, time = a + bytes / b, and the ring's
  latency steps and share of the buffer (hardware.collective_terms) turn a and b into
  one link's latency and per-rank bandwidth, the median over the ops; the points themselves, made non-decreasing in
  bytes (`non_decreasing`), are the hardware's collective_table;
- overlap: compute beside an async all-gather against each alone (`overlap_share`);
  on this 2-core CPU the two take about their sum (gloo's transport needs the cores),
  on a GPU about the longer;
- drift: a compute segment then a tiny all-reduce waited at once, against each alone
  (`sync_skew`): on this CPU the pair took 0.15-0.4 of the segment more, on the mean
  (the ranks' speeds wander; the rank that waits must be woken).
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from .hardware import COLLECTIVES, Curve, Link, collective_terms

CHAIN = 8  # collectives per timed repeat
SEGMENT_S = 5e-3  # compute between two waited collectives in time_sync (a step's: 1-30 ms here)
FLOOR_S = 1e-7  # the least a collective is taken to cost
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Each timed sample of compute lasts at least this long (calls in a row, per call after): a
# lone 64^3 product takes ~60 us on this CPU, and in one CI run the median of three single
# calls read 2.4x the curve fitted through its neighbours.
MIN_SAMPLE_S = 2e-3


def median_seconds(fn, device: torch.device, repeats: int, warmup: int = 2, lockstep: bool = False,
                   min_sample_s: float = 0.0) -> float:
    """Median seconds per call of fn over repeats; with `lockstep`, every rank of the process
    group starts each repeat together (a barrier first), as ranks of a step compute at once.
    `min_sample_s`: each repeat calls fn as often as the last warm-up says fills it; fn must
    then issue no collective (ranks could choose different counts)."""
    for _ in range(warmup - 1):
        fn()
    calls = min(100_000, max(1, math.ceil(min_sample_s / max(_seconds(fn, device, 1), 1e-9))))
    times = []
    for _ in range(repeats):
        if lockstep:
            dist.barrier()
        times.append(_seconds(fn, device, calls))
    return statistics.median(times) / calls


def _seconds(fn, device: torch.device, calls: int) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return time.perf_counter() - start


def measure_matmul(device: torch.device, dtypes, shapes, repeats: int, lockstep: bool = False) -> list[list]:
    """[m, n, k, dtype, TFLOP/s] for each shape and dtype."""
    out = []
    for dtype in dtypes:
        for m, n, k in shapes:
            a = torch.randn(m, k, device=device, dtype=TORCH_DTYPES[dtype])
            b = torch.randn(k, n, device=device, dtype=TORCH_DTYPES[dtype])
            seconds = median_seconds(lambda: a @ b, device, repeats, lockstep=lockstep, min_sample_s=MIN_SAMPLE_S)
            out.append([m, n, k, dtype, 2.0 * m * n * k / seconds / 1e12])
    return out


def attention_flops(heads: int, seq: int, head_dim: int) -> float:
    """Forward + backward (3 x forward) of the causal half of the square, one sequence."""
    return 3.0 * 4.0 * heads * seq * seq * head_dim / 2


def measure_attention(device: torch.device, dtypes, seqs, repeats: int, heads: int = 4,
                      head_dim: int = 64, lockstep: bool = False) -> list[list]:
    """[seq, dtype, TFLOP/s] of causal SDPA, forward and backward, one sequence."""
    out = []
    for dtype in dtypes:
        for seq in seqs:
            q, k, v = (torch.randn(1, heads, seq, head_dim, device=device, dtype=TORCH_DTYPES[dtype],
                                   requires_grad=True) for _ in range(3))

            def step():
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

            seconds = median_seconds(step, device, repeats, lockstep=lockstep, min_sample_s=MIN_SAMPLE_S)
            out.append([seq, dtype, attention_flops(heads, seq, head_dim) / seconds / 1e12])
    return out


def measure_launch(device: torch.device, repeats: int, ops: int = 200, lockstep: bool = False) -> float:
    """Seconds per kernel of a stream of tiny ones (a one-element add): the host's dispatch
    and launch, which no kernel can beat."""
    x = torch.zeros(1, device=device)

    def stream():
        for _ in range(ops):
            x.add_(1.0)

    return median_seconds(stream, device, repeats, lockstep=lockstep, min_sample_s=MIN_SAMPLE_S) / ops


def measure_memory(device: torch.device, nbytes: int, repeats: int, lockstep: bool = False) -> float:
    """Bytes/s of a large copy, counting bytes read and written."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), device, repeats, lockstep=lockstep, min_sample_s=MIN_SAMPLE_S)


# The fitted ceiling may exceed the best throughput measured by this much at most: a fit
# of small products alone (--quick) would otherwise extrapolate a peak nothing reached.
_EXTRAPOLATE = 1.25


def fit_matmul(points: list[list], dtype: str) -> Curve:
    flops = np.array([2.0 * m * n * k for m, n, k, d, _ in points if d == dtype])
    tflops = np.array([t for *_, d, t in points if d == dtype])
    seconds = flops / (tflops * 1e12)
    a, inverse = _fit_line(flops, seconds)
    top = min(1.0 / inverse / 1e12, _EXTRAPOLATE * float(tflops.max()))
    if top < 1.0 / inverse / 1e12:  # the ceiling capped: the fixed cost that best explains the rest
        a = max(0.0, float(np.median(seconds - flops / (top * 1e12))))
    return Curve(float(top), float(a * top * 1e12))


def fit_attention(points: list[list], dtype: str, peak: float) -> Curve:
    """The attention curve through [seq, dtype, TFLOP/s] points, its ceiling at most
    _EXTRAPOLATE x the best measured and at most `peak` (noisy points can tilt the line in
    1 / s towards a ceiling no kernel reaches: one calibration here fitted 3.2 bf16 TFLOP/s
    where the best matmul reached 0.48)."""
    seqs = np.array([s for s, d, _ in points if d == dtype], dtype=float)
    tflops = np.array([t for _, d, t in points if d == dtype])
    a, slope = _fit_line(1.0 / seqs, 1.0 / tflops, relative=False)
    top = min(_EXTRAPOLATE * float(tflops.max()), peak)
    if a > 0 and 1.0 / a <= top:
        return Curve(float(1.0 / a), float(slope / a))
    # the ceiling capped: the half sequence that best explains the points under it
    return Curve(float(top), max(0.0, float(np.median(seqs * (top / tflops - 1.0)))))


def _fit_line(x: np.ndarray, y: np.ndarray, relative: bool = True) -> tuple[float, float]:
    """(intercept >= 0, slope > 0) of y = intercept + slope x, least squares (on y's
    relative error when `relative`). A negative intercept is refitted as 0. A slope <= 0
    (gloo takes about as long for 4 KiB as for 256 KiB, and noise can tilt three such
    points down) resolves no size term: the intercept is then the fastest y, which bounds
    it, and the slope is fitted to what is left (refitting the intercept as 0 there made
    a quick calibration's link latency 0)."""
    w = 1.0 / y if relative else np.ones_like(y)
    design = np.stack([w, x * w], axis=1)
    intercept, slope = np.linalg.lstsq(design, y * w, rcond=None)[0]
    if slope <= 0:
        intercept = float(y.min())
        slope = float(np.sum(x * w * (y - intercept) * w) / np.sum((x * w) ** 2))
    if intercept < 0 or slope <= 0:
        intercept = 0.0
        slope = float(np.sum(x * w * y * w) / np.sum((x * w) ** 2))
    return float(intercept), float(slope)


def collective_fits(times: dict[str, dict[int, float]], n: int) -> dict[str, dict]:
    """Per op, {latency_s, bandwidth} of the link that explains `times` (op -> bytes ->
    seconds) through the ring's terms for n ranks."""
    out = {}
    for op, by_size in times.items():
        sizes = np.array(sorted(by_size), dtype=float)
        a, slope = _fit_line(sizes, np.array([by_size[int(s)] for s in sizes]))
        steps, share = collective_terms(op, n)
        out[op] = {"latency_s": float(a / steps), "bandwidth": float(share / slope)}
    return out


def link_from(fits: dict[str, dict]) -> Link:
    return Link(statistics.median(f["latency_s"] for f in fits.values()),
                statistics.median(f["bandwidth"] for f in fits.values()))


def non_decreasing(points: dict[int, float]) -> dict[int, float]:
    """The closest (least squares) non-decreasing seconds over increasing bytes: where a
    larger buffer measured faster, the two are pooled to their mean (pool adjacent
    violators); a larger buffer never takes less time, and noise should not say so."""
    blocks: list[list] = []  # [mean, count]
    for b in sorted(points):
        blocks.append([points[b], 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    values = [m for m, n in blocks for _ in range(n)]
    return dict(zip(sorted(points), values))


def time_collectives(sizes, repeats: int, device: torch.device) -> tuple[dict[str, dict[int, list[float]]], list]:
    """In a process group: this rank's seconds per repeat of a product followed by each op
    (COLLECTIVES) at each buffer size in bytes (the whole buffer, as
    Hardware.collective_seconds takes it), and per repeat of the product alone: a
    collective as a step meets it (module docstring; `after_products` subtracts).
    send_recv pairs ranks 0-1, 2-3, ...: each sends the buffer to the other and receives
    theirs at once, as a step of cp's ring does (on gloo here that takes about twice a
    one-way send); a last unpaired rank waits at the barriers. The gathers, reductions and
    all-reduces go through the functional collectives, as the runtime's buckets and
    DTensor issue them (after a barrier on gloo here that path took 0.4-1.1 ms a call
    more than c10d's own; docs/performance.md)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    out: dict[str, dict[int, list[float]]] = {op: {} for op in COLLECTIVES}
    a = torch.randn(256, 256, device=device)
    alone = _per_call(lambda: a @ a, device, repeats)
    for size in sizes:
        elems = max(n, size // 4 // n * n)  # fp32, a multiple of n so shards are equal
        full = torch.ones(elems, device=device)
        shard = torch.ones(elems // n, device=device)
        received = torch.empty_like(full)
        peer = rank ^ 1
        ops = {"all_gather": lambda: funcol.wait_tensor(funcol.all_gather_single(shard, 0, world)),
               "reduce_scatter": lambda: funcol.wait_tensor(funcol.reduce_scatter_single(full, "sum", 0, world)),
               "all_reduce": lambda: funcol.wait_tensor(funcol.all_reduce(full, "sum", world)),
               "all_to_all": lambda: dist.all_to_all_single(received, full),
               "send_recv": lambda: _exchange(full, received, peer) if peer < n else None}
        for op, fn in ops.items():
            out[op][elems * 4] = _per_call(lambda: (a @ a, fn()), device, repeats)
    return out, alone


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]):
        work.wait()


def _products_lasting(seconds: float, device: torch.device, repeats: int):
    """In a process group: a callable running square products for about `seconds`, the
    count agreed over the ranks (the most any needs) so every rank runs the same compute."""
    side = 512 if device.type == "cuda" else 256
    a = torch.randn(side, side, device=device)
    product = median_seconds(lambda: a @ a, device, repeats)
    count = torch.tensor([max(1, round(seconds / product))], device=device)
    dist.all_reduce(count, dist.ReduceOp.MAX)
    n = int(count.item())

    def compute():
        for _ in range(n):
            a @ a
    return compute


def time_overlap(device: torch.device, repeats: int, nbytes: int = 2**22) -> list[tuple[float, float, float]]:
    """In a process group: per repeat, this rank's seconds of compute alone, of an
    all-gather of `nbytes` alone, and of the two together (the gather issued async, the
    compute run, the gather waited), the compute sized to take about as long as the
    gather; each CHAIN times back to back, per call."""
    n = dist.get_world_size()
    shard = torch.ones(nbytes // 4 // n, device=device)
    full = torch.empty(shard.numel() * n, device=device)
    gather = median_seconds(lambda: dist.all_gather_single(full, shard), device, repeats)
    compute = _products_lasting(gather, device, repeats)

    def both():
        work = dist.all_gather_single(full, shard, async_op=True)
        compute()
        work.wait()

    fns = (compute, lambda: dist.all_gather_single(full, shard), both)
    return [tuple(_chained(fn, device, 1) for fn in fns) for _ in range(4 * repeats + 1)]


def time_sync(device: torch.device, repeats: int, segment_s: float = SEGMENT_S) -> list[tuple[float, float, float]]:
    """In a process group: per repeat, this rank's seconds of a compute segment alone
    (products for about `segment_s`), of a tiny all-reduce alone, and of the segment then
    the all-reduce waited; each CHAIN times back to back, per call (`sync_skew` reads
    them)."""
    small = torch.ones(1024, device=device)
    compute = _products_lasting(segment_s, device, repeats)

    def sync():
        funcol.wait_tensor(funcol.all_reduce(small, "sum", dist.group.WORLD))

    fns = (compute, sync, lambda: (compute(), sync()))
    return [tuple(_chained(fn, device, 1) for fn in fns) for _ in range(2 * repeats + 1)]


def sync_skew(per_rank: list[list[tuple[float, float, float]]]) -> float:
    """Seconds a waited collective adds per second of the compute before it (Hardware.
    sync_skew), from time_sync's tries on every rank: what segment-then-collective took
    beyond the segment alone and the collective alone, each the slowest rank's (a rank
    slower over the whole chain slows every layout, not only the waits), over the
    segment. The mean over tries, as a step adds up every wait (a wait's cost has a long
    tail: the median of a try read 0.1-0.3 here, the mean 0.15-0.4), at least 0."""
    out = []
    for i in range(len(per_rank[0])):
        compute, alone, both = (max(r[i][k] for r in per_rank) for k in range(3))
        out.append((both - compute - alone) / compute)
    return max(0.0, statistics.fmean(out))


def _per_call(fn, device: torch.device, repeats: int) -> list[float]:
    """Per repeat after two warm-ups, seconds per call of CHAIN calls back to back after a
    barrier."""
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(CHAIN):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / CHAIN)
    return times[2:]


def _chained(fn, device: torch.device, repeats: int) -> float:
    return statistics.median(_per_call(fn, device, repeats))


def slowest_tries(per_rank: list[list[tuple[float, float, float]]]) -> list[tuple[float, float, float]]:
    """Per repeat of time_overlap, each of its three times the slowest rank's."""
    return [tuple(max(r[i][k] for r in per_rank) for k in range(3)) for i in range(len(per_rank[0]))]


def overlap_share(tries: list[tuple[float, float, float]]) -> float:
    """Of a collective's time beside compute, the share the compute hid (Hardware.
    comm_overlap): per (compute, gather, both) try, 1 when the two together took as long
    as the longer alone, 0 when they took the sum; the median."""
    return statistics.median(1.0 - min(1.0, max(0.0, (both - max(compute, gather)) / min(compute, gather)))
                             for compute, gather, both in tries)


def after_products(per_rank: list[tuple[dict, list]]) -> dict[str, dict[int, float]]:
    """Per op and size, time_collectives' slowest median less the product's: the seconds
    of the collective itself, at least FLOOR_S (noise may make a tiny one look free, and
    the fits weigh points by 1 / seconds)."""
    product = statistics.median(max(r[1][i] for r in per_rank) for i in range(len(per_rank[0][1])))
    return {op: {size: max(FLOOR_S, t - product) for size, t in by_size.items()}
            for op, by_size in slowest_medians([r[0] for r in per_rank]).items()}


def slowest_medians(per_rank: list[dict]) -> dict[str, dict[int, float]]:
    """Per op and size, the median over repeats of the slowest rank's time (a collective
    ends when its last rank does)."""
    return {op: {size: statistics.median(max(r[op][size][i] for r in per_rank) for i in range(len(times)))
                 for size, times in by_size.items()}
            for op, by_size in per_rank[0].items()}
