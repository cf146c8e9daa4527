"""SIGINT and SIGTERM through the real CLI, as a terminal, `kill`, SLURM and launchers send
them: to the whole process group (every rank gets the signal, and the launcher passes it
on again) or to the launcher alone. The first signal is answered at once by one line (rank
0's, however many processes received it), however long the step still runs; each stop
saves one checkpoint and exits 0 with one line; a second signal during the save ends at
once with one line and leaves the previous checkpoint the latest; the resumed runs continue
the uninterrupted loss curve exactly.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshtrain.run.stopping import DUPLICATE_S, first_line
from meshtrain import checkpoint
from support.cli import ROOT, SMALL, TINY, cli_env, read_metrics, run_cli

TINY4 = ROOT / "configs" / "tiny-4proc.yaml"
MID_SPAWN = ROOT / "tests" / "support" / "ctrl_c_mid_spawn.py"
# A long schedule: where a run stops does not change its curve.
LONG = [*SMALL, "--train.steps", "400"]
# The first signal's line, after the signal was sent (measured: 0.01-0.02 s).
ANSWER_S = 2.0


class Run:
    """One `meshtrain fit` in its own process group, watched through its metrics.jsonl."""

    def __init__(self, args: list[str], run_dir: Path, launcher: list[str] | None = None, env: dict | None = None):
        self.run_dir = run_dir
        cmd = [sys.executable, *(launcher or []), "-m", "meshtrain.cli", "fit", *args, "--run_dir", str(run_dir)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**cli_env(), **(env or {})}, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    def wait_for(self, what, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"the run ended or stalled before the test could signal it:\n{self.finish()}")
            time.sleep(0.1)

    def steps_logged(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def signal_group(self, sig: signal.Signals) -> None:
        os.killpg(self.proc.pid, sig)

    def finish(self, timeout: float = 300) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
        return self.proc.returncode, out, err

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def _stopped(out: str, name: str) -> int:
    """The step of the one 'stopped by' line."""
    found = re.findall(rf"^stopped by {name} after step (\d+): checkpoint (\S+); run the same command to resume$",
                       out, re.M)
    assert len(found) == 1, out
    return int(found[0][0])


def _answers(out: str) -> list[str]:
    """The lines that answer a first signal (stopping.first_line)."""
    return re.findall(r"^SIG(?:INT|TERM): stopping .*$", out, re.M)


def _checkpoints(run_dir: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in checkpoint.complete(run_dir / "checkpoints")]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.mark.slow
def test_four_self_launched_ranks_stop_on_every_kind_of_signal_and_resume_exactly(tmp_path):
    args = ["--config", str(TINY4), *LONG]  # fsdp 2 x tp 2 + sp; checkpoint.every 0
    run_dir = tmp_path / "run"

    # Ctrl-C in a terminal: SIGINT to every process of the group, and the launcher passes it on.
    run = Run(args, run_dir)
    run.wait_for(lambda: run.steps_logged() >= 3)
    run.signal_group(signal.SIGINT)
    code, out, err = run.finish()
    assert code == 0 and "Traceback" not in err and "failed" not in err, out + err
    first = _stopped(out, "SIGINT")
    assert _checkpoints(run_dir) == [first] and len(_answers(out)) == 1, out

    # SIGTERM to the launcher alone (`kill PID`): it passes it on to the ranks.
    run = Run(args, run_dir)
    run.wait_for(lambda: run.steps_logged() >= first + 2)
    run.proc.send_signal(signal.SIGTERM)
    code, out, err = run.finish()
    assert code == 0 and "Traceback" not in err, out + err
    assert "resumed from" in out
    second = _stopped(out, "SIGTERM")
    assert _checkpoints(run_dir) == [first, second] and len(_answers(out)) == 1, out

    # SIGTERM to the group, then a second signal while the checkpoint is being written
    # (the injected fault holds every rank inside its save).
    run = Run(args, run_dir, env={"MESHTRAIN_FAULT": f"savestall@{second + 1}"})
    run.wait_for(lambda: run.steps_logged() >= second + 2)
    run.signal_group(signal.SIGTERM)
    signalled = time.monotonic()
    run.wait_for(lambda: any(p.name.startswith(".tmp-step_") for p in (run_dir / "checkpoints").iterdir()))
    time.sleep(max(0.0, signalled + DUPLICATE_S + 0.5 - time.monotonic()))  # not the same request
    run.signal_group(signal.SIGINT)
    code, out, err = run.finish(timeout=60)
    assert code == 128 + signal.SIGINT and len(_answers(out)) == 1, out + err
    latest = checkpoint.step_dir(run_dir / "checkpoints", second)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(rf"meshtrain: stopped at once by a second SIGINT \(step \d+: checkpoint "
                                            rf"save\); {re.escape(str(latest))} is the latest checkpoint, intact",
                                            lines[0]), err
    assert checkpoint.latest(run_dir / "checkpoints") == latest and _checkpoints(run_dir) == [first, second]

    # The same command resumes from the intact checkpoint and clears the abandoned one.
    end = ["--train.stop_at", str(second + 2)]
    resumed = run_cli("fit", *args, *end, "--run_dir", str(run_dir), timeout=400)
    assert resumed.returncode == 0 and f"resumed from {latest}" in resumed.stdout, resumed.stdout + resumed.stderr
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    reference = run_cli("fit", *args, *end, "--run_dir", str(tmp_path / "reference"), timeout=400)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, second + 3))
    assert _losses(run_dir) == _losses(tmp_path / "reference")


@pytest.mark.slow
def test_two_ranks_under_torchrun_stop_on_group_signals_and_resume_exactly(tmp_path):
    """torchrun passes a signal on to its ranks, which also got it from the group. The
    ranks save and exit 0 with one line; torchrun itself then reports the signal it got
    (its own SignalException, exit 1): that is torchrun's behaviour, not a failed rank."""
    args = ["--config", str(TINY), *LONG, "--parallel.fsdp", "2"]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run_dir = tmp_path / "run"
    stops = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        run = Run(args, run_dir, launcher=torchrun)
        run.wait_for(lambda: run.steps_logged() >= (stops[-1] if stops else 0) + 3)
        run.signal_group(sig)
        code, out, err = run.finish()
        stops.append(_stopped(out, sig.name))
        assert len(_answers(out)) == 1, out  # rank 0's
        assert "ChildFailedError" not in err and "KeyboardInterrupt" not in err, out + err
        assert f"SignalException: Process {run.proc.pid} got signal: {int(sig)}" in err, err
        assert _checkpoints(run_dir)[-1] == stops[-1]
    end = ["--train.stop_at", str(stops[-1] + 2)]
    resumed = run_cli("fit", *args, *end, "--run_dir", str(run_dir), launcher=torchrun, timeout=400)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stdout + resumed.stderr
    # The reference: the same layout, self-launched, never interrupted.
    reference = run_cli("fit", *args, *end, "--parallel.nproc_per_node", "2", "--run_dir", str(tmp_path / "ref"),
                        timeout=400)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, stops[-1] + 3))
    assert _losses(run_dir) == _losses(tmp_path / "ref")


