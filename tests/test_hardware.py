"""Hardware descriptions (meshtrain/estimate/hardware.py): the YAML file and its errors,
the built-ins and their data-sheet numbers, the closed forms of the collective and matmul
models, `meshtrain plan --gpu / --hardware`, and `meshtrain calibrate`."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
import yaml
from torch.distributed.tensor.debug import CommDebugMode

from meshtrain.errors import ConfigError
from meshtrain.estimate.calibrate import (collective_fits, fit_attention, median_seconds, non_decreasing, overlap_share,
                                          slowest_tries, sync_skew, time_collectives)
from meshtrain.estimate.dryrun import GPU_MEMORY, dry_run
from meshtrain.estimate.hardware import Curve, Hardware, collective_terms, to_dict
from meshtrain.run.calibrate import _pooled
from meshtrain.run.calibrate_host import sharded_launch_seconds, tiny_config
from meshtrain.estimate.hardware_builtins import BUILTINS
from meshtrain.testing import run_ranks
from meshtrain.train.metrics import PEAK_TFLOPS
from support.cli import ROOT, run_cli

H100 = BUILTINS["h100"]
TINY_PLAN = ["plan", "--config", str(ROOT / "configs" / "tiny.yaml"), "--world", "1"]


def test_a_hardware_file_round_trips(tmp_path):
    for hw in [*BUILTINS.values(), dataclasses.replace(H100, sync_skew=0.25, comm_overlap=0.5)]:
        hw.dump(tmp_path / "hw.yaml")
        assert Hardware.load(tmp_path / "hw.yaml") == hw


# name -> (memory bytes, peak TFLOP/s fp32 (TF32) / bf16 / fp8, HBM bytes/s, NVLink and NIC bytes/s per rank)
DATASHEETS = {"h100": (80e9, 494.7, 989.4, 1978.9, 3.35e12, 450e9, 50e9),
              "h200": (141e9, 494.7, 989.4, 1978.9, 4.8e12, 450e9, 50e9),
              "b200": (180e9, 1100, 2250, 4500, 8e12, 900e9, 50e9),
              "a100": (80e9, 156, 312, None, 2.039e12, 300e9, 25e9)}


@pytest.mark.parametrize("name", DATASHEETS)
def test_each_builtin_has_its_data_sheet_numbers(name):
    hw, (memory, fp32, bf16, fp8, hbm, nvlink, nic) = BUILTINS[name], DATASHEETS[name]
    assert hw.name == name and hw.memory_bytes == memory == GPU_MEMORY[name] and hw.ranks_per_node == 8
    assert (hw.peak_tflops["fp32"], hw.peak_tflops["bf16"], hw.peak_tflops["fp16"]) == (fp32, bf16, bf16)
    assert hw.peak_tflops.get("fp8") == fp8
    assert hw.memory_bandwidth == hbm
    assert (hw.links["intra_node"].bandwidth, hw.links["inter_node"].bandwidth) == (nvlink, nic)


def test_gpu_memory_is_what_it_was_and_the_mfu_peaks_agree():
    assert {k: GPU_MEMORY[k] for k in ("h100", "h200", "a100")} == {"h100": 80 * 10**9, "h200": 141 * 10**9,
                                                                     "a100": 80 * 10**9}
    for ours, theirs in (("h100", "H100 SXM"), ("h200", "H200"), ("a100", "A100")):
        assert {d: BUILTINS[ours].peak_tflops[d] for d in PEAK_TFLOPS[theirs]} == PEAK_TFLOPS[theirs]


def _bad(tmp_path, change) -> str:
    data = to_dict(H100)
    change(data)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        Hardware.load(tmp_path / "bad.yaml")
    return str(e.value)


@pytest.mark.parametrize("change, named", [
    (lambda d: d.pop("memory_bandwidth"), "memory_bandwidth is missing"),
    (lambda d: d["links"]["inter_node"].update(bandwidth=-1), "links.inter_node.bandwidth=-1"),
    (lambda d: d["links"]["intra_node"].pop("latency_s"), "links.intra_node needs latency_s"),
    (lambda d: d["peak_tflops"].update(fp64=60.0), "peak_tflops.fp64: unknown dtype"),
    (lambda d: d["matmul"].update(int4={"max_tflops": 1, "half_flops": 0}), "matmul.int4: unknown dtype"),
    (lambda d: d["matmul"]["bf16"].update(max_tflops=2000), "matmul.bf16.max_tflops=2000 is above peak"),
    (lambda d: d["matmul"].pop("fp8"), "matmul has no curve for fp8"),
    (lambda d: d.update(ranks_per_node=0), "ranks_per_node=0"),
    (lambda d: d.update(collective_algorithm="mesh"), "collective_algorithm='mesh'"),
    (lambda d: d.update(memory_byte=1), "memory_byte: unknown key"),
    (lambda d: d.update(host_overlap="yes"), "host_overlap='yes': give true or false"),
    (lambda d: d.update(sharded_launch_s=-1), "sharded_launch_s=-1"),
    (lambda d: d.update(comm_overlap=1.5), "comm_overlap=1.5: give a share from 0"),
    (lambda d: d.update(sync_skew=-0.1), "sync_skew=-0.1: give a non-negative number"),
    (lambda d: d.update(block_attention={"int4": {"max_tflops": 1, "half_seq": 0}}), "block_attention.int4: unknown"),
    (lambda d: d.update(collective_table={"broadcast": {}}), "collective_table.broadcast: unknown collective"),
    (lambda d: d.update(collective_table={"all_gather": {"ranks": 1, "seconds_by_bytes": {4: 1e-5}}}),
     "collective_table.all_gather.ranks=1"),
    (lambda d: d.update(collective_table={"all_gather": {"ranks": 2, "seconds_by_bytes": {}}}),
     "collective_table.all_gather.seconds_by_bytes must map"),
    (lambda d: d.update(collective_table={"all_gather": {"ranks": 2, "seconds_by_bytes": {"4k": 1e-5}}}),
     "'4k' is not a positive whole number of bytes"),
    (lambda d: d.update(collective_table={"all_gather": {"ranks": 2, "seconds_by_bytes": {4: 2e-5, 8: 1e-5}}}),
     "collective_table.all_gather.seconds_by_bytes falls as the bytes grow"),
])
def test_a_bad_file_names_the_key(tmp_path, change, named):
    assert named in _bad(tmp_path, change)


def test_ring_collectives_have_their_closed_forms():
    lat, bw, b = H100.links["intra_node"].latency_s, H100.links["intra_node"].bandwidth, 3e8
    for n in (2, 4, 8):
        gather = lat * (n - 1) + b * (n - 1) / n / bw
        assert H100.collective_seconds("all_gather", b, n, False) == pytest.approx(gather, rel=1e-12)
        assert H100.collective_seconds("reduce_scatter", b, n, False) == pytest.approx(gather, rel=1e-12)
        assert H100.collective_seconds("all_to_all", b, n, False) == pytest.approx(gather, rel=1e-12)
        reduce = lat * 2 * (n - 1) + b * 2 * (n - 1) / n / bw
        assert H100.collective_seconds("all_reduce", b, n, False) == pytest.approx(reduce, rel=1e-12)
    inter = H100.links["inter_node"]
    assert H100.collective_seconds("all_gather", b, 16, True) == \
        pytest.approx(inter.latency_s * 15 + b * 15 / 16 / inter.bandwidth, rel=1e-12)
    assert H100.collective_seconds("send_recv", b, 2, True) == pytest.approx(inter.latency_s + b / inter.bandwidth)
    assert H100.collective_seconds("all_reduce", b, 1, False) == 0
    assert collective_terms("all_reduce", 16, "tree") == (2 * 4, 2 * 15 / 16)
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        H100.collective_seconds("broadcast", b, 2, False)


def test_a_measured_collective_table_prices_its_own_group_size_inside_a_node(tmp_path):
    """Between points linear; below the smallest, the smallest; past the largest, the
    link's bandwidth for the rest; other group sizes and other nodes: the ring formula.
    send_recv is a pair's exchange, whatever the group."""
    points = {1000: 1e-4, 3000: 5e-4, 5000: 6e-4}
    table = {op: {"ranks": 2 if op == "send_recv" else 4, "seconds_by_bytes": points}
             for op in ("all_gather", "send_recv")}
    hw = dataclasses.replace(H100, collective_table=table)
    link = hw.links["intra_node"]
    assert hw.collective_seconds("all_gather", 10, 4, False) == 1e-4
    assert hw.collective_seconds("all_gather", 2000, 4, False) == pytest.approx(3e-4, rel=1e-12)
    assert hw.collective_seconds("all_gather", 9000, 4, False) == pytest.approx(6e-4 + 4000 * 3 / 4 / link.bandwidth)
    assert hw.collective_seconds("send_recv", 4000, 8, False) == pytest.approx(5.5e-4, rel=1e-12)
    for args in ((2000, 8, False), (2000, 4, True), (2000, 2, False)):
        assert hw.collective_seconds("all_gather", *args) == H100.collective_seconds("all_gather", *args)
    assert hw.collective_seconds("all_reduce", 2000, 4, False) == H100.collective_seconds("all_reduce", 2000, 4, False)
    hw.dump(tmp_path / "t.yaml")
    assert Hardware.load(tmp_path / "t.yaml") == hw


