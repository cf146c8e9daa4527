"""`meshtrain calibrate`: measure this machine and write a hardware file.

Everything is measured in ranks that `launch.launch` starts the way `meshtrain fit`
self-launches (gloo on CPU, NCCL on CUDA, one device per rank): compute and memory in
`nproc` ranks at once, as a run of that many ranks per machine computes (on a CPU the
ranks share its cores: two ranks of this 2-core box each multiply at about half the speed
of one alone), then the collectives among max(nproc, 2) ranks, a tiny step and compute
then a collective (the ranks' drift), in three passes (each point the median over them,
the drift's tries pooled), then compute beside a collective. The fits are
estimate/calibrate.py's. A single machine has one link level: inter_node is written
equal to intra_node, and the notes say so.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..estimate import calibrate as measure
from ..estimate.hardware import Hardware
from . import launch
from .calibrate_blocks import measure_block_attention
from .calibrate_host import sharded_launch_seconds, step_times, tiny_step

# (matmul shapes, attention sequence lengths, copy bytes, collective bytes, repeats, passes)
_FULL = ([(s, s, s) for s in (128, 256, 512, 1024, 1536)] + [(2048, 256, 512), (256, 1024, 2048)],
         (128, 256, 512, 1024, 2048), 256 * 2**20, [2**p for p in range(12, 25, 2)], 7, 3)
_QUICK = ([(64, 64, 64), (128, 128, 128), (256, 256, 256)], (64, 128, 256), 16 * 2**20,
          [2**12, 2**16, 2**19], 3, 1)


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _dtypes(device: torch.device) -> tuple[str, ...]:
    """What this device multiplies: fp16 is slow emulation on CPU, not a training dtype there."""
    return ("fp32", "bf16", "fp16") if device.type == "cuda" else ("fp32", "bf16")


def _rank(busy: int, compute: tuple, sizes, repeats: int, passes: int) -> dict:
    """Rank work: in each of `passes`, the first `busy` ranks measure compute at once
    (`_compute`'s arguments after the device), then all time the collectives, the tiny
    step and the drift; then the overlap. A shared box has slow spells of seconds: a
    point measured in one go can fall into one (one calibration here measured 0.085 fp32
    TFLOP/s, the next 0.131), so each is the median over passes spread across the run
    (`_pooled`)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=600))
    try:
        step = tiny_step(device)
        measured = []
        for _ in range(passes):
            dist.barrier()
            # several busy ranks compute in lockstep, as a step's ranks do
            one = {"compute": _compute(device, *compute, lockstep=busy > 1) if dist.get_rank() < busy else None}
            dist.barrier()
            one["collectives"] = measure.time_collectives(sizes, repeats, device)
            one["tiny_step_s"] = step_times(step, device, repeats)  # milliseconds each
            one["sync"] = measure.time_sync(device, repeats)
            measured.append(one)
        return {**_pooled(measured), "overlap": measure.time_overlap(device, repeats)}
    finally:
        dist.destroy_process_group()


def _pooled(passes: list[dict]) -> dict:
    """One rank's passes as one: each compute point the median over passes, the
    collectives', the drift's and the tiny step's repeats all together."""
    compute = None
    if passes[0]["compute"] is not None:
        compute = tuple(_median_points([p["compute"][i] for p in passes]) for i in range(len(passes[0]["compute"])))
    (ops, alone), *rest = [p["collectives"] for p in passes]
    for more_ops, more_alone in rest:
        ops = {op: {size: times + more_ops[op][size] for size, times in by_size.items()} for op, by_size in ops.items()}
        alone = alone + more_alone
    return {"compute": compute, "collectives": (ops, alone), "sync": [t for p in passes for t in p["sync"]],
            "tiny_step_s": statistics.median(t for p in passes for t in p["tiny_step_s"])}


def _median_points(values: list):
    """The median over passes of a measured number, or of each point's last field (its
    throughput) in lists of points."""
    if not isinstance(values[0], list):
        return statistics.median(values)
    return [points[0][:-1] + [statistics.median(p[-1] for p in points)] for points in zip(*values)]


