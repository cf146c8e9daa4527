"""fp16 compute with fp32 master weights and dynamic loss scaling (train.precision fp16,
train.loss_scale): the GEMMs run in fp16 and the curve tracks fp32 within bf16's
tolerance; a step whose gradients overflow on one rank is skipped by every rank with the
parameters and moments bit-identical and the scale backed off; the scale grows after its
interval and a resumed run keeps it. The pipelined step's fp16 is in
tests/test_pipeline_exec.py (against one fp16 process).
"""

from __future__ import annotations

import json

import pytest
import torch

from meshtrain import AdamW, LRSchedule, MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step
from meshtrain.cli import main
from meshtrain.config import RunConfig
from meshtrain.errors import ConfigError
from meshtrain.models.spec import init_slice
from meshtrain.run.guards import LossGuard
from meshtrain.testing import run_ranks
from meshtrain.train.loss_scale import LossScaleConfig, ScaleState

from support.cli import SMALL, TINY
from support.equivalence import CFG
from support.precision import BF16_RTOL, ComputeDtypes, counting_batches

STEPS, LR = 30, 3e-3


def _optimizer():
    return dict(optimizer=AdamW(lr=LR, weight_decay=0.1),
                lr_schedule=LRSchedule(lr=LR, min_lr=LR / 10, warmup_steps=2, total_steps=STEPS), grad_clip=1.0)


def _one_process(precision: str, compile=False):
    """(losses, gradient norms, metrics of the last step, the first step's GEMM dtypes)."""
    torch.manual_seed(0)
    model = build("llama", CFG)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    step = make_train_step(model, precision=precision, compile=compile, **_optimizer())
    state = TrainState.create(params)
    recorder, rows = ComputeDtypes(), []
    for i, b in enumerate(counting_batches(steps=STEPS)):
        if i == 0 and not compile:  # dynamo refuses to trace under a dispatch mode
            with recorder:
                rows.append(step(state, b))
        else:
            rows.append(step(state, b))
    losses = torch.tensor([r["loss"] for r in rows])
    norms = torch.tensor([r["grad_norm"] for r in rows])
    return losses, norms, rows[-1], {k for k in recorder.ops if k[0] == "mm"}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_30_fp16_steps_track_fp32_within_bf16_tolerance():
    fp32, fp32_norms, _, _ = _one_process("fp32")
    fp16, fp16_norms, last, gemms = _one_process("fp16")
    assert gemms == {("mm", ("float16", "float16"))}, gemms  # every GEMM ran in fp16
    assert fp32[0] - fp32[-1] > 1.0, fp32  # the curve learns: far beyond the tolerance
    torch.testing.assert_close(fp16, fp32, rtol=BF16_RTOL, atol=0)
    assert not torch.equal(fp16, fp32)  # a run that silently stayed fp32 would be equal
    # The norm is of the unscaled gradients (2^16 times smaller than what backward made).
    torch.testing.assert_close(fp16_norms, fp32_norms, rtol=10 * BF16_RTOL, atol=0)
    assert last["loss_scale"] == 2.0**16 and last["overflow"] is False and last["skipped"] is False
    # Compiled, the same fp16 step (the scale stays outside the graphs).
    compiled, compiled_norms, _, _ = _one_process("fp16", compile="aot_eager")
    torch.testing.assert_close(compiled, fp16, rtol=1e-5, atol=0)
    torch.testing.assert_close(compiled_norms, fp16_norms, rtol=1e-5, atol=0)


def _overflowed(g: torch.Tensor) -> torch.Tensor:
    """g overflowed to inf: element-wise, so a sharded g stays local. (g * inf, as this once
    was, is NaN wherever g is 0: the norm came out inf on one CPU, NaN on another.)"""
    return g + float("inf")