def test_cp_block_kernels_take_their_own_curve_where_the_hardware_has_one(tmp_path):
    hw = dataclasses.replace(H100, block_attention={"bf16": Curve(100.0, 0.0)})
    assert hw.attention_seconds(1e12, 4096, "bf16", blocks=True) == pytest.approx(0.01, rel=1e-12)
    assert hw.attention_seconds(1e12, 4096, "bf16") == H100.attention_seconds(1e12, 4096, "bf16")
    assert hw.attention_seconds(1e12, 4096, "fp32", blocks=True) == H100.attention_seconds(1e12, 4096, "fp32")
    hw.dump(tmp_path / "b.yaml")
    assert Hardware.load(tmp_path / "b.yaml") == hw


def test_non_decreasing_pools_what_noise_made_fall():
    assert non_decreasing({1: 1.0, 2: 3.0, 3: 2.0, 4: 5.0}) == {1: 1.0, 2: 2.5, 3: 2.5, 4: 5.0}
    assert non_decreasing({1: 4.0, 2: 1.0, 3: 1.0}) == {1: 2.0, 2: 2.0, 3: 2.0}
    assert non_decreasing({1: 1.0, 2: 2.0}) == {1: 1.0, 2: 2.0}


def test_overlap_share_is_one_when_together_take_the_longer_and_zero_when_the_sum():
    """Per repeat (compute, gather, both), each the slowest rank's; the median share."""
    ranks = [[(2.0, 1.0, 2.0), (2.0, 1.0, 3.0), (2.0, 1.0, 2.5)], [(1.0, 1.0, 2.0), (2.0, 1.5, 2.0), (2.0, 1.0, 2.5)]]
    tries = slowest_tries(ranks)
    assert tries == [(2.0, 1.0, 2.0), (2.0, 1.5, 3.0), (2.0, 1.0, 2.5)]
    assert overlap_share(tries) == pytest.approx(0.5)  # the repeats: 1.0, 1/3, 0.5
    assert overlap_share([(1.0, 1.0, 2.5)]) == 0.0 and overlap_share([(1.0, 3.0, 2.0)]) == 1.0


