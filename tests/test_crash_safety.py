"""kill -9 of every process of a run at random moments, mid-step and mid-checkpoint
write: each next start of the same command resumes from the last complete checkpoint,
and the finished run's metrics.jsonl is the uninterrupted run's, bit for bit.

Everything goes through the CLI in subprocesses, each start in its own process group
(the launcher and its ranks), killed whole with SIGKILL; nothing of the group may
survive. One run_dir is driven through the kill trials of one process, another through
those of 2 self-launched fsdp ranks (gloo), where the cut checkpoint writes are DCP's
multi-rank ones; and the same two again with checkpoint.async_save, where the
checkpoint is written by a thread while training goes on (the kills land in the
background write). Each run_dir is compared with an uninterrupted run of the same layout
(fp32, the same layout and world: every deterministic field must be equal, not close),
and the asynchronous references with the synchronous ones.

The first kill of each run_dir lands inside a checkpoint write for certain, by fault
injection (meshtrain/run/faults.py): one process SIGKILLs itself once it has opened its
first tensor file of the save of step N (savekill@N); 2 ranks hang there (savestall@N) and
the whole group is SIGKILLed once every rank's tensor file exists. Its leftover is asserted:
the `.tmp-step_N` directory holding the tensor files and neither DCP's .metadata nor our
meta.json, the newest checkpoint N - 1, and the next start resumes from N - 1.
Each killed start held the run_dir's lock (run.lock, flock): the next start is never
refused by it.

After it the moments alternate: mid-checkpoint (the next save's temporary directory appears; the
kill comes at a uniformly random point of a save window timed on the save before, so it
lands before any file, between the ranks' tensor files and DCP's .metadata, after
meta.json but before the rename, or just after it) and mid-step (a uniformly random
fraction of a step period after a new metrics line). Every trial waits for a new
complete checkpoint first, so the trials cover the run. The two sequences of trials and
the two reference runs run side by side (most of each start is importing torch, on one
core), which keeps the file near a minute of wall time on an idle 2-core box; which
moment each kill lands on is random anyway (seeded, and recorded: run with -s to see
the table).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from meshtrain import checkpoint
from support.cli import ROOT, SMALL, TINY, cli_env, read_metrics

SEED = 10_03
ARGS = ["fit", "--config", str(TINY), *SMALL, "--checkpoint.every", "1", "--checkpoint.keep_last", "2",
        "--train.log_every", "1"]
# (run name, extra arguments, kill trials): the steps leave room for every trial to make
# progress (a few steps each) and for the last start to finish the run.
# The "-async" runs write their checkpoints in the background (checkpoint.async_save):
# their mid-checkpoint kills land while training goes on beside the write.
ASYNC = ["--checkpoint.async_save", "true"]
RUNS = [("one", ["--train.steps", "30"], 7),
        ("fsdp2", ["--train.steps", "12", "--parallel.nproc_per_node", "2", "--parallel.fsdp", "2"], 3),
        ("one-async", ["--train.steps", "30", *ASYNC], 7),
        ("fsdp2-async", ["--train.steps", "12", "--parallel.nproc_per_node", "2", "--parallel.fsdp", "2", *ASYNC], 3)]
# Every field of a metrics record that does not depend on timing or memory.
DETERMINISTIC = ("step", "loss", "lr", "grad_norm", "aux_loss", "expert_imbalance", "val_loss", "val_ppl")
RESUMED = re.compile(r"^resumed from (\S+) at step (\d+) ", re.M)
WAIT_S = 120  # for any one thing a start should do: a hang fails the test instead of blocking CI

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to see process groups")


def _start(run_dir: Path, extra: list[str], env: dict, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "meshtrain.cli", *ARGS, *extra, "--run_dir", str(run_dir)]
    with open(out, "w") as f:  # the child holds its own copy
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _group_alive(pgid: int) -> list[str]:
    """Processes of the process group (or session) `pgid` that are not zombies."""
    alive = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        state, _ppid, pgrp, session = stat[stat.rindex(")") + 2:].split()[:4]
        if pgid in (int(pgrp), int(session)) and state not in "ZXx":
            alive.append(f"{entry.name} {stat[:stat.rindex(')') + 1]} {state}")
    return alive


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to every process of the start; returns once none of them is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while (alive := _group_alive(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive, f"processes of the killed run survived SIGKILL: {alive}"


def _until(what: str, cond, proc: subprocess.Popen, out: Path, poll: float = 0.001):
    deadline = time.monotonic() + WAIT_S
    while not (value := cond()):
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) while waiting for {what}:\n{out.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {WAIT_S} s:\n{out.read_text()}")
        time.sleep(poll)
    return value


def _step(path: Path | None) -> int:
    return int(path.name.split("_")[1]) if path is not None else 0


def _logged(run_dir: Path) -> dict[int, dict]:
    """The whole lines of metrics.jsonl by step (a resumed start rewrites the file)."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return {}
    records = {}
    for line in text.splitlines(keepends=True):
        if line.endswith("\n"):
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                records[record["step"]] = record
    return records


