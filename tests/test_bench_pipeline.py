"""bench/pipeline_cpu.py --tiny: every schedule, and 1F1B and zero-bubble with compiled stages, train the
same model as one process on 2 gloo ranks (the bench refuses to time it otherwise) and
the JSON has the figures the docs quote."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_pipeline_bench_tiny(tmp_path):
    out = tmp_path / "pipeline.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "pipeline_cpu.py"), "--tiny", "--warmup", "1",
                           "--steps", "1", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert [r["schedule"] for r in data["schedules"]] == ["gpipe", "1f1b", "zb", "interleaved"]
    for row in data["schedules"]:
        assert row["step_s"] > 0 and row["predicted_s"] > 0 and row["speedup"] > 0
        assert 0 <= row["predicted_bubble"] < 1
        costs = row["stage_costs_s"]
        assert len(costs) == 2 * row["virtual"] and all(c["F"] > 0 and c["B"] > 0 for c in costs.values())
    assert data["schedules"][2]["stage_costs_s"]["1"]["W"] > 0  # zb ran split backwards
    # 1F1B and zero-bubble with inductor-compiled stages trained the same model (the bench
    # asserts it); their peaks per rank against the eager runs' (measured at --tiny,
    # 2026-11-27: 0.91x for 1F1B; 1.125x for zb, whose eager stages keep the textbook
    # minimum since issue 25 (a norm keeps its input only; before, 0.94x) while the
    # compiled halves keep what the partitioner picks between BI and BW).
    for compiled, bound in (data["compiled"], 1.10), (data["compiled_zb"], 1.15):
        assert compiled["backend"] == "inductor" and compiled["step_s"] > 0 and compiled["speedup_over_eager"] > 0
        assert 0 < compiled["peak_ratio"] <= bound, compiled