def test_sync_skew_is_the_mean_wait_beyond_both_alone_per_second_of_compute():
    """Per try (segment, collective, both), each the slowest rank's: both less the
    segment and the collective alone, over the segment; the mean over tries (a step adds
    up its waits, tail and all), at least 0."""
    ranks = [[(1.0, 0.2, 1.4), (2.0, 0.2, 2.2), (1.0, 0.1, 2.0)], [(0.8, 0.3, 1.5), (2.5, 0.1, 2.3), (1.0, 0.1, 2.0)]]
    # tries: (1.5 - 1 - 0.3) / 1 = 0.2, (2.3 - 2.5 - 0.2) / 2.5 = -0.16, (2 - 1 - 0.1) / 1 = 0.9
    assert sync_skew(ranks) == pytest.approx((0.2 - 0.16 + 0.9) / 3)
    assert sync_skew([[(1.0, 0.5, 1.2)]]) == 0.0  # together faster than apart: no drift, not a negative one


def test_the_attention_fit_recovers_its_curve_and_never_passes_the_peak():
    seqs = [128, 256, 512, 1024]
    curve = fit_attention([[s, "fp32", 0.1 * s / (s + 256)] for s in seqs], "fp32", peak=1.0)
    assert curve.max_tflops == pytest.approx(0.1) and curve.half == pytest.approx(256)
    # Points far below their ceiling (half 4096 at seq <= 1024): capped at 1.25x the best...
    far = [[s, "fp32", 1.0 * s / (s + 4096)] for s in seqs]
    capped = fit_attention(far, "fp32", peak=10.0)
    assert capped.max_tflops == pytest.approx(1.25 * 1024 / 5120)
    # ...or at the peak, the half sequence the median that explains the points under it
    assert fit_attention(far, "fp32", peak=0.22).max_tflops == 0.22
    for s, _, t in far:
        assert 0.5 < capped.tflops(s) / t < 2


