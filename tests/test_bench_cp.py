"""bench/cp_attention.py in --tiny mode on the CPU: it runs, and its numbers are the
schedule's (per-rank times for every rank, a2a only where the heads split)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cp_attention_bench_tiny(tmp_path):
    spec = importlib.util.spec_from_file_location("cp_bench", ROOT / "bench" / "cp_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "cp.json"
    bench.main(["--tiny", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["full_ms"] > 0
    assert {(r["cp"], r["comm"]) for r in result["rows"]} == {
        (2, "allgather"), (2, "ring"), (2, "a2a"), (4, "allgather"), (4, "ring")}  # 2 kv heads: no a2a at cp 4
    for r in result["rows"]:
        assert len(r["rank_ms"]) == r["cp"] and min(r["rank_ms"]) > 0
        assert r["imbalance"] >= 1 and r["overhead"] > 0
        assert r["contiguous_imbalance"] == (2 * r["cp"] - 1) / r["cp"]
