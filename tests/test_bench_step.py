"""bench/step_cpu.py --tiny in a subprocess: our compiled step and the plain nn.Module
reference compute the same steps (the bench refuses to report otherwise) and the JSON has
the ratio. aot_eager keeps it quick (no C++ code generation); it says nothing about speed."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_step_bench_tiny(tmp_path):
    out = tmp_path / "step.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_cpu.py"), "--tiny", "--backend", "aot_eager",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert [r["impl"] for r in data["results"]] == ["ours-compiled", "ours-eager", "ref-eager"]
    assert math.isfinite(data["ratio"]) and data["ratio"] > 0
    assert data["config"]["tiny"] and data["config"]["backend"] == "aot_eager"
