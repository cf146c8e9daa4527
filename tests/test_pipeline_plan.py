"""`meshtrain plan` for pipelined layouts: stages, the per-rank timeline and simulated
bubble, and memory and collectives per pp rank, cross-checked against the schedule IR and
the non-pipelined plan."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshtrain.estimate.dryrun import dry_run
from meshtrain.parallel.plan import without_pp
from meshtrain.pipeline.schedule import SEND_B, SEND_F
from test_cli import ROOT, run_cli
from test_dryrun import preset


def pipelined(name="llama3-70b", world=512, **parallel):
    cfg = preset(name, compile=False, activation_checkpointing="none")  # every schedule, zero-bubble included
    p = dataclasses.replace(cfg.parallel, fsdp=-1, **parallel)
    return dataclasses.replace(cfg, parallel=p).validate(), world


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("gpipe", 1), ("zb", 1), ("interleaved", 2)])
def test_pipeline_section_matches_the_schedule_ir(schedule, virtual):
    cfg, world = pipelined(pp=4, pp_schedule=schedule, pp_virtual=virtual)
    run = dry_run(cfg, world)
    est, d = run.pipeline, run.to_dict()["pipeline"]
    m = est.schedule.m
    assert d["micro_batches"] == m == cfg.train.global_batch // (cfg.train.micro_batch * run.plan.mesh.fsdp)
    layers = [tuple(s["layers"]) for s in d["stages"]]
    assert layers[0][0] == 0 and layers[-1][1] == cfg.model.n_layers and len(layers) == 4 * virtual
    assert all(a[1] == b[0] for a, b in zip(layers, layers[1:]))  # contiguous, every layer once
    # Point-to-point traffic per rank = the IR's sends (and as many recvs) x one activation shard.
    sub = without_pp(run.plan)
    shard = 4 * cfg.train.micro_batch * cfg.train.seq_len * cfg.model.dim // (sub.mesh.tp if cfg.parallel.sp else 1)
    for r, rank in enumerate(est.ranks):
        acts = est.schedule.ranks[r]
        sent = {e["phase"]: e for e in rank["collectives"] if e["axis"] == "pp" and e["op"] == "send"}
        none = {"count": 0, "bytes": 0}
        for phase, kind in (("forward", SEND_F), ("backward", SEND_B)):
            n = sum(a.kind == kind for a in acts)
            assert sent.get(phase, none)["count"] == n
            assert sent.get(phase, none)["bytes"] == n * shard * (1 if cfg.train.precision == "fp32" else 0.5)
        assert sum(sent.get(p, none)["count"] for p in sent) > 0
    # The closed form is the floor; FLOP-proportional stage costs (the head is heavier) add to it.
    # Zero-bubble fills part of 1F1B's bubble with weight gradients: below that floor.
    closed = (4 - 1) / (m + 4 - 1) / virtual
    if schedule == "zb":
        assert 0 < d["bubble"] < closed
    else:
        assert closed - 1e-9 <= d["bubble"] < closed + 0.1
    assert d["timeline"][0].startswith("rank 0: F0.0")


def test_the_ranks_params_add_up_to_the_unpipelined_plan():
    cfg, world = pipelined(pp=4)
    run = dry_run(cfg, world)
    total = sum(r["memory"]["params"] for r in run.pipeline.ranks)
    assert total == without_pp(run.plan).param_bytes_per_rank  # each parameter on exactly one pp rank
    assert run.memory["peak"] == max(r["memory"]["peak"] for r in run.pipeline.ranks)
    assert run.memory["pp_rank"] == 0  # 1F1B keeps pp micro-batches in flight on the first rank


def test_plan_prints_the_timeline_through_the_cli(tmp_path):
    out = tmp_path / "plan.json"
    proc = run_cli("plan", "--config", str(ROOT / "configs" / "tiny.yaml"), "--world", "2", "--parallel.pp", "2",
                   "--parallel.pp_schedule", "zb", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "rank 0: F0.0 F0.1 I0.0 W0.0 F0.2" in proc.stdout and "simulated bubble" in proc.stdout
    d = json.loads(out.read_text())["pipeline"]
    assert d["schedule"] == "zb" and d["pp"] == 2 and d["micro_batches"] == 4
    assert [s["layers"] for s in d["stages"]] == [[0, 2], [2, 4]]
