"""bench/moe.py --tiny on the CPU, in a subprocess: a smoke test. It runs (including its own
check that the grouped expert SwiGLU and the reference loop agree), and the JSON has the
keys the docs quote, with finite, positive figures. It says nothing about speed."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

KEYS = ("name", "tokens", "dim", "experts", "top_k", "expert_ffn", "grouped_ms", "loop_ms", "ratio", "moe_ms",
        "dense_ms", "overhead", "grouped_path")


def test_moe_bench_tiny(tmp_path):
    out = tmp_path / "moe.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "moe.py"), "--tiny", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["dtype"] == "float32"
    assert [c["experts"] for c in data["cases"]] == [8, 16]
    for c in data["cases"]:
        assert all(k in c for k in KEYS), sorted(set(KEYS) - set(c))
        for k in ("grouped_ms", "loop_ms", "ratio", "moe_ms", "dense_ms", "overhead"):
            assert math.isfinite(c[k]) and c[k] > 0, (c["name"], k, c[k])
        assert math.isclose(c["ratio"], c["loop_ms"] / c["grouped_ms"])
        assert math.isclose(c["overhead"], c["moe_ms"] / c["dense_ms"])
        assert c["grouped_path"] is True  # fp32, 64 and 128 features: torch._grouped_mm takes it
        assert c["empty_experts"] == 2 and c["load_max_over_mean"] > 1  # the skewed routing
        assert all(len(v) == data["rounds"] for v in c["rounds_ms"].values())
    assert c["name"] in proc.stdout  # the table was printed
