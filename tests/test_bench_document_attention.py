"""bench/document_attention_cpu.py --tiny, in a subprocess: the tiled, the dense and the
compiled windowed document attention agree (the bench refuses to time them otherwise)
and the JSON has the figures docs/performance.md quotes. Nothing about speed."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_document_attention_bench_tiny(tmp_path):
    out = tmp_path / "doc_attention.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "document_attention_cpu.py"), "--tiny", "--compile",
                           "aot_eager", "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["seq"] == 512 and sorted(data["by_doc_len"]) == ["512", "64"]
    for row in data["by_doc_len"].values():
        assert set(row["ms"]) == {"causal", "tiled", "dense", "compiled_causal", "compiled_windowed"}
        assert all(v > 0 for v in row["ms"].values())
        assert row["tiled_over_causal"] == row["ms"]["tiled"] / row["ms"]["causal"]
    # documents of 64 in a row of 512 sit inside the 128-query tiles: a window of 128 keys;
    # one document per row: no boundary, plain causal attention (window 0)
    assert data["by_doc_len"]["64"]["window"] == 128 and data["by_doc_len"]["512"]["window"] == 0
