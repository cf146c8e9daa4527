"""`meshtrain plan` for pipelined layouts: stages, the per-rank timeline and simulated
bubble, and memory and collectives per pp rank, cross-checked against the schedule IR and
the non-pipelined plan."""

from __future__ import annotations

import json

import pytest

from meshtrain.estimate.dryrun import dry_run
from meshtrain.layout.plan import without_pp
from meshtrain.layout.traffic import Traffic
from meshtrain.pipeline.schedule import SEND_B, SEND_F
from support.cli import ROOT, run_cli
from support.pipeline import PIPE_MICRO, PIPE_ROWS, PIPE_SEQ, pipe_model, pipe_plan, pipelined


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


# A pp rank's collectives besides point-to-point, against real pipelined steps on gloo
# (pp 2 x fsdp 2, a 4-block Llama, 2 micro-batches): id, schedule, virtual, bucket, tied.
# interleaved and gpipe run backwards back to back, where a stage's backward that starts
# with the bucket the rank gathered again last takes it (one stage per block here: every
# such backward); 0.05 MB buckets split the blocks. zb is not among them: its split
# backward gathers saved weights again in both halves on stages after the first, which
# the estimate does not count (per parameter too).
# With activation checkpointing (selective, full): a block's recompute gathers its bucket
# again where the eager backward would (the views of a forward drop their last bucket).
# "kept": parallel.pp_keep_gathered, the weights gathered once per step and reduced once
# (zb included: nothing is gathered again in backward; 0.05 MB buckets span the stages).
PIPE_CASES = [("interleaved-block-tied", "interleaved", 2, "block", True, "none"),
              ("gpipe-0.05MB", "gpipe", 1, 0.05, False, "none"), ("1f1b-param-tied", "1f1b", 1, "param", True, "none"),
              ("1f1b-block-selective", "1f1b", 1, "block", False, "selective"),
              ("1f1b-block-full", "1f1b", 1, "block", False, "full"),
              ("zb-block-kept", "zb", 1, "block", False, "none"),
              ("interleaved-block-tied-kept", "interleaved", 2, "block", True, "none"),
              ("gpipe-0.05MB-kept-full", "gpipe", 1, 0.05, False, "full")]


def _kept(cid: str) -> bool:
    return "-kept" in cid


def _recorded_pipeline_steps():
    """On every rank: per case, one step's collectives by (phase, op, axis)."""
    import torch

    from meshtrain.parallel.init import init_params
    from meshtrain.pipeline.partition import partition
    from meshtrain.pipeline.schedule import build_pipeline_schedule
    from meshtrain.train import pipeline_step
    from meshtrain.train.optim import AdamW
    from meshtrain.train.step import TrainState
    from support.collectives import CollectiveRecorder, axis_names
    from support.comms import totals

    out, groups = {}, {}
    for cid, schedule, virtual, bucket, tied, mode in PIPE_CASES:
        model = pipe_model(tied)
        plan = pipe_plan(model)
        mesh = plan.mesh.build()
        stages = partition(model, 2, virtual, None, seq_len=PIPE_SEQ, micro_batch=PIPE_ROWS // 2)
        names, sub_plan, sub_mesh = pipeline_step.local_stage_layout(plan, mesh, stages)
        params = {n: x.requires_grad_(model.specs[n].trainable)
                  for n, x in init_params(sub_plan, sub_mesh, 0, names=names).items()}
        step = pipeline_step.make_pipeline_step(model, stages, build_pipeline_schedule(schedule, 2, PIPE_MICRO, virtual),
                                                plan, mesh, optimizer=AdamW(lr=3e-4), bucket=bucket,
                                                activation_checkpointing=mode, keep_gathered=_kept(cid))
        # Every case's groups: DTensor may run a stage mesh equal to an earlier case's on
        # that mesh's groups (the same ranks and axes).
        groups.update(axis_names(mesh))
        recorder = CollectiveRecorder(dict(groups))
        t = torch.randint(0, model.cfg.vocab_size, (PIPE_MICRO, PIPE_ROWS, PIPE_SEQ + 1),
                          generator=torch.Generator().manual_seed(0))
        with recorder:
            step(TrainState.create(params), {"tokens": t[..., :-1], "targets": t[..., 1:]})
        out[cid] = totals(recorder.msgs)
    return out


@pytest.mark.slow
def test_pipeline_rank_collectives_equal_recorded_steps():
    """Every collective over the stage mesh (the buckets' or parameters' traffic, the loss
    of each micro-batch on the last stage) of pp ranks 0 and 1, estimated = recorded; the
    point-to-point exchange and the optimizer's scalars are counted apart (first test)."""
    from meshtrain.estimate.pipeline import pipeline_estimate
    from meshtrain.testing import run_ranks
    from support.comms import SHORT, assert_same

    results = run_ranks(_recorded_pipeline_steps, 4)
    for cid, schedule, virtual, bucket, tied, mode in PIPE_CASES:
        model = pipe_model(tied)
        est = pipeline_estimate(pipe_plan(model), model, pp_schedule=schedule, virtual=virtual, layout=None,
                                micro_batch=PIPE_ROWS // 2, seq_len=PIPE_SEQ, micro_steps=PIPE_MICRO,
                                traffic=Traffic(bucket=bucket, keep_gathered=_kept(cid)),
                                activation_checkpointing=mode)
        for rank in (0, 2):  # pp rank 0 (the embedding) and 1 (the head)
            mesh_only = lambda d: {k: v for k, v in d.items() if k[2] == "fsdp"}  # noqa: E731
            assert not [k for k in results[rank][cid] if k[2].startswith("group:")], results[rank][cid]
            rec = mesh_only(results[rank][cid])
            got = mesh_only({(SHORT[e["phase"]], e["op"], e["axis"]): (e["count"], e["bytes"])
                             for e in est.ranks[rank // 2]["collectives"]})
            assert (("bwd", "all_gather", "fsdp") in rec) != _kept(cid), (cid, rank)  # kept: none in backward
            if rank == 2:  # the last stage reduces each micro-batch's loss
                assert rec[("fwd", "all_reduce_sum", "fsdp")] == (PIPE_MICRO, 4 * PIPE_MICRO)
            try:
                assert_same(got, rec)
            except AssertionError as e:
                raise AssertionError(f"{cid}, pp rank {rank // 2}: {e}") from None
