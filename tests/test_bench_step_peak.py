"""bench/step_peak_cpu.py in a subprocess: a whole step's peak memory (gradients,
activations, gathered weights, the buckets' communication buffers, prefetched gathers and
reductions in flight), measured by the allocator on the fake process group, against the
planner's peak less the state that exists before the step, for every layout of the bench.

Eager layouts: planned / measured within [0.95, 1.08] (measured 0.978 to 1.069: the
planner counts every reduction's output in flight at once, and every layer's activations
while one block's gradients are reduced). Compiled: the eager figure is an upper bound
(measured 1.17 at fsdp 2, aot_eager: the compiled graph holds less)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_planned_peak_follows_the_measured_step(tmp_path):
    out = tmp_path / "step_peak.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_peak_cpu.py"), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 10
    for name, r in rows.items():
        low, high = (1.0, 1.25) if "compiled" in name else (0.95, 1.08)
        assert low <= r["ratio"] <= high, (name, r["ratio"], r["measured"], r["planned"])
    # The communication buffers are where the old planner (one layer's weights) fell short.
    assert rows["fsdp2"]["comm_buffers"] > rows["fsdp2 prefetch 0"]["comm_buffers"] > 0
    assert rows["tp2 + sp"]["comm_buffers"] == rows["one process"]["comm_buffers"] == 0
