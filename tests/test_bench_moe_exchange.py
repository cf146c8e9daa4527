"""bench/moe_exchange_cpu.py --tiny, in a subprocess: the padded fixed-capacity exchange and
meshtrain's uneven one give the same expert-layer output and gradients on 2 gloo ranks
(the bench refuses to time them otherwise), and the JSON has the figures
docs/performance.md quotes. Nothing about speed."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_moe_exchange_bench_tiny(tmp_path):
    out = tmp_path / "moe_exchange.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_exchange_cpu.py"), "--tiny", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["passed"] and data["backend"] == "aot_eager" and data["layout"] == "ep2 (2 ranks)"
    routed = data["shape"]["tokens"] * data["shape"]["top_k"]
    rows = data["rows"]  # padded: every peer gets a block as large as all a rank routes
    assert rows["uneven_sent"] == routed and rows["padded_sent"] == rows["padded_computed"] == 2 * routed
    assert 0 < rows["uneven_computed"] <= 2 * routed
    assert set(data["ms_per_call"]) == {"uneven", "padded"} and all(v > 0 for v in data["ms_per_call"].values())
    assert math.isclose(data["padded_over_uneven"], data["ms_per_call"]["padded"] / data["ms_per_call"]["uneven"])