def test_a_short_call_is_timed_in_samples_that_fill_the_minimum():
    """A lone call of ~0.2 ms is at the mercy of the scheduler: each timed sample repeats
    it until it lasts min_sample_s, and the answer is per call."""
    calls = []

    def short():
        calls.append(None)
        end = time.perf_counter() + 2e-4
        while time.perf_counter() < end:
            pass

    per_call = median_seconds(short, torch.device("cpu"), repeats=3, min_sample_s=5e-3)
    per_sample, rest = divmod(len(calls) - 2, 3)  # after two warm-up calls, the last one timed
    assert rest == 0 and 2 <= per_sample <= 25, len(calls)  # 25 unless the timed warm-up was slowed
    assert 2e-4 <= per_call < 6e-4, per_call
    calls.clear()
    median_seconds(short, torch.device("cpu"), repeats=3)
    assert len(calls) == 5  # without a minimum (collectives): one call a sample


def test_collective_times_that_do_not_grow_with_bytes_still_give_a_latency_and_a_bandwidth():
    """Three sizes whose times fall a little with the bytes (gloo's are flat to 256 KiB;
    noise tilts them): the link keeps the fastest time as its latency and a finite
    bandwidth, where it once fitted a latency of 0."""
    flat = {4096: 1.0e-3, 65536: 0.98e-3, 524288: 0.97e-3}
    fit = collective_fits({"all_gather": flat}, 2)["all_gather"]
    steps, share = collective_terms("all_gather", 2)
    assert fit["latency_s"] * steps == pytest.approx(0.97e-3)
    assert math.isfinite(fit["bandwidth"]) and fit["bandwidth"] > 0
    rising = {4096: 1.0e-3, 65536: 1.1e-3, 524288: 2.0e-3}  # a plain line is fitted as before
    fit = collective_fits({"all_gather": rising}, 2)["all_gather"]
    assert 0.9e-3 < fit["latency_s"] * steps < 1.0e-3 and fit["bandwidth"] > 0


def _issued_while_timing_collectives() -> dict[str, int]:
    with CommDebugMode() as comms:
        time_collectives([4096], 1, torch.device("cpu"))
    return {str(op): n for op, n in comms.get_comm_counts().items()}


def test_collectives_are_timed_as_the_runtime_issues_them():
    """The buckets and DTensor issue gathers, reductions and all-reduces as functional
    collectives, which after a barrier on gloo here took 0.4-1.1 ms a call more than
    c10d's own: calibrate times that path, not c10d's."""
    issued = run_ranks(_issued_while_timing_collectives, 2)[0]
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
        assert issued.get(f"c10d_functional.{op}", 0) >= 1, (op, issued)


def test_calibrate_pools_its_passes_point_by_point():
    """Each compute point is the median over the passes; the collectives' and the tiny
    step's repeats are pooled (run/calibrate.py: a slow spell of a shared box spoils one
    pass, not the point)."""
    def one(tflops, copy, gather, step):
        return {"compute": ([[256, 256, 256, "fp32", tflops]], copy),
                "collectives": ({"all_gather": {4096: [gather]}}, [1.0]), "tiny_step_s": [step],
                "sync": [(1.0, gather, step)]}

    got = _pooled([one(0.08, 9.0, 3.0, 0.5), one(0.13, 13.0, 1.0, 0.1), one(0.12, 14.0, 2.0, 0.2)])
    assert got["compute"] == ([[256, 256, 256, "fp32", 0.12]], 13.0)
    assert got["collectives"] == ({"all_gather": {4096: [3.0, 1.0, 2.0]}}, [1.0, 1.0, 1.0])
    assert got["tiny_step_s"] == 0.2
    assert got["sync"] == [(1.0, 3.0, 0.5), (1.0, 1.0, 0.1), (1.0, 2.0, 0.2)]
    assert _pooled([{**one(0.1, 1.0, 1.0, 1.0), "compute": None}])["compute"] is None  # an idle rank


