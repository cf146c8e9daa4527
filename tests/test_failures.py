"""A run that goes wrong ends clearly: non-finite losses (skip or abort), a stalled rank
(the watchdog names it), a rank that raises or is killed (its error first, promptly).

Faults are injected with MESHTRAIN_FAULT (meshtrain/run/faults.py); multi-rank cases
run the real CLI on 2 self-launched gloo ranks.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from meshtrain.cli import main
from meshtrain import checkpoint
from meshtrain.run.guards import LossGuard
from meshtrain.run.watchdog import Watchdog
from support.cli import SMALL, TINY, run_cli

ONE = ["fit", "--config", str(TINY), *SMALL, "--train.log_every", "1"]
TWO = [*ONE, "--parallel.nproc_per_node", "2"]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _state(path):
    import dataclasses

    from meshtrain.config import RunConfig
    from meshtrain.models.spec import init_slice
    from meshtrain.train.step import TrainState

    cfg = RunConfig.from_dict(json.loads((path / "meta.json").read_text())["extra"]["config"])
    model = cfg.model_def()
    state = TrainState.create({n: init_slice(s, n, 1) for n, s in model.specs.items()})
    checkpoint.load(path, state, model.specs)
    return dataclasses.asdict(state)


# --- non-finite losses -------------------------------------------------------------------


def test_skip_leaves_weights_and_optimizer_unchanged_and_counts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MESHTRAIN_FAULT", "nan@2,nan@3")
    code = main([*ONE, "--train.steps", "4", "--train.nonfinite", "skip", "--train.max_skipped", "2",
                 "--checkpoint.every", "1", "--checkpoint.keep_last", "4", "--run_dir", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "step 2 skipped" in out.out and "step 3 skipped" in out.out and "(2 in a row" in out.out
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r.get("skipped_steps", 0) for r in records] == [0, 1, 2, 2]
    assert [r["grad_norm"] != r["grad_norm"] for r in records] == [False, True, True, False]  # NaN
    # The skipped steps changed no parameter and no Adam moment; step 4 did.
    root = tmp_path / "checkpoints"
    one, two, three, four = (_state(checkpoint.step_dir(root, s)) for s in (1, 2, 3, 4))
    for group in ("params", "optimizer"):
        for a, b in ((one, two), (one, three)):
            torch.testing.assert_close(a[group], b[group], rtol=0, atol=0)
    assert not torch.equal(one["params"]["output"], four["params"]["output"])


def test_more_than_max_skipped_in_a_row_stops_naming_the_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MESHTRAIN_FAULT", "nan@1,nan@2,nan@3")
    code = main([*ONE, "--train.nonfinite", "skip", "--train.max_skipped", "2", "--run_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1
    assert "at step 3" in err and "3 steps in a row" in err and "train.max_skipped=2" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_real_divergence_is_caught_without_injected_faults(tmp_path, capsys):
    """lr 1e4: the gradients turn NaN after a step or two and stay so (a skipped step
    changes nothing); skip tolerates 2 in a row, then stops naming the third."""
    import re

    code = main([*ONE, "--train.steps", "8", "--train.warmup_steps", "0", "--train.lr", "1e4", "--train.min_lr", "0",
                 "--train.nonfinite", "skip", "--train.max_skipped", "2", "--run_dir", str(tmp_path)])
    out = capsys.readouterr()
    found = re.search(r"gradient norm nan at step (\d+): 3 steps in a row were not finite", out.err)
    assert code == 1 and found, out.err
    step = int(found.group(1))
    assert f"step {step - 2} skipped" in out.out and f"step {step - 1} skipped" in out.out


def test_abort_stops_at_the_first_non_finite_step_and_keeps_the_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MESHTRAIN_FAULT", "nan@2")
    code = main([*ONE, "--checkpoint.every", "1", "--run_dir", str(tmp_path)])  # nonfinite: abort (default)
    err = capsys.readouterr().err
    assert code == 1 and "at step 2 (train.nonfinite=abort)" in err and "Traceback" not in err
    # An fp32 run is not told to use fp32.
    assert "Lower train.lr" in err and "train.warmup_steps" in err and "train.grad_clip" in err, err
    assert "check the data" in err and "precision" not in err, err
    root = tmp_path / "checkpoints"
    assert checkpoint.latest(root) == checkpoint.step_dir(root, 1)  # nothing of step 2 was saved
    assert all(torch.isfinite(t).all() for t in _state(checkpoint.latest(root))["params"].values())


def test_loss_spikes_are_reported_and_skips_counted():
    from types import SimpleNamespace

    guard = LossGuard(SimpleNamespace(nonfinite="skip", max_skipped=1, spike_factor=1.5, precision="fp32", lr=3e-4,
                                      warmup_steps=10, grad_clip=1.0))
    notes = [guard.check(s, {"loss": loss, "grad_norm": 1.0}) for s, loss in enumerate([4, 4, 4, 4, 4, 5.9], 1)]
    assert notes[:-1] == [None] * 5 and notes[-1] is None  # 5.9 < 1.5 x 4
    note = guard.check(7, {"loss": 6.5, "grad_norm": 1.0})  # 6.5 > 1.5 x mean(4, 4, 4, 4, 4, 5.9)
    assert note == ("loss spike at step 7: 6.5000 is 1.51 x the mean 4.3167 of the previous 6 steps "
                    "(train.spike_factor=1.5)")
    assert guard.check(8, {"loss": float("nan"), "grad_norm": 1.0, "skipped": True}).startswith("step 8 skipped")
    assert guard.check(9, {"loss": 4.0, "grad_norm": 1.0}) is None  # a finite step resets the count
    guard.check(10, {"loss": float("inf"), "grad_norm": 1.0, "skipped": True})
    with pytest.raises(Exception, match="2 steps in a row"):
        guard.check(11, {"loss": float("nan"), "grad_norm": float("nan"), "skipped": True})


@pytest.mark.parametrize("precision, fp32_advised", [("fp32", False), ("bf16", True), ("fp8", True)])
def test_non_finite_advice_depends_on_the_precision(precision, fp32_advised):
    """fp32 is advised only to a run that does not compute in fp32 (the fp32 case through
    the CLI: test_abort_stops_at_the_first_non_finite_step_and_keeps_the_checkpoint)."""
    from types import SimpleNamespace

    from meshtrain.errors import TrainingError

    guard = LossGuard(SimpleNamespace(nonfinite="abort", max_skipped=1, spike_factor=0, precision=precision, lr=3e-4,
                                      warmup_steps=10, grad_clip=1.0))
    with pytest.raises(TrainingError) as e:
        guard.check(5, {"loss": float("nan"), "grad_norm": float("nan"), "skipped": True})
    message = str(e.value)
    assert "Lower train.lr (now 0.0003)" in message and "train.warmup_steps (now 10)" in message
    assert ("train.precision fp32" in message) == fp32_advised, message
    assert f"computes in {precision}" in message if fp32_advised else "precision" not in message


# --- the watchdog --------------------------------------------------------------------------


def _state_of(rank, seq, step, op, since, beat):
    return {"rank": rank, "seq": seq, "step": step, "op": op, "since": since, "beat": beat}


@pytest.fixture
def dog():
    watchdog = Watchdog(0, 4, timeout_s=100.0)
    yield watchdog
    watchdog.stop()


def test_watchdog_names_the_rank_behind(dog):
    now = 1000.0
    states = [_state_of(r, 8, 3, "forward, backward and optimizer update", 900.0, now) for r in (0, 1, 3)]
    states.insert(2, _state_of(2, 7, 3, "reading the batch", 890.0, now))
    message, stalled = dog.diagnose(states, now)
    assert stalled == [2]
    assert message.startswith("watchdog: rank 2 stalled at step 3 in 'reading the batch', no progress for 110 s")
    assert "ranks 0, 1, 3 wait at step 3 in 'forward, backward and optimizer update'" in message


def test_watchdog_names_a_frozen_rank_before_one_merely_behind(dog):
    now = 1000.0
    states = [_state_of(r, 8, 3, "checkpoint save", 900.0, now) for r in range(4)]
    states[1] = _state_of(1, 8, 3, "checkpoint save", 900.0, now - 60)  # no heartbeat for a minute
    message, stalled = dog.diagnose(states, now)
    assert stalled == [1] and "rank 1 stopped responding (no heartbeat) at step 3 in 'checkpoint save'" in message


def test_watchdog_with_every_rank_in_one_operation_blames_the_collective(dog):
    now = 1000.0
    message, stalled = dog.diagnose([_state_of(r, 8, 5, "evaluation", 880.0, now) for r in range(4)], now)
    assert stalled == [0, 1, 2, 3] and "every rank is in the same operation" in message


def test_watchdog_fires_in_a_real_run(tmp_path):
    """Rank 1 hangs reading the batch of step 3 (after a NaN step 2 on rank 1 alone, which
    both ranks skip: the norm is global). The watchdog names rank 1, where it is stuck and
    what rank 0 waits in, and the job ends with exit 1 within seconds of the timeout."""
    proc = run_cli(*TWO, "--train.steps", "4", "--train.nonfinite", "skip", "--parallel.watchdog_s", "6",
                   "--run_dir", str(tmp_path), env={"MESHTRAIN_FAULT": "nan@2:1,stall@3:1"}, timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "step 2 skipped" in proc.stdout  # printed by rank 0, whose own gradients were finite
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith("meshtrain: rank 1 failed: Stalled: watchdog: rank 1 stalled at step 3 in 'reading the "
                            "batch'"), proc.stderr
    assert "rank 0 waits at step 3 in 'forward, backward and optimizer update'" in first
    assert "in before_batch" in proc.stderr  # rank 1's own stack: where it is stuck
    assert [r["step"] for r in _records(tmp_path)] == [1, 2]


@pytest.mark.alone
@pytest.mark.parametrize("fault,first_line", [
    ("raise@2:1", "meshtrain: rank 1 failed: RuntimeError: injected fault (MESHTRAIN_FAULT) at step 2"),
    ("kill@2:1", "meshtrain: rank 1 failed: SIGKILL: the process was killed by SIGKILL"),
])
def test_a_dead_rank_ends_the_job_promptly_with_its_own_error_first(tmp_path, fault, first_line):
    """Rank 0 is then blocked in a collective of step 2: the job must still end at once
    (not after the collective timeout or the watchdog's), reporting rank 1, not rank 0's
    lost connection."""
    start = time.perf_counter()
    proc = run_cli(*TWO, "--run_dir", str(tmp_path), env={"MESHTRAIN_FAULT": fault}, timeout=240)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[0].startswith(first_line), proc.stderr
    assert [r["step"] for r in _records(tmp_path)] == [1]
    # Startup and step 1 take seconds; the watchdog (600 s) and the collective timeout
    # (900 s) are far beyond this bound.
    assert elapsed < 120, elapsed


def test_a_read_only_run_dir_fails_before_any_step_and_keeps_its_checkpoints(tmp_path, monkeypatch, capsys):
    """We run as root, for whom chmod does not make a directory read-only: the file system
    is made to refuse writes under run_dir instead (EROFS), as a read-only mount would."""
    import errno
    import pathlib

    assert main([*ONE, "--train.steps", "2", "--checkpoint.every", "2", "--run_dir", str(tmp_path)]) == 0
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    capsys.readouterr()
    write_text = pathlib.Path.write_text

    def read_only(self, *args, **kwargs):
        if tmp_path in self.parents:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", read_only)
    code = main([*ONE, "--train.steps", "4", "--checkpoint.every", "2", "--run_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "cannot be written (Read-only file system)" in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_full_disk_mid_run_stops_with_one_line_and_the_run_resumes(tmp_path, monkeypatch, capsys):
    """metrics.jsonl cannot be appended to at step 3 (disk full): exit 1 with one line, the
    step-2 checkpoint intact; run again (space freed), the run resumes from it."""
    import builtins
    import errno

    opened = builtins.open

    run_dir, whole = tmp_path / "run", tmp_path / "whole"

    def full_at_step_3(path, mode="r", *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and mode == "a" and len(_records(run_dir)) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return opened(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_at_step_3)
    args = [*ONE, "--train.steps", "4", "--checkpoint.every", "2", "--run_dir", str(run_dir)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "metrics.jsonl (No space left on device)" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(builtins, "open", opened)
    assert main(args) == 0
    assert "resumed from" in capsys.readouterr().out
    assert [r["step"] for r in _records(run_dir)] == [1, 2, 3, 4]
    # ... on the uninterrupted run's curve, bit for bit (fp32, one process).
    assert main([*args[:-1], str(whole)]) == 0
    curve = [{k: r[k] for k in ("step", "loss", "lr", "grad_norm")} for r in _records(run_dir)]
    assert curve == [{k: r[k] for k in ("step", "loss", "lr", "grad_norm")} for r in _records(whole)]
