"""Muon's state in checkpoints: its momentum saved beside AdamW's moments of the other
parameters; a stopped run resumed equals the uninterrupted one bit for bit (one process)
and within rtol 1e-5 in another layout (fsdp 2 x tp 2 + sp, self-launched ranks); a
checkpoint of the other train.optimizer is refused with the fix."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from meshtrain import checkpoint
from meshtrain.checkpoint import CheckpointError
from meshtrain.run.fit import fit
from meshtrain.train.config import MuonConfig
from meshtrain.train.muon import optimizer_of
from meshtrain.train.step import TrainState
from support.cli import ROOT, SMALL, losses, read_metrics, run_cli
from support.configs import small_cfg


def _muon_cfg(tmp_path, name: str, **train):
    cfg = small_cfg(tmp_path, steps=6, warmup_steps=2, optimizer="muon",
                    muon=MuonConfig(lr=6e-4, adjust_lr="match_rms_adamw"), **train)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, every=3)
    return dataclasses.replace(cfg, run_dir=str(tmp_path / name))


def _final_state(cfg) -> TrainState:
    path = checkpoint.latest(Path(cfg.run_dir) / "checkpoints")
    state = TrainState.create({n: torch.empty(s.shape) for n, s in cfg.model_def().specs.items()},
                              optimizer_of(cfg.train))
    checkpoint.load(path, state)
    return state


def test_stop_and_resume_with_muon_is_bitwise(tmp_path, one_thread):
    whole, pieces = _muon_cfg(tmp_path, "whole"), _muon_cfg(tmp_path, "pieces")
    fit(whole)
    assert [r["step"] for r in fit(dataclasses.replace(pieces, train=dataclasses.replace(pieces.train, stop_at=3)))] \
        == [1, 2, 3]
    assert [r["step"] for r in fit(pieces)] == [4, 5, 6]
    assert losses(Path(pieces.run_dir)).tolist() == losses(Path(whole.run_dir)).tolist()
    a, b = _final_state(whole), _final_state(pieces)
    assert set(a.optimizer) == {"exp_avg", "exp_avg_sq", "momentum"}
    assert "layers.0.attn.wq" in a.optimizer["momentum"] and "layers.0.attn.wq" not in a.optimizer["exp_avg"]
    assert "tok_emb" in a.optimizer["exp_avg"] and "tok_emb" not in a.optimizer["momentum"]
    for k, group in a.optimizer.items():
        for n, t in group.items():
            assert t.abs().max() > 0 and torch.equal(t, b.optimizer[k][n]), (k, n)
    for n, p in a.params.items():
        assert torch.equal(p, b.params[n]), n


def test_a_checkpoint_of_the_other_optimizer_is_refused(tmp_path, one_thread):
    adamw = small_cfg(tmp_path, steps=2, warmup_steps=1)
    adamw.checkpoint = dataclasses.replace(adamw.checkpoint, every=2)
    fit(adamw)
    muon = dataclasses.replace(adamw, train=dataclasses.replace(adamw.train, steps=4, optimizer="muon"))
    with pytest.raises(CheckpointError, match=r"holds the state of train.optimizer=adamw \(exp_avg, exp_avg_sq\), "
                                              r"but this run needs train.optimizer=muon .*resume it with the "
                                              "train.optimizer it was saved with"):
        fit(muon)
    # and back: Muon's checkpoint for an AdamW run
    muon = _muon_cfg(tmp_path, "muon", stop_at=3)
    fit(muon)
    back = dataclasses.replace(muon, train=dataclasses.replace(muon.train, optimizer="adamw", stop_at=0))
    with pytest.raises(CheckpointError, match=r"holds the state of train.optimizer=muon"):
        fit(back)


STEPS4 = ["--train.steps", "4", "--model.n_kv_heads", "4", "--model.n_layers", "2", "--train.optimizer", "muon",
          "--train.muon.adjust_lr", "match_rms_adamw"]


@pytest.mark.slow
def test_resume_in_another_layout_continues_the_same_run(tmp_path):
    """Muon stopped after step 2 in one process, resumed on fsdp 2 x tp 2 + sp (4
    self-launched ranks): steps 3 and 4 as one process's own."""
    one, four = tmp_path / "one", tmp_path / "four"
    common = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), *SMALL, *STEPS4, "--checkpoint.every", "2"]
    proc = run_cli(*common, "--run_dir", str(one))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shutil.copytree(one / "checkpoints" / "step_00000002", four / "checkpoints" / "step_00000002")
    proc = run_cli("fit", "--config", str(ROOT / "configs" / "tiny-4proc.yaml"), *SMALL, *STEPS4,
                   "--run_dir", str(four), timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout and [r["step"] for r in read_metrics(four)] == [3, 4]
    continued = torch.tensor([r["loss"] for r in read_metrics(one)[2:]], dtype=torch.float64)
    torch.testing.assert_close(losses(four), continued, rtol=1e-5, atol=0)
