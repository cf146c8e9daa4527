"""Offload (issue 43 item 4): train.activation_checkpointing offload moves what each block
saves for backward to host memory and back (models/offload.py), and train.optimizer_offload
keeps AdamW's moments in host memory and updates there (train/optim.py host_update). On
this CPU box host and device are one memory, so these tests are numerical: both must
equal the run without them bit for bit (the same ops on the same values), in one process
and sharded; the planner's side is measured in tests/test_memory_estimate.py. Also: the
refusal under compile, checkpoints across offload on and off, and `meshtrain plan`."""

from __future__ import annotations

import dataclasses

import json

import pytest
import torch

from meshtrain import TrainState, build, make_train_step
from meshtrain import checkpoint as ckpt
from meshtrain.cli import main
from meshtrain.errors import ConfigError
from meshtrain.models.offload import observe, offloaded
from meshtrain.models.spec import init_slice
from meshtrain.testing import run_ranks

from support.cli import TINY
from support.equivalence import CFG, batches, optimizer_args, train_layouts

STEPS = 4
OPTIONS = {"activations": {"activation_checkpointing": "offload"}, "optimizer": {"optimizer_offload": True},
           "both": {"activation_checkpointing": "offload", "optimizer_offload": True}}


def _adamw(offload: bool):
    """optimizer_args()'s AdamW, its moments in host memory when `offload` (train.optimizer_offload)."""
    return dataclasses.replace(optimizer_args()["optimizer"], offload=offload)


def _step_options(options: dict) -> dict:
    """OPTIONS as make_train_step takes them: optimizer_offload is the AdamW's."""
    options = dict(options)
    return {**optimizer_args(), "optimizer": _adamw(options.pop("optimizer_offload", False)), **options}


def _single(precision="fp32", steps=STEPS, state=None, start=0, **options):
    """(metrics per step, state) of a one-process run from the same weights and batches."""
    model = build("llama", CFG)
    kwargs = _step_options(options)
    if state is None:
        params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
        state = TrainState.create(params, kwargs["optimizer"])
    step = make_train_step(model, precision=precision, **kwargs)
    metrics = [step(state, b) for b in list(batches(micro_steps=2, steps=start + steps))[start:]]
    return metrics, state


def _identical(got, ref, what):
    (m1, s1), (m2, s2) = got, ref
    assert [m["loss"] for m in m1] == [m["loss"] for m in m2], what
    assert [m["grad_norm"] for m in m1] == [m["grad_norm"] for m in m2], what
    for n, p in s2.params.items():
        assert torch.equal(s1.params[n], p), (what, n)
    for k in ("exp_avg", "exp_avg_sq"):
        for n, m in s2.optimizer[k].items():
            assert torch.equal(s1.optimizer[k][n], m), (what, k, n)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("offload", list(OPTIONS))
def test_offload_is_bit_identical_on_one_process(precision, offload):
    _identical(_single(precision, **OPTIONS[offload]), _single(precision), f"{offload} {precision}")


def test_activation_offload_moves_every_block_activation():
    """What the hooks move: the blocks' saved tensors (not the parameters), and each comes
    back in backward (a gradient is made from every one)."""
    with observe() as moved:
        metrics, state = _single(steps=1, activation_checkpointing="offload")
    params = {p.untyped_storage().data_ptr() for p in state.params.values()}
    assert moved and not params & {ptr for ptr, _ in moved}
    # two micro-steps, two blocks: dozens of tensors each
    assert len(moved) > 2 * 2 * 10 and all(n > 0 for _, n in moved)


def test_offload_takes_expanded_and_transposed_tensors():
    """A saved tensor with broadcast (stride 0) dims comes back dense, a transposed one with
    its strides; the gradients equal those without offload."""
    def f(x, w):
        h = (x * 2).expand(3, 4) * w  # mul saves the expanded product
        return (h.t() @ w).sum()  # mm saves the transposed h

    grads = []
    for wrap in (lambda fn, *a: fn(*a), offloaded):
        x = torch.randn(3, 1, generator=torch.Generator().manual_seed(0), requires_grad=True)
        w = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with observe() as moved:
            wrap(f, x, w * 1.0).backward()
        grads.append((x.grad, w.grad, len(moved)))
    assert grads[0][2] == 0 and grads[1][2] >= 3  # the expanded product, w * 1.0, h
    assert all(torch.equal(a, b) for a, b in zip(grads[0][:2], grads[1][:2]))