def test_a_signal_to_one_rank_stops_every_rank_and_rank_0_names_it(tmp_path):
    """Only rank 1 receives SIGTERM (fault injection sends it to itself at step 2): the
    ranks agree on the step and on the signal, so rank 0, which received nothing, prints
    the same line a group signal gives."""
    run_dir = tmp_path / "run"
    args = ["fit", "--config", str(TINY), *LONG, "--parallel.fsdp", "2", "--parallel.nproc_per_node", "2"]
    done = run_cli(*args, "--run_dir", str(run_dir), env={"MESHTRAIN_FAULT": "sigterm@2:1"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    stopped = _stopped(done.stdout, "SIGTERM")
    assert stopped >= 2 and _checkpoints(run_dir) == [stopped]
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, stopped + 1))


def _processes(session: int) -> dict[int, tuple[int, str, bytes]]:
    """pid -> (parent pid, state, command line) of the processes of a session."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session:
                found[int(stat.parent.name)] = (int(fields[1]), fields[0], (stat.parent / "cmdline").read_bytes())
    return found


def _left_behind(session: int, within: float = 10.0) -> list[int]:
    """The session's processes still running after `within` seconds. Not at once: the
    launcher's resource tracker ends only once the launcher left, and a process that closed
    its pipes is still running its exit (a CI run read one in state R)."""
    deadline = time.monotonic() + within
    while (alive := [p for p, (_, state, _) in _processes(session).items() if state != "Z"]) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


@pytest.mark.alone
def test_ctrl_c_while_the_ranks_start_stops_with_one_line_and_no_traceback(tmp_path):
    """Ctrl-C reaches every process of the group, ranks still importing torch included
    (before any code of ours runs in them): they stay quiet, and the launcher's one line
    says that nothing was saved (exit 130, as a shell's Ctrl-C), with no process left."""
    run = Run(["--config", str(TINY4), *LONG], tmp_path / "run")
    pid = run.proc.pid
    run.wait_for(lambda: any(parent == pid and b"spawn_main" in cmd for parent, _, cmd in _processes(pid).values()),
                 timeout=120)
    started = time.monotonic()
    run.signal_group(signal.SIGINT)
    code, out, err = run.finish(timeout=60)
    assert code == 128 + signal.SIGINT, out + err
    assert err == "meshtrain: stopped by SIGINT before the ranks began training: nothing was saved\n", err
    assert not _checkpoints(tmp_path / "run") and not run.steps_logged()
    assert time.monotonic() - started < 20  # the ranks that had not started were ended, not waited for
    assert not _left_behind(pid), _processes(pid)


@pytest.mark.alone
def test_the_first_signal_is_answered_at_once_while_a_step_hangs(tmp_path):
    """Every rank of two self-launched ones hangs reading the batch of step 2 (fault
    injection: a step that never ends). A Ctrl-C to the whole group (the launcher and both
    ranks) is answered within ANSWER_S by one line, rank 0's, naming what the ranks are
    doing; the second Ctrl-C, which the line says to press, ends them at once."""
    args = ["--config", str(TINY), *LONG, "--parallel.fsdp", "2", "--parallel.nproc_per_node", "2"]
    run = Run(args, tmp_path / "run", env={"MESHTRAIN_FAULT": "stall@2"})
    lines = []  # (when it arrived, stdout line); stderr is read once the run has ended

    def read() -> None:
        for line in run.proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))

    threading.Thread(target=read, daemon=True).start()
    try:
        run.wait_for(lambda: run.steps_logged() >= 1)
        time.sleep(1.0)  # into step 2, where every rank hangs
        run.signal_group(signal.SIGINT)
        signalled = time.monotonic()
        run.wait_for(lambda: _answers("\n".join(line for _, line in lines)), timeout=30)
        time.sleep(max(0.0, signalled + DUPLICATE_S + 0.5 - time.monotonic()))  # not the same request
        run.signal_group(signal.SIGINT)
        code = run.proc.wait(timeout=60)
    finally:
        run.kill()
    err = run.proc.stderr.read()
    answered = [(at - signalled, line) for at, line in lines if _answers(line)]
    assert [line for _, line in answered] == [first_line("SIGINT", "step 2: reading the batch")], lines
    assert answered[0][0] < ANSWER_S, answered
    assert code == 128 + signal.SIGINT, err
    assert err == "meshtrain: stopped at once by a second SIGINT (step 2: reading the batch); no checkpoint was " \
                  "written\n"


