"""bench/muon_cpu.py --tiny in a subprocess: AdamW, Muon (owner, the default) and Muon
(gather) time their steps in one process and on fsdp 2 x tp 2 + sp, and the ratios come
out finite and consistent with the times."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_muon_bench_tiny(tmp_path):
    out = tmp_path / "muon.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "muon_cpu.py"), "--tiny", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    layouts = json.loads(out.read_text())["layouts"]
    assert list(layouts) == ["one_process", "fsdp2xtp2-sp"]
    for name, r in layouts.items():
        assert all(math.isfinite(v) and v > 0 for v in r.values()), (name, r)
        assert math.isclose(r["ratio"], r["muon_owner"] / r["adamw"]), name
        assert math.isclose(r["owner_ratio"], r["muon_owner"] / r["muon"]), name
        assert name in proc.stdout
