"""bench/step_dist_cpu.py --tiny on gloo CPU ranks, in a subprocess: bucket param, block and
block without prefetch train the same steps on both layouts (the bench refuses to time
them otherwise, and refuses when one variant is made to differ), the JSON has the figures
the docs quote, and the calls per step follow the closed forms. Nothing about speed."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "step_dist_cpu.py"
VARIANTS = ["param", "block", "block-prefetch0"]
VARIANT_KEYS = {"bucket", "prefetch", "ms_per_step_median", "ms_per_step_min", "ms_per_step_max",
                "ms_per_step_rounds", "collectives", "scalar_collectives", "by_kind"}


def _run(*args, timeout=240):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(BENCH), "--tiny", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_step_dist_bench_tiny(tmp_path):
    out = tmp_path / "step_dist.json"
    proc = _run("--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["env"]["torch"] and data["env"]["cores"] >= 1 and data["env"]["process_group"] == "gloo"
    assert set(data["loadavg_1min"]) == {"before", "after"}
    cfg = data["config"]
    assert cfg["tiny"] and cfg["precision"] == "fp32"
    assert [r["layout"] for r in data["layouts"]] == ["fsdp2xtp2-sp", "fsdp2"]
    L = cfg["layers"]
    for row in data["layouts"]:
        assert row["world"] == {"fsdp2xtp2-sp": 4, "fsdp2": 2}[row["layout"]]
        assert set(row["loadavg_1min"]) == {"before", "after"}
        check = row["check"]
        assert check["passed"] and check["rtol"] == 1e-5
        assert list(check["losses"]) == VARIANTS
        ref = check["losses"]["param"]
        assert len(ref) == cfg["warmup"]
        for name in VARIANTS:
            assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(check["losses"][name], ref, strict=True))
            assert check["loss_max_rel_diff"][name] <= 1e-5
        assert list(row["variants"]) == VARIANTS
        for name, v in row["variants"].items():
            assert VARIANT_KEYS <= set(v), (name, VARIANT_KEYS - set(v))
            assert len(v["ms_per_step_rounds"]) == cfg["rounds"]
            assert 0 < v["ms_per_step_min"] <= v["ms_per_step_median"] <= v["ms_per_step_max"]
        for key in ("block/param", "prefetch1/prefetch0"):
            assert math.isfinite(row["ratios"][key]["of_medians"]) and row["ratios"][key]["of_medians"] > 0
            assert math.isfinite(row["ratios"][key]["paired"]) and row["ratios"][key]["paired"] > 0
        v = row["variants"]
        assert row["small_all_gather_us"] > 0
        assert row["saved_calls"] == v["param"]["collectives"] - v["block"]["collectives"] > 0
        assert math.isclose(row["saved_calls_ms_at_small_latency"],
                            row["saved_calls"] * row["small_all_gather_us"] / 1e3)
        assert v["block"]["collectives"] == v["block-prefetch0"]["collectives"] < v["param"]["collectives"]
        assert v["block"]["bucket"] == "block" and v["block"]["prefetch"] == 1 and v["block-prefetch0"]["prefetch"] == 0
    # fsdp2, untied Llama: 9 L + 3 tensors; per parameter: a gather in forward, one in
    # backward but the embedding table, a reduce-scatter (test_bench_comm.py's closed form).
    # Per block: L + 2 buckets (embedding, blocks, final norm + head), the same pattern.
    fsdp2 = data["layouts"][1]["variants"]
    assert fsdp2["param"]["collectives"] == 3 * (9 * L + 3) - 1
    assert fsdp2["block"]["collectives"] == 3 * (L + 2) - 1
    assert "block/param" in proc.stdout


def test_step_dist_bench_refuses_unequal_losses(tmp_path):
    """One variant trained with 10x the learning rate: its second warm-up loss differs
    (rel ~1e-4 on the tiny model), so the bench must stop before timing, exit 1 and write
    no JSON."""
    out = tmp_path / "step_dist.json"
    proc = _run("--layouts", "fsdp2", "--skew", "block", "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "REFUSING TO REPORT" in proc.stderr and "block" in proc.stderr
    assert "round 1/" not in proc.stdout  # nothing was timed
    assert not out.exists()