_THREAD_SIGNALS = """
import signal, threading, time
from meshtrain.run import stopping

assert stopping.REQUEST.install()
stopping.REQUEST.doing = "asleep"
other = threading.Thread(target=time.sleep, args=(30,), daemon=True)
other.start()

def send():
    signal.pthread_kill(other.ident, signal.SIGTERM)
    time.sleep(0.3)
    assert stopping.REQUEST.name == "SIGTERM"
    time.sleep(stopping.DUPLICATE_S + 0.2)
    signal.pthread_kill(other.ident, signal.SIGINT)

threading.Thread(target=send, daemon=True).start()
time.sleep(30)  # as a rank inside a save or a collective: no signal interrupts the main thread
"""


@pytest.mark.alone
def test_a_signal_caught_by_another_thread_still_stops_the_process_while_the_main_thread_waits():
    """The kernel hands a process's signal to any of its threads (gloo starts several per
    process group); a Python handler would then wait for a main thread that never wakes."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _THREAD_SIGNALS], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGINT, done.stdout + done.stderr
    assert done.stdout == first_line("SIGTERM", "asleep") + "\n"
    assert done.stderr == "meshtrain: stopped at once by a second SIGINT (asleep)\n"
    assert time.monotonic() - started < 20


@pytest.mark.slow
def test_a_stop_signal_waits_for_the_checkpoint_written_in_the_background(tmp_path):
    """checkpoint.async_save, saving every step: Ctrl-C lands while a background write may
    be in flight; the run's stop checkpoint is committed (the latest, complete) before the
    one line and exit 0, and the same command resumes on the uninterrupted curve."""
    args = ["--config", str(TINY), *LONG, "--checkpoint.every", "1", "--checkpoint.async_save", "true"]
    run_dir = tmp_path / "run"
    run = Run(args, run_dir)
    run.wait_for(lambda: run.steps_logged() >= 4)
    run.signal_group(signal.SIGINT)
    code, out, err = run.finish()
    assert code == 0 and "Traceback" not in err, out + err
    stopped = _stopped(out, "SIGINT")
    assert checkpoint.latest(run_dir / "checkpoints") == checkpoint.step_dir(run_dir / "checkpoints", stopped)
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    end = ["--train.stop_at", str(stopped + 2)]
    resumed = run_cli("fit", *args, *end, "--run_dir", str(run_dir), timeout=400)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stdout + resumed.stderr
    reference = run_cli("fit", *args[:-2], *end, "--run_dir", str(tmp_path / "reference"), timeout=400)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    assert _losses(run_dir) == _losses(tmp_path / "reference")


def test_ctrl_c_while_the_agent_still_spawns_ranks_leaves_none_behind(tmp_path):
    """The agent's handler raises in the middle of its spawning loop: the ranks it started
    are in no list it closes, and each would fail on its launcher's vanished pipe and
    semaphore with a traceback. The launcher ends them (a CI run caught one by chance)."""
    run = Run(["--config", str(TINY4), *LONG], tmp_path / "run", launcher=[str(MID_SPAWN)])
    code, out, err = run.finish(timeout=60)
    assert code == 128 + signal.SIGINT, out + err
    assert err == "meshtrain: stopped by SIGINT before the ranks began training: nothing was saved\n", err
    assert not _checkpoints(tmp_path / "run") and not run.steps_logged()
    # finish() read both pipes to their end, which a rank left behind holds open until it
    # fails; one that lives on would hold them too
    assert not _left_behind(run.proc.pid), _processes(run.proc.pid)
