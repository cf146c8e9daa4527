"""bench/moe_step_cpu.py --tiny, in a subprocess: fsdp2 x ep2 compiled (aot_eager) and eager
train the same steps (the bench refuses to time them otherwise) and the JSON has the
figures docs/performance.md quotes. Nothing about speed."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_moe_step_bench_tiny(tmp_path):
    out = tmp_path / "moe_step.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_step_cpu.py"), "--tiny", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["passed"] and data["backend"] == "aot_eager" and data["layout"] == "fsdp2 x ep2 (2 ranks)"
    for key in ("losses", "grad_norms"):
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(data[key]["compiled"], data[key]["eager"],
                                                                     strict=True))
    assert set(data["ms_per_step"]) == {"compiled", "eager"} and all(v > 0 for v in data["ms_per_step"].values())
    assert math.isclose(data["speedup_compiled_over_eager"], data["ms_per_step"]["eager"] / data["ms_per_step"]["compiled"])
    assert "eager / compiled" in proc.stdout