def test_optimizer_offload_keeps_the_moments_in_host_memory():
    _, state = _single(steps=1, optimizer_offload=True)
    for group in state.optimizer.values():
        for t in group.values():
            assert t.device.type == "cpu"


def sharded_runs():
    """On each rank of 2: fsdp2 and tp2 + sp, without offload and with each kind."""
    names = ["fsdp2", "tp2_sp"]
    out = {"none": train_layouts(2, False, names)}
    for kind, options in OPTIONS.items():
        out[kind] = train_layouts(2, False, names, _step_options(options))
    return out


@pytest.mark.slow
def test_offload_is_bit_identical_sharded():
    results = run_ranks(sharded_runs, 2)
    for rank in results:
        for kind in OPTIONS:
            for name, (_, ref) in rank["none"].items():
                run = rank[kind][name][1]
                assert run.losses == ref.losses and run.norms == ref.norms, (kind, name)
                for n, p in ref.params.items():
                    assert torch.equal(run.params[n], p), (kind, name, n)
                for k, moments in ref.moments.items():
                    for n, m in moments.items():
                        assert torch.equal(run.moments[k][n], m), (kind, name, k, n)
                for n, g in ref.grads[1].items():
                    assert torch.equal(run.grads[1][n], g), (kind, name, n)


def test_activation_offload_refuses_compile():
    with pytest.raises(ConfigError, match="activation_checkpointing=offload cannot be compiled.*train.compile false"):
        make_train_step(build("llama", CFG), compile=True, activation_checkpointing="offload")


@pytest.mark.parametrize("saved_with, loaded_with", [(True, False), (False, True)])
def test_checkpoints_resume_across_optimizer_offload(tmp_path, saved_with, loaded_with):
    """2 steps, a checkpoint, 2 more steps after loading it into a state made with the
    other setting: the same as 4 steps in one go."""
    _, first = _single(steps=2, optimizer_offload=saved_with)
    ckpt.save(tmp_path, 2, first, {}, keep_last=1)
    model = build("llama", CFG)
    params = {n: torch.zeros(s.shape).requires_grad_() for n, s in model.specs.items()}
    state = TrainState.create(params, _adamw(loaded_with))
    ckpt.load(ckpt.latest(tmp_path), state)
    resumed = _single(steps=2, state=state, start=2, optimizer_offload=loaded_with)
    whole = _single(steps=4)
    _identical(resumed, (whole[0][2:], whole[1]), "resumed")


def _plan_json(capsys, path, *flags):
    assert main(["plan", "--config", str(TINY), "--json", str(path), *flags]) == 0
    capsys.readouterr()
    return json.loads(path.read_text())


def test_plan_shows_what_offload_moves(capsys, tmp_path):
    base = _plan_json(capsys, tmp_path / "none.json")
    off = _plan_json(capsys, tmp_path / "offload.json", "--train.activation_checkpointing", "offload",
                     "--train.optimizer_offload", "true")
    was, now = base["per_rank_bytes"], off["per_rank_bytes"]
    detail = off["memory_detail"]
    assert now["optimizer"] == 0 and detail["host_optimizer"] == was["optimizer"] > 0
    assert was["activations"] - now["activations"] == detail["activations_offloaded"] > 0
    assert detail["host_activations"] >= detail["activations_offloaded"] - detail["host_saved_weights"]
    assert now["peak"] < was["peak"]
    assert main(["plan", "--config", str(TINY), "--train.activation_checkpointing", "offload",
                 "--train.optimizer_offload", "true"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "host_optimizer (host memory)" in out and "host_activations (host memory)" in out
    assert "activations offloaded" in out and "optimizer state offloaded" in out


@pytest.mark.parametrize("flags, expected", [
    (["--train.activation_checkpointing", "offload", "--train.compile", "true"],
     "train.activation_checkpointing=offload with train.compile true cannot run"),
    (["--train.optimizer_offload", "maybe"], "train.optimizer_offload"),
])
def test_cli_refuses_offload_that_cannot_run(capsys, flags, expected):
    code = main(["plan", "--config", str(TINY), *flags])
    out = capsys.readouterr()
    assert code == 2 and expected in out.err and "Traceback" not in out.err, out
