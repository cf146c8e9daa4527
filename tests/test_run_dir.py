"""What a run directory holds across invocations of the same command: the end of a run
always saves (train.steps or train.stop_at), a rerun of a finished run does nothing, a
resume with a changed config names each change, and configs/ keeps every start's config.
"""

from __future__ import annotations

import json

import pytest
import yaml

from meshtrain.cli import main
from test_cli import SMALL, TINY


def _fit(capsys, run_dir, *extra: str) -> tuple[int, str]:
    code = main(["fit", "--config", str(TINY), *SMALL, "--train.steps", "4", "--run_dir", str(run_dir), *extra])
    out = capsys.readouterr()
    return code, out.out + out.err


def _files(run_dir) -> dict:
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run_dir.rglob("*") if p.is_file()}


def test_stop_at_saves_a_rerun_of_a_finished_run_does_nothing_and_changes_are_named(tmp_path, capsys, one_thread):
    run_dir = tmp_path / "run"
    code, out = _fit(capsys, run_dir, "--train.stop_at", "2", "--checkpoint.every", "0")
    assert code == 0 and "checkpoint " in out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]

    code, out = _fit(capsys, run_dir, "--checkpoint.every", "0")  # the same run, to its end
    assert code == 0 and "resumed from" in out and "config changed" not in out  # stop_at is not the run
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]

    before = _files(run_dir)
    code, out = _fit(capsys, run_dir, "--checkpoint.every", "0")
    assert code == 0
    assert out.strip().splitlines() == [
        f"nothing to do: {run_dir}/checkpoints/step_00000004 is at step 4 and train.steps=4; raise train.steps "
        "to train further, or start over with --checkpoint.resume none or another run_dir"]
    assert _files(run_dir) == before  # not a byte rewritten

    code, out = _fit(capsys, run_dir, "--checkpoint.every", "0", "--train.steps", "6", "--train.lr", "1e-3")
    assert code == 0
    changed = [line for line in out.splitlines() if line.startswith("config changed")]
    assert changed == ["config changed since step_00000004: train.steps 4 -> 6; train.lr 0.0003 -> 0.001"]
    history = sorted((run_dir / "configs").iterdir())
    assert [p.name for p in history] == ["step_00000000.yaml", "step_00000002.yaml", "step_00000004.yaml"]
    steps = [yaml.safe_load(p.read_text())["train"]["steps"] for p in history]
    assert steps == [4, 4, 6]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["lr"] == 1e-3


def test_a_run_shorter_than_its_warmup_is_a_smoke_test_that_runs(tmp_path, capsys, one_thread):
    """`--train.steps 2` with warmup_steps 10 (what people try first): the run ends inside
    its linear warmup."""
    code, out = _fit(capsys, tmp_path / "run", "--train.steps", "2", "--train.warmup_steps", "10")
    assert code == 0, out
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([3e-4 * 1 / 10, 3e-4 * 2 / 10], rel=1e-12)