def calibrate(out: str, nproc: int = 2, quick: bool = False) -> str:
    """Measure, fit, write `out` (a file Hardware.load reads); returns a one-line summary."""
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ConfigError(f"--nproc {nproc!r}: give the ranks a run puts on this machine (1 or more)")
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ConfigError(f"--nproc {nproc}: this machine has {torch.cuda.device_count()} GPUs; give at most that")
    shapes, seqs, copy_bytes, sizes, repeats, passes = _QUICK if quick else _FULL
    device = _device()
    dtypes = _dtypes(device)
    threads = int(os.environ.get("OMP_NUM_THREADS", 1))
    ranks = max(nproc, 2)  # one rank has no collectives: they are measured between two
    per_rank = launch.launch(_rank, (nproc, (dtypes, threads, shapes, seqs, copy_bytes, repeats), sizes, repeats,
                                     passes), ranks)
    matmul, attention, bandwidth, launch_s, blocks = per_rank[0]["compute"]
    times = measure.after_products([r["collectives"] for r in per_rank])
    fits = measure.collective_fits(times, ranks)
    link = measure.link_from(fits)
    curves = {d: measure.fit_matmul(matmul, d) for d in dtypes}
    # No data sheet here: the peak is the best this process reached (or the fit's ceiling).
    peak = {d: max(max(t for *_, dd, t in matmul if dd == d), curves[d].max_tflops) for d in dtypes}
    overlap = measure.slowest_tries([r["overlap"] for r in per_rank])
    tiny_step = max(r["tiny_step_s"] for r in per_rank)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    hw = Hardware(
        name=f"calibrated {name}", memory_bytes=_memory_bytes(device), ranks_per_node=nproc,
        peak_tflops=peak, matmul=curves, attention={d: measure.fit_attention(attention, d, peak[d]) for d in dtypes},
        block_attention={d: measure.fit_attention(blocks, d, peak[d]) for d in dtypes}, memory_bandwidth=bandwidth,
        links={"intra_node": link, "inter_node": link}, launch_s=launch_s,
        # send_recv is a pair's exchange whatever the group
        collective_table={op: {"ranks": 2 if op == "send_recv" else ranks,
                               "seconds_by_bytes": measure.non_decreasing(times[op])} for op in times},
        comm_overlap=measure.overlap_share(overlap), host_overlap=device.type == "cuda",
        sync_skew=measure.sync_skew([r["sync"] for r in per_rank]),
        notes=f"meshtrain calibrate{' --quick' if quick else ''} --nproc {nproc} on {name}, "
              f"{'nccl' if device.type == 'cuda' else f'gloo, {threads} thread(s) per rank'}, compute measured in "
              f"{nproc} rank(s) at once, collectives among {ranks}; "
              f"{datetime.date.today()}. One machine: inter_node "
              "is a copy of intra_node (not measured). peak_tflops is the best measured, not a data sheet's.",
        measured={"matmul": matmul, "attention": attention, "block_attention": blocks,
                  "memory": {"copy_bytes": copy_bytes, "bytes_per_s": bandwidth},
                  "collectives": {op: {"fit": fits[op], "seconds_by_bytes": times[op]} for op in times},
                  "overlap": {"compute_gather_both_s": [list(t) for t in overlap]},  # the slowest rank's
                  "sync": {"compute_sync_both_s": [[list(t) for t in r["sync"]] for r in per_rank]},  # by rank
                  "host": {"tiny_step_s": tiny_step}})
    # The host's cost per kernel: what the tiny step took beyond what the rest of hw prices.
    hw = dataclasses.replace(hw, sharded_launch_s=sharded_launch_seconds(hw, tiny_step, ranks))
    hw.dump(out)
    top = ", ".join(f"{d} {curves[d].max_tflops:.3g}" for d in dtypes)
    return (f"wrote {out}: matmul max TFLOP/s {top}; memory {bandwidth / 1e9:.3g} GB/s; link latency "
            f"{link.latency_s * 1e6:.3g} us, {link.bandwidth / 1e9:.3g} GB/s per rank ({ranks} ranks); "
            f"compute beside a collective hides {hw.comm_overlap:.0%} of it; a collective waited as issued "
            f"adds {hw.sync_skew:.2g} s per s of compute before it; {launch_s * 1e6:.3g} us per kernel "
            f"launch, {hw.sharded_launch_s * 1e6:.3g} us on a sharded mesh")


def _compute(device, dtypes, threads: int, shapes, seqs, copy_bytes: int, repeats: int, lockstep: bool):
    """Matmul and attention points, the copy bandwidth, the seconds per tiny kernel and cp's
    block kernels' points, on CPU with the threads a self-launched rank gets (launch.launch:
    OMP_NUM_THREADS, 1 unless set): on 2 shared cores, 2 threads made small products 100x
    slower than 1. `lockstep`: every rank measures, each repeat started together."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return (measure.measure_matmul(device, dtypes, shapes, repeats, lockstep=lockstep),
                measure.measure_attention(device, dtypes, seqs, repeats, lockstep=lockstep),
                measure.measure_memory(device, copy_bytes, repeats, lockstep=lockstep),
                measure.measure_launch(device, repeats, lockstep=lockstep),
                measure_block_attention(device, dtypes, seqs, repeats, lockstep=lockstep))
    finally:
        torch.set_num_threads(before)


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
