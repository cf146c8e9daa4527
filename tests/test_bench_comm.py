"""bench/comm.py --tiny on the CPU, in a subprocess: every layout's collective bytes per
step against its analytic minimum, and its collective calls per step. No layout may send less than the minimum; every layout
but the ring's sends exactly the minimum; the ring's excess is exactly what its design
explains. dp2 and fsdp2 are also checked here against their closed forms, from the model
figures in the JSON alone: with the default block buckets, and (--bucket param) one
collective per parameter, the baseline the buckets are measured against."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYOUTS = ["dp2", "fsdp2", "tp2", "tp2-sp", "cp2-allgather", "cp2-ring", "hsdp-dp2xfsdp2", "fsdp2xtp2-sp",
           "moe-fsdp2-ep2"]
ABOVE_MINIMUM = {"cp2-ring", "tp2-sp", "fsdp2xtp2-sp"}  # by design: see bench/comm.py's known_excess


def bench(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "comm.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "comm.py"), "--tiny", *args, "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def test_comm_bench_tiny(tmp_path):
    proc, data = bench(tmp_path)
    assert data["model"]["bucket"] == "block"  # make_train_step's default
    rows = {r["name"]: r for r in data["layouts"]}
    assert list(rows) == LAYOUTS
    assert "NOT EXPLAINED" not in proc.stdout and all(name in proc.stdout for name in LAYOUTS)
    for name, r in rows.items():
        assert math.isfinite(r["ratio"]) and r["ratio"] >= 1.0 - 1e-9, (name, r["ratio"])
        assert math.isclose(r["ratio"], r["bytes"] / r["minimum"]), name
        assert r["bytes"] > 0 and r["scalar_count"] >= 1 and 0 < r["scalar_bytes"] <= 8 * r["scalar_count"], name
        assert r["explained"] is True, name
        if name in ABOVE_MINIMUM:
            assert r["ratio"] > 1 and r["bytes"] == r["minimum"] + sum(r["excess_terms"].values()), name
        else:
            assert r["ratio"] == 1.0 and r["bytes"] == r["minimum"] and not r["excess_terms"], (name, r["ratio"])

    # Closed forms, from the JSON's model figures (fp32, world 2, ring convention).
    m = data["model"]
    P, Vd = m["parameters"], m["vocab_size"] * m["dim"]
    assert rows["dp2"]["bytes"] == 2 * (1 / 2) * P * 4  # one all-reduce of the gradients
    assert rows["fsdp2"]["bytes"] == (1 / 2) * (3 * P - Vd) * 4  # gather, gather again but the table, reduce-scatter
    # Calls per step with block buckets: an untied Llama has L + 2 buckets (the table, each
    # block, the final norm with the output table); dp all-reduces each bucket's gradients
    # once, fsdp gathers each in forward, again in backward but the table's, and
    # reduce-scatters each. The scalars: the loss once per step, the grad norm.
    n = m["n_layers"] + 2
    assert rows["dp2"]["collectives"] == n and rows["fsdp2"]["collectives"] == 3 * n - 1
    assert rows["dp2"]["scalar_count"] == rows["fsdp2"]["scalar_count"] == 2
    assert all(f"{r['collectives']:>6} {r['scalar_count']:>6}" in proc.stdout for r in rows.values())
    # Ring vs all-gather, per layer: one more K/V block and one more dK/dV block sent (cp = 2).
    kv_block = 2 * m["batch"] * m["seq"] // 2 * m["n_kv_heads"] * (m["dim"] // m["n_heads"]) * 4
    assert rows["cp2-ring"]["bytes"] - rows["cp2-allgather"]["bytes"] == m["n_layers"] * 2 * kv_block


def test_comm_bench_tiny_per_parameter_baseline(tmp_path):
    """--bucket param: one collective per parameter tensor and use, the baseline of
    docs/performance.md. An untied Llama has 9 L + 3 tensors: dp all-reduces each, fsdp
    gathers each in forward, again in backward but the embedding table, and
    reduce-scatters each. The bytes are the block buckets' (the same minimum)."""
    proc, data = bench(tmp_path, "--bucket", "param", "--layouts", "dp2", "fsdp2")
    assert data["model"]["bucket"] == "param" and "per param (--bucket)" in proc.stdout
    rows = {r["name"]: r for r in data["layouts"]}
    m = data["model"]
    n = 9 * m["n_layers"] + 3
    assert rows["dp2"]["collectives"] == n and rows["fsdp2"]["collectives"] == 3 * n - 1
    P, Vd = m["parameters"], m["vocab_size"] * m["dim"]
    assert rows["dp2"]["bytes"] == 2 * (1 / 2) * P * 4 and rows["fsdp2"]["bytes"] == (1 / 2) * (3 * P - Vd) * 4
    assert all(r["ratio"] == 1.0 for r in rows.values())
