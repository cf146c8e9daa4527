"""The ranks' drift in the step-time model (comm_time.skew_exposed, Hardware.sync_skew):
a collective issued and waited at once costs sync_skew per second of the compute of its
phase; traffic issued ahead of its wait, and once-a-step reductions, cost none of it. On
hand-made hardware where compute dominates and links are fast, the step with the drift
less the step without is that closed form, in the exposed communication of the axis
waited for."""

from __future__ import annotations

import dataclasses

import pytest

from support.step_time import hand, tiny, timed

SKEW = 0.25
COMPUTE = ("matmuls", "attention", "elementwise", "recompute", "host_overhead")
BASE = hand(mm=0.01, attention=0.01, memory=1e9, intra=(3e-6, 100e9), launch=1e-6)


def _drift(cfg, world: int = 2) -> tuple[dict, dict]:
    """(`timed` with the drift, without it): each checked to add up."""
    with_it, without = (timed(cfg, world, dataclasses.replace(BASE, sync_skew=s)) for s in (SKEW, 0.0))
    return with_it, without


def _compute(t: dict) -> float:
    return sum(t["breakdown"][k] for k in COMPUTE)


@pytest.mark.parametrize("parallel, train, axis", [
    ({"tp": 2, "sp": True}, {}, "tp"),
    ({"tp": 2, "sp": True}, {"activation_checkpointing": "full"}, "tp"),
    ({"cp": 2, "cp_comm": "ring"}, {}, "cp"),
    ({"fsdp": 2, "prefetch": 0}, {}, "fsdp"),
    ({"fsdp": 2, "bucket": "param"}, {}, "fsdp"),
], ids=["tp2-sp", "tp2-sp-full-recompute", "cp2-ring", "fsdp2-prefetch0", "fsdp2-param"])
def test_collectives_waited_as_issued_add_the_drift_of_all_the_compute(parallel, train, axis):
    """Every phase of these steps waits for collectives as it issues them (tp's and cp's
    in every block; fsdp's gathers and reductions without prefetch): the step grows by
    sync_skew x its compute (recomputation included), all of it on the waited axis."""
    cfg = tiny(parallel={**parallel, "nproc_per_node": 2}, train=train)
    drift, base = _drift(cfg)
    assert _compute(drift) == pytest.approx(_compute(base), rel=1e-12) and _compute(base) > 0
    if train.get("activation_checkpointing") == "full":
        assert base["breakdown"]["recompute"] > 0
    assert drift["step_s"] - base["step_s"] == pytest.approx(SKEW * _compute(base), rel=1e-9)
    grew = {a: s - base["breakdown"]["exposed_comm"].get(a, 0.0) for a, s in drift["breakdown"]["exposed_comm"].items()}
    assert grew[axis] == pytest.approx(SKEW * _compute(base), rel=1e-9)


@pytest.mark.parametrize("parallel", [
    {"dp": 2}, {"fsdp": 2}, {"fsdp": 2, "prefetch": 1}, {"fsdp": 2, "prefetch": 0, "zero": 1}], ids=[
    "dp2", "fsdp2", "fsdp2-prefetch1", "fsdp2-prefetch0-zero1"])
def test_traffic_issued_ahead_or_once_a_step_adds_no_drift(parallel):
    """dp's reductions run beside backward and wait at its end; fsdp's with prefetch are
    issued a bucket ahead; kept weights are gathered once; the loss's and the norm's
    all-reduces come once a step: none waits as it is issued inside the blocks."""
    drift, base = _drift(tiny(parallel={**parallel, "nproc_per_node": 2}))
    assert drift["step_s"] == pytest.approx(base["step_s"], rel=1e-12)


def test_a_pipeline_rank_waiting_in_its_blocks_drifts_and_one_that_does_not_does_not():
    """pp's own sends go to the schedule simulator, not the drift; tp inside the stages
    waits in every block, so the stages' F and B grow and the step with them."""
    plain, _ = _drift(tiny("tiny-pp2"))
    no_drift = timed(tiny("tiny-pp2"), 2, BASE)
    assert plain["step_s"] == pytest.approx(no_drift["step_s"], rel=1e-12)
    cfg = tiny("tiny-pp2", parallel={"tp": 2, "sp": True, "nproc_per_node": 4})
    drift, base = _drift(cfg, world=4)
    assert drift["step_s"] > base["step_s"] * (1 + SKEW / 2)
    assert drift["breakdown"]["exposed_comm"]["tp"] > base["breakdown"]["exposed_comm"]["tp"]
