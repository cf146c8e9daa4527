"""bench/step_time_cpu.py --tiny in a subprocess: it calibrates this machine (`meshtrain
calibrate --quick --nproc 2`, whose file is checked here: one calibration serves both),
predicts a fsdp2 step with `meshtrain plan --hardware`, measures it with `meshtrain fit`,
and reports the ratio with the breakdown that makes the prediction (the within-20% figures
of the full run are docs/performance.md's; a tiny model on a loaded CI box is not judged)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.estimate.calibrate import sync_skew
from meshtrain.estimate.hardware import Hardware

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.alone
def test_the_step_time_bench_calibrates_predicts_and_measures(tmp_path):
    out = tmp_path / "step_time.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_time_cpu.py"), "--tiny", "--json", str(out),
                           "--hardware-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_quick_calibration(Hardware.load(tmp_path / "hardware_2.yaml"))
    got = json.loads(out.read_text())
    (row,) = got["rows"]
    assert row["layout"] == "fsdp2" and row["measured_s"] > 0
    assert row["ratio"] == row["predicted_s"] / row["measured_s"]
    parts = row["breakdown"]
    total = sum(sum(v.values()) if isinstance(v, dict) else v for v in parts.values())
    assert abs(total - row["predicted_s"]) <= 1e-9 * row["predicted_s"]
    assert parts["matmuls"] > 0 and parts["host_overhead"] > 0, parts
    assert "fsdp2" in proc.stdout and "load average" in proc.stdout


def _check_quick_calibration(hw: Hardware) -> None:
    assert hw.ranks_per_node == 2 and set(hw.peak_tflops) == {"fp32", "bf16"} == set(hw.attention) == \
        set(hw.block_attention)
    numbers = [hw.memory_bandwidth, *hw.peak_tflops.values(), *(c.max_tflops for c in hw.matmul.values()),
               *(c.max_tflops for c in hw.attention.values()), *(c.max_tflops for c in hw.block_attention.values()),
               hw.links["intra_node"].bandwidth, hw.links["intra_node"].latency_s]
    assert all(math.isfinite(x) and x > 0 for x in numbers), numbers
    assert set(hw.measured["collectives"]) == set(hw.collective_table) == {
        "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv"}
    for op, t in hw.collective_table.items():
        assert t["ranks"] == 2 and len(t["seconds_by_bytes"]) == 3
        times = [t["seconds_by_bytes"][b] for b in sorted(t["seconds_by_bytes"])]
        assert times == sorted(times) and times[0] > 0, (op, times)
    assert 0 <= hw.comm_overlap <= 1 and hw.sharded_launch_s >= 0
    assert hw.measured["host"]["tiny_step_s"] > 0 and len(hw.measured["overlap"]["compute_gather_both_s"]) == 13
    drift = hw.measured["sync"]["compute_sync_both_s"]  # by rank, 2 x 3 + 1 tries of the one quick pass
    assert [len(r) for r in drift] == [7, 7] and hw.sync_skew == pytest.approx(sync_skew(drift), abs=1e-12)
    # The model reproduces its own fit where it was measured: within 2x of each timed point.
    for m, n, k, dtype, tflops in hw.measured["matmul"]:
        assert 0.5 < hw.matmul_seconds(m, n, k, dtype) / (2.0 * m * n * k / (tflops * 1e12)) < 2
