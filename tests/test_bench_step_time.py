"""bench/step_time_cpu.py --tiny in a subprocess: it calibrates this machine, predicts a
fsdp2 step with `meshtrain plan --hardware`, measures it with `meshtrain fit`, and reports
the ratio with the breakdown that makes the prediction (the within-20% figures of the
full run are docs/performance.md's; a tiny model on a loaded CI box is not judged)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_step_time_bench_predicts_and_measures(tmp_path):
    out = tmp_path / "step_time.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_time_cpu.py"), "--tiny", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(out.read_text())
    (row,) = got["rows"]
    assert row["layout"] == "fsdp2" and row["measured_s"] > 0
    assert row["ratio"] == row["predicted_s"] / row["measured_s"]
    parts = row["breakdown"]
    total = sum(sum(v.values()) if isinstance(v, dict) else v for v in parts.values())
    assert abs(total - row["predicted_s"]) <= 1e-9 * row["predicted_s"]
    assert parts["matmuls"] > 0 and parts["host_overhead"] > 0, parts
    assert "fsdp2" in proc.stdout and "load average" in proc.stdout
