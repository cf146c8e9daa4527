"""bench/keep_gathered_cpu.py --tiny in a subprocess: parallel.pp_keep_gathered on pp 2 x
fsdp 2 trains the same model as the sharded pipeline (the bench refuses to report
otherwise), its parameter collectives fall from m per bucket to one (the planner's
counts, checked against recorded steps in test_pipeline_plan), and the planner's peak per
pp rank follows the one measured on the fake process group, both ways."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_kept_pipeline_trains_the_same_model_with_fewer_collectives(tmp_path):
    out = tmp_path / "kept.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "keep_gathered_cpu.py"), "--tiny", "--steps", "2",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(out.read_text())
    m, rows = got["micro_batches"], {(r["mode"], r["pp_rank"]): r for r in got["rows_out"]}
    for pp_rank in (0, 1):
        sharded, kept = rows["sharded", pp_rank], rows["kept", pp_rank]
        buckets = 3  # 2 blocks per stage and the embedding or the head
        assert kept["gathers"] == kept["reduce_scatters"] == buckets
        assert sharded["reduce_scatters"] == m * buckets and sharded["gathers"] > m * buckets  # re-gathers too
        assert kept["param_bytes"] < sharded["param_bytes"] / 2
        for r in (sharded, kept):  # measured 1.02 to 1.12 at this size
            assert 0.95 <= r["planned"] / r["peak_bytes"] <= 1.15, r