def _complete_step(root: Path) -> int:
    """The newest step with a final directory and a meta.json: cheap enough to poll."""
    steps = [0]
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if entry.name.startswith("step_") and os.path.exists(os.path.join(entry.path, "meta.json")):
                steps.append(int(entry.name[5:]))
    return max(steps)


def _tmp_dir(root: Path, above: int) -> str | None:
    """The name of a checkpoint save in progress for a step above `above`, if any."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if entry.name.startswith(".tmp-step_") and int(entry.name.rsplit("_", 1)[1]) > above:
                return entry.name
    return None


def _ranks(extra: list[str]) -> int:
    return int(extra[extra.index("--parallel.nproc_per_node") + 1]) if "--parallel.nproc_per_node" in extra else 1


def _tensor_files(tmp: Path, ranks: int) -> bool:
    """Whether every rank has opened its DCP tensor file in the save directory `tmp`."""
    return all((tmp / f"__{r}_0.distcp").exists() for r in range(ranks))


def _injected_kill(proc: subprocess.Popen, root: Path, fault: str, fault_step: int, ranks: int, out: Path) -> int:
    """Waits for the kill inside the save of `fault_step` (see the module docstring);
    returns how many processes it ended."""
    if ranks == 1:  # savekill: the process SIGKILLs itself inside the save
        rc = proc.wait(timeout=WAIT_S)
        assert rc == -signal.SIGKILL, (fault, rc, out.read_text())
        return 1
    # savestall: every rank hangs inside the save; the caller kills the group
    tmp = root / f".tmp-{checkpoint.step_dir(root, fault_step).name}"
    _until(f"every rank's tensor file in {tmp.name}", lambda: _tensor_files(tmp, ranks), proc, out)
    return len(_group_alive(proc.pid))


def _drive(name: str, extra: list[str], trials: int, env: dict, work: Path, rng: random.Random) -> tuple:
    """Start, kill -9 inside a checkpoint write (injected), then at random moments, until
    `trials` kills; then let it finish. Returns the run_dir, one record per trial and the
    outputs of every start."""
    run_dir = work / name
    root = run_dir / "checkpoints"
    ranks = _ranks(extra)
    records, outs = [], []
    for i in range(trials):
        kind = "injected" if i == 0 else ("step", "checkpoint")[(i - 1) % 2]
        resume = _step(checkpoint.latest(root))  # what this start must resume from
        out = work / f"{name}-{i}.out"
        outs.append(out)
        launched = time.monotonic()
        fault_step = resume + 2  # the save of resume + 1 completes first: progress
        fault = f"{'savekill' if ranks == 1 else 'savestall'}@{fault_step}"
        proc = _start(run_dir, extra, {**env, "MESHTRAIN_FAULT": fault} if kind == "injected" else env, out)
        try:
            if kind == "injected":
                group = _injected_kill(proc, root, fault, fault_step, ranks, out)
                started, delay, what = time.monotonic() - launched, 0.0, f"MESHTRAIN_FAULT={fault}"
            else:
                started, delay, what = _random_moment(kind, proc, run_dir, resume, launched, out, rng)
                time.sleep(delay)
                group = len(_group_alive(proc.pid))  # the launcher and its ranks, all to be killed
        except BaseException:
            _kill_group(proc)
            raise
        _kill_group(proc)
        on_disk = checkpoint.latest(root)
        # What the kill cut short: a temporary directory, and how far its save had got.
        leftovers = sorted(f"{p.name}[{' '.join(sorted(os.listdir(p)))}]" if p.is_dir() else p.name
                           for p in root.iterdir() if p.name.startswith("."))
        records.append({"run": name, "trial": i, "kind": kind, "fault_step": fault_step if kind == "injected" else None,
                        "delay_ms": round(delay * 1000, 1), "at": what, "resumed_from": resume,
                        "on_disk": _step(on_disk), "leftovers": leftovers, "logged": max(_logged(run_dir), default=0),
                        "start_s": round(started, 1), "processes": group})
        print(records[-1], flush=True)
    out = work / f"{name}-final.out"
    outs.append(out)
    _finish(run_dir, extra, env, out)
    return run_dir, records, outs


def _random_moment(kind: str, proc: subprocess.Popen, run_dir: Path, resume: int, launched: float, out: Path,
                   rng: random.Random) -> tuple[float, float, str]:
    """(seconds the start took to its first new checkpoint, the delay to kill after, what
    it lands after) for a random moment mid-checkpoint or mid-step."""
    root = run_dir / "checkpoints"
    # Progress first: a checkpoint after the one this start resumed from.
    _until("new checkpoint", lambda: _complete_step(root) > resume, proc, out, poll=0.005)
    started = time.monotonic() - launched
    if kind == "checkpoint":  # at a random point of the next save's window
        # Time one whole save (temporary directory to final name) first: two ranks
        # take several times longer than one process, mostly before any file.
        timed = int(_until("checkpoint save", lambda: _tmp_dir(root, resume + 1), proc, out)[-8:])
        t0 = time.monotonic()
        _until("checkpoint", lambda: _complete_step(root) >= timed, proc, out)
        window = time.monotonic() - t0
        what = _until("checkpoint save", lambda: _tmp_dir(root, timed), proc, out)
        delay = rng.uniform(0, window)
        return started, delay, what + f" appeared, save window {window * 1000:.0f} ms"
    # A random fraction of a step period after a new metrics line.
    line = resume + 2
    logged = _until(f"metrics line {line}", lambda: line in (m := _logged(run_dir)) and m, proc, out)
    period = logged[line]["elapsed_s"] - logged[line - 1]["elapsed_s"]
    delay = rng.uniform(0, 1) * period
    return started, delay, f"after line {line}, step period {period * 1000:.0f} ms"


def _finish(run_dir: Path, extra: list[str], env: dict, out: Path) -> None:
    launched = time.monotonic()
    proc = _start(run_dir, extra, env, out)
    try:
        rc = proc.wait(timeout=300)
    finally:
        _kill_group(proc)
    assert rc == 0, out.read_text()
    print(f"{out.stem}: {time.monotonic() - launched:.1f} s to the end", flush=True)


def _reference(name: str, extra: list[str], env: dict, work: Path) -> Path:
    run_dir = work / f"{name}-reference"
    _finish(run_dir, extra, env, work / f"{name}-reference.out")
    return run_dir


def _curve(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in DETERMINISTIC if k in r} for r in read_metrics(run_dir)]


@pytest.mark.slow
def test_kill_9_at_random_moments_resumes_on_the_uninterrupted_curve(tmp_path):
    scratch = tmp_path / "tmp"  # what a killed launcher leaves in its TMPDIR stays in here
    scratch.mkdir()
    env = {**cli_env(), "PYTHONUNBUFFERED": "1", "TMPDIR": str(scratch)}
    rng = random.Random(SEED)
    seeds = {name: rng.randrange(2**32) for name, _, _ in RUNS}
    with ThreadPoolExecutor(2 * len(RUNS)) as pool:
        references = {name: pool.submit(_reference, name, extra, env, tmp_path) for name, extra, _ in RUNS}
        driven = {name: pool.submit(_drive, name, extra, trials, env, tmp_path, random.Random(seeds[name]))
                  for name, extra, trials in RUNS}
        references = {name: f.result() for name, f in references.items()}
        driven = {name: f.result() for name, f in driven.items()}

    total = 0
    for name, extra, trials in RUNS:
        run_dir, records, outs = driven[name]
        total += len(records)
        print(f"\n{name}: {'kind':10} {'delay ms':>8}  {'resumed from':>12}  {'on disk after kill':>18}  "
              f"{'logged':>6}  {'procs':>5}  {'start s':>7}  leftovers (files in them); at")
        for r in records:
            print(f"{name}: {r['kind']:10} {r['delay_ms']:8.1f}  {r['resumed_from']:12}  {r['on_disk']:18}  "
                  f"{r['logged']:6}  {r['processes']:5}  {r['start_s']:7.1f}  {','.join(r['leftovers']) or '-'}; "
                  f"{r['at']}")
        # Every trial made progress, and every later start resumed from the newest
        # complete checkpoint the kill before it left (none was skipped as damaged).
        for r in records:
            assert r["on_disk"] > r["resumed_from"], r
            assert r["processes"] >= (3 if "--parallel.nproc_per_node" in extra else 1), r
        # The injected kill landed inside the save of its step: that save's temporary
        # directory is left with every rank's tensor file and no .metadata or meta.json,
        # and the newest checkpoint is the one before it.
        (injected,) = [r for r in records if r["kind"] == "injected"]
        k = injected["fault_step"]
        tmp = f".tmp-{checkpoint.step_dir(run_dir / 'checkpoints', k).name}"
        assert injected["on_disk"] == k - 1, injected
        files = [f"__{r}_0.distcp" for r in range(_ranks(extra))]
        assert [x for x in injected["leftovers"] if x.startswith(tmp)] == [f"{tmp}[{' '.join(files)}]"], injected
        for i, out in enumerate(outs):
            text = out.read_text()
            found = RESUMED.findall(text)
            if i == 0:
                assert not found, text
                continue
            expected = checkpoint.step_dir(run_dir / "checkpoints", records[i - 1]["on_disk"])
            assert found == [(str(expected), str(records[i - 1]["on_disk"]))], text
            assert "skipping" not in text, text
            # The killed start's run_dir lock died with it: the next start took it at once.
            assert "in use by another run" not in text, text
        # The curve is the uninterrupted run's: fp32 on one layout, so exactly.
        curve, reference = _curve(run_dir), _curve(references[name])
        assert [r["step"] for r in curve] == list(range(1, len(reference) + 1))
        assert curve == reference
        assert {p.name for p in (run_dir / "checkpoints").iterdir()} == {
            p.name for p in (references[name] / "checkpoints").iterdir()}
        config = (run_dir / "config.yaml").read_text()
        assert config.replace(str(run_dir), "") == (references[name] / "config.yaml").read_text().replace(
            str(references[name]), "")
    # Writing in the background changes nothing the run computes.
    assert _curve(references["one-async"]) == _curve(references["one"])
    assert _curve(references["fsdp2-async"]) == _curve(references["fsdp2"])
    assert total >= 20
