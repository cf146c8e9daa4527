"""What a run directory holds across invocations of the same command: the end of a run
always saves (train.steps or train.stop_at), a rerun of a finished run does nothing, a
resume with a changed config names each change, and configs/ keeps every start's config.
A run_dir belongs to one run: a fresh start over a run is refused (restart moves it
aside), a resume with another tokenizer is refused, and a second job is refused while the
first runs (after a kill -9 the lock is free again: tests/test_crash_safety.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket

import pytest
import yaml

from meshtrain.cli import main
from support.cli import SMALL, TINY


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
        "to train further, or start over in another run_dir, or here with --checkpoint.resume restart (the run moves to "
        f"{run_dir}/previous/)"]
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


def test_a_fresh_start_over_a_run_is_refused_and_restart_moves_the_run_aside(tmp_path, capsys, one_thread):
    """checkpoint.resume none over a run's history exits 2 touching nothing; restart moves
    the whole run into previous/<UTC time>/ and trains from step 1 beside it."""
    run_dir = tmp_path / "run"
    assert _fit(capsys, run_dir, "--train.steps", "2")[0] == 0
    before = _files(run_dir)

    code, out = _fit(capsys, run_dir, "--checkpoint.resume", "none")
    assert code == 2 and "Traceback" not in out
    assert out.strip().splitlines() == [
        f"meshtrain: config error: checkpoint.resume=none, but run_dir='{run_dir}' holds a run (checkpoint "
        "step_00000002 and metrics.jsonl): give another run_dir, or --checkpoint.resume restart to move that run "
        f"into {run_dir}/previous/<UTC time>/ and start over (or auto to continue it)"]
    assert _files(run_dir) == before  # not a byte, not a timestamp

    code, out = _fit(capsys, run_dir, "--checkpoint.resume", "restart", "--train.steps", "3")
    assert code == 0, out
    (previous,) = (run_dir / "previous").iterdir()
    assert re.fullmatch(r"\d{8}T\d{6}Z", previous.name)
    assert f"checkpoint.resume restart: the run that was in {run_dir} is now in {previous}" in out
    moved = {p.relative_to(previous): v for p, v in _files(previous).items()}
    assert moved == {p.relative_to(run_dir): v for p, v in before.items() if p.name != "run.lock"}
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000003"]
    assert [p.name for p in (run_dir / "configs").iterdir()] == ["step_00000000.yaml"]
    assert "resumed from" not in out


def test_a_resume_with_another_tokenizer_is_refused_before_anything_is_written(tmp_path, capsys, one_thread):
    """Token ids of another tokenizer would reuse the trained embeddings for other text."""
    from meshtrain.data import preprocess
    from meshtrain.data.tokenizer import ByteTokenizer

    run_dir = tmp_path / "run"
    assert _fit(capsys, run_dir, "--train.steps", "2")[0] == 0
    before = _files(run_dir)
    tokenizer = tmp_path / "tokenizer.json"  # the bytes' vocabulary as a file: another identity
    tokenizer.write_text(ByteTokenizer().hf_files()["tokenizer.json"])
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 40}) + "\n" for i in range(20)))
    preprocess(tmp_path / "docs.jsonl", tmp_path / "docs", tokenizer=str(tokenizer), append_eod=True)
    code, out = _fit(capsys, run_dir, "--train.steps", "4", "--data.paths", str(tmp_path / "docs"),
                     "--data.tokenizer", str(tokenizer))
    assert code == 2 and "Traceback" not in out, out
    sha = hashlib.sha256(tokenizer.read_bytes()).hexdigest()[:12]
    assert out.strip().splitlines() == [
        f"meshtrain: config error: checkpoint {run_dir}/checkpoints/step_00000002 was trained with tokenizer bytes "
        f"(258 token ids), but data.tokenizer is {tokenizer} (sha256 {sha}, 258 token ids): resume with "
        "data.tokenizer bytes (and data it tokenized), or start a new run: another run_dir, or --checkpoint.resume "
        "restart"]
    assert _files(run_dir) == before


@pytest.mark.alone
def test_a_second_job_on_a_run_dir_is_refused_at_once_and_the_first_runs_on(tmp_path):
    """Two processes on one run_dir (a resubmitted job, a second terminal): the second exits
    2 within seconds naming the holder; the first is untouched: its metrics are 1..N once."""
    import signal
    import subprocess
    import sys
    import time

    from support.cli import ROOT, SMALL, TINY, cli_env, run_cli

    run_dir = tmp_path / "run"
    args = ["fit", "--config", str(TINY), *SMALL, "--train.steps", "100000", "--run_dir", str(run_dir)]
    first = subprocess.Popen([sys.executable, "-m", "meshtrain.cli", *args], cwd=ROOT, env=cli_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # training, lock held
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
            time.sleep(0.05)
        start = time.monotonic()
        second = run_cli(*args)
        refused_s = time.monotonic() - start
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stdout + second.stderr
        assert (f"meshtrain: config error: run_dir='{run_dir}' is in use by another run (host "
                f"{socket.gethostname()}, pid {first.pid}, started ") in second.stderr
        assert refused_s < 20, refused_s  # python and torch imports; the check itself is one flock
        assert first.poll() is None  # still training
        first.send_signal(signal.SIGINT)  # stops after a step with a checkpoint
        out = first.communicate(timeout=120)[0]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0, out
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{steps[-1]:08d}"]