def _overflow_on_one_rank():
    """fsdp 2, fp16, scale 1024 growing every 2 finite steps: step 2's gradients made inf
    on rank 1 only. Returns every step's metrics and whether step 2 left the parameters
    and both moments bit-identical on this rank."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    model = build("llama", CFG)
    plan = make_plan(model.specs, Rules.default(), MeshSpec(fsdp=2), world=2)
    mesh = plan.mesh.build()
    params = init_params(plan, mesh, seed=0)
    step = make_train_step(model, plan, mesh, precision="fp16", **_optimizer(),
                           loss_scale=LossScaleConfig(init_scale=1024.0, growth_interval=2))
    state = TrainState.create(params)
    rows, unchanged = [], None
    for i, b in enumerate(counting_batches(steps=5)):
        if i == 1:
            before = {k: {n: t.to_local().clone() for n, t in g.items()}
                      for k, g in [("params", state.params), *state.optimizer.items()]}
            if dist.get_rank() == 1:
                handle = []
                handle.append(params["layers.1.mlp.w_down"].register_hook(lambda g: (handle.pop().remove(),
                                                                                   _overflowed(g))[1]))
        rows.append(step(state, b))
        if i == 1:
            after = {k: {n: t.to_local() for n, t in g.items()}
                     for k, g in [("params", state.params), *state.optimizer.items()]}
            unchanged = all(torch.equal(before[k][n], after[k][n]) for k in before for n in before[k])
    return rows, unchanged


@pytest.mark.slow
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank_and_backs_off():
    for rows, unchanged in run_ranks(_overflow_on_one_rank, 2):
        assert [r["skipped"] for r in rows] == [False, True, False, False, False]
        assert [r["overflow"] for r in rows] == [False, True, False, False, False]
        assert rows[1]["grad_norm"] == float("inf") and rows[1]["loss"] == rows[1]["loss"]  # the loss is finite
        assert unchanged, "the skipped step changed a parameter or a moment"
        # 1024; halved by the overflow; two finite steps (3, 4) grow it back at step 4.
        assert [r["loss_scale"] for r in rows] == [1024.0, 512.0, 512.0, 1024.0, 1024.0]


def test_the_scale_rule_is_gradscalers_with_megatrons_floor():
    cfg = LossScaleConfig(init_scale=4.0, growth_interval=2, min_scale=1.0)
    s = ScaleState.start(cfg)
    trace = []
    for finite_loss, finite_grads in [(True, True), (True, False), (True, True), (True, True), (True, False),
                                      (True, False), (True, False), (False, False)]:
        s.update(cfg, finite_loss, finite_grads)
        trace.append((s.scale, s.growth_tracker, s.overflow))
    assert trace == [(4.0, 1, False), (2.0, 0, True), (2.0, 1, False), (4.0, 0, False), (2.0, 0, True),
                     (1.0, 0, True), (1.0, 0, False),  # at the floor: not the scale's business
                     (1.0, 0, False)]  # a non-finite loss: the scale is not the cause
    assert ScaleState.from_dict(s.to_dict()) == s


def test_the_guard_leaves_an_overflow_to_the_scale_and_rules_the_rest():
    t = RunConfig.from_dict({"train": {"precision": "fp16"}}).train
    guard = LossGuard(t)
    note = guard.check(3, {"loss": 2.0, "grad_norm": float("inf"), "skipped": True, "overflow": True,
                           "loss_scale": 512.0})
    assert "step 3 skipped" in note and "overflowed" in note and "512" in note and guard.skipped == 0
    with pytest.raises(Exception, match="train.nonfinite=abort"):  # an overflow at the floor
        guard.check(4, {"loss": 2.0, "grad_norm": float("inf"), "skipped": True, "overflow": False,
                        "loss_scale": 1.0})


@pytest.mark.parametrize("bad, message", [
    ({"backoff_factor": 1.5}, "train.loss_scale.backoff_factor=1.5"),
    ({"growth_factor": 0.5}, "train.loss_scale.growth_factor=0.5"),
    ({"growth_interval": 0}, "train.loss_scale.growth_interval=0"),
    ({"init_scale": -1}, "train.loss_scale.init_scale=-1"),
    ({"min_scale": 4096.0, "init_scale": 1024.0}, "train.loss_scale.min_scale=4096.0"),
    ({"initial": 3}, "unknown config key train.loss_scale.initial"),
])
def test_bad_loss_scale_keys_name_the_key(bad, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        RunConfig.from_dict({"train": {"precision": "fp16", "loss_scale": bad}}).validate()


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_fit_logs_the_scale_backs_off_grows_and_resumes_with_it(tmp_path, monkeypatch, capsys):
    """Through `meshtrain fit`: a NaN gradient at step 2 (MESHTRAIN_FAULT) halves the scale
    and the run goes on (train.nonfinite abort is not triggered); the checkpoint of step 4
    keeps the scale and its growth tracker, so the resumed run grows it at step 5, after
    the third finite step in a row (3, 4, 5)."""
    args = ["fit", "--config", str(TINY), *SMALL, "--train.log_every", "1", "--train.precision", "fp16",
            "--train.steps", "6", "--checkpoint.every", "2", "--train.loss_scale.init_scale", "1024",
            "--train.loss_scale.growth_interval", "3", "--run_dir", str(tmp_path)]
    monkeypatch.setenv("MESHTRAIN_FAULT", "nan@2")
    assert main([*args, "--train.stop_at", "4"]) == 0, capsys.readouterr().err
    assert "step 2 skipped: the gradients overflowed in fp16; the loss scale backs off to 512" in capsys.readouterr().out
    monkeypatch.delenv("MESHTRAIN_FAULT")
    meta = json.loads((tmp_path / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert meta["loss_scale"] == {"scale": 512.0, "growth_tracker": 2}
    assert main(args) == 0, capsys.readouterr().err
    assert [r["loss_scale"] for r in _records(tmp_path)] == [1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]