@pytest.mark.parametrize("host_overlap", [False, True])
def test_the_sharded_launch_is_solved_from_the_tiny_steps_time(host_overlap):
    """Whatever the model predicts for the tiny step at a launch cost, solving from that
    time gives the cost back; a step faster than the model without any gives 0."""
    hw = dataclasses.replace(H100, host_overlap=host_overlap, sharded_launch_s=0.0)
    cfg = tiny_config(2)
    for launch in (2e-5, 3e-4):
        step = dry_run(cfg, 2, dataclasses.replace(hw, sharded_launch_s=launch)).time["step_s"]
        solved = sharded_launch_seconds(hw, step, 2)
        again = dry_run(cfg, 2, dataclasses.replace(hw, sharded_launch_s=solved)).time["step_s"]
        assert again == pytest.approx(step, rel=2e-3) and solved == pytest.approx(launch, rel=0.05)
    assert sharded_launch_seconds(hw, 1e-9, 2) == 0.0


def test_matmul_time_grows_with_size_and_never_beats_the_peak():
    for hw in BUILTINS.values():
        for dtype, peak in hw.peak_tflops.items():
            last = 0.0
            for s in (16, 64, 256, 1024, 4096, 16384, 65536):
                seconds = hw.matmul_seconds(s, s, s, dtype)
                assert seconds > last
                assert 2.0 * s**3 / seconds <= peak * 1e12
                last = seconds
            big = 2.0 * 65536**3 / hw.matmul_seconds(65536, 65536, 65536, dtype) / 1e12
            assert big == pytest.approx(hw.matmul[dtype].max_tflops, rel=1e-3)  # saturates at max
    # The curve's fixed cost: f / tflops(f) = f / max + half / max.
    c = H100.matmul["bf16"]
    assert H100.matmul_seconds(4096, 4096, 4096, "bf16") == \
        pytest.approx((2 * 4096**3 + c.half) / (c.max_tflops * 1e12), rel=1e-12)
    with pytest.raises(ValueError, match="a100 has no matmul throughput for 'fp8'"):
        BUILTINS["a100"].matmul_seconds(8, 8, 8, "fp8")


def test_attention_and_memory_seconds():
    c = H100.attention["bf16"]
    assert H100.attention_seconds(1e12, 4096, "bf16") == pytest.approx(1e12 / (c.max_tflops * 1e12 * 4096 /
                                                                              (4096 + c.half)), rel=1e-12)
    assert H100.attention_seconds(1e12, 8192, "bf16") < H100.attention_seconds(1e12, 1024, "bf16")
    assert H100.memory_seconds(3.35e12) == pytest.approx(1.0)


def test_plan_takes_b200_and_a_hardware_file(tmp_path):
    proc = run_cli(*TINY_PLAN, "--gpu", "b200", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "fits on b200 (180 GB)" in proc.stdout
    small = to_dict(H100) | {"name": "small-box", "memory_bytes": 2 * 10**9}
    (tmp_path / "hw.yaml").write_text(yaml.safe_dump(small))
    proc = run_cli(*TINY_PLAN, "--hardware", str(tmp_path / "hw.yaml"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "fits on small-box (2 GB)" in proc.stdout


def test_plan_with_a_bad_hardware_file_exits_2_naming_the_key(tmp_path):
    data = to_dict(H100)
    data["links"]["intra_node"]["bandwidth"] = -5
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    proc = run_cli(*TINY_PLAN, "--hardware", str(tmp_path / "bad.yaml"), timeout=120)
    assert proc.returncode == 2
    assert "links.intra_node.bandwidth=-5" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli(*TINY_PLAN, "--hardware", str(tmp_path / "bad.yaml"), "--gpu", "h100", timeout=120)
    assert proc.returncode == 2 and "give one" in proc.stderr and "Traceback" not in proc.stderr
