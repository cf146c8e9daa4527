"""A run directory belongs to one run.

- A fresh start (`checkpoint.resume: none`) in a run_dir that holds a run is refused
  before anything is written; `checkpoint.resume: restart` first moves that run aside,
  into `previous/<UTC time>/`, so no history is lost or mixed.
- A run holds an exclusive lock on its run_dir (`run.lock`) for its whole life: an OS
  lock (flock) that dies with its process, so a killed run (kill -9, a lost node) never
  blocks the next one. The process that starts the run takes it — our launcher for its
  ranks, global rank 0 under torchrun — so the ranks of one job never contend.
- The files a run writes at its start (config.yaml, plan.json, configs/) and the metrics
  a resumed run keeps.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import math
import os
import socket
import sys
from pathlib import Path

import torch.distributed as dist

from .. import checkpoint
from ..errors import ConfigError

LOCK = "run.lock"
PREVIOUS = "previous"
# Everything a run writes into its run_dir (checkpoint.export's directory and its
# temporaries included): what restart moves aside.
RUN_FILES = ("checkpoints", "metrics.jsonl", "metrics.jsonl.tmp", "tensorboard", "configs", "config.yaml",
             "plan.json", "export", ".export-new", ".export-old")


def history(run_dir: Path) -> str | None:
    """What of a run the directory holds (its checkpoints, its metrics), in words; None
    when it holds neither."""
    found = []
    steps = [p.name for p in checkpoint.complete(checkpoint.in_run(run_dir))]
    if steps:
        found.append(f"checkpoints up to {steps[-1]}" if len(steps) > 1 else f"checkpoint {steps[0]}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append("metrics.jsonl")
    return " and ".join(found) or None


def refuse_fresh_start(run_dir: Path) -> None:
    """checkpoint.resume none over a run's history: exit 2, touching nothing."""
    held = history(run_dir)
    if held is not None:
        raise ConfigError(f"checkpoint.resume=none, but run_dir={str(run_dir)!r} holds a run ({held}): give another "
                          "run_dir, or --checkpoint.resume restart to move that run into "
                          f"{run_dir / PREVIOUS}/<UTC time>/ and start over (or auto to continue it)")


def move_aside(run_dir: Path) -> Path | None:
    """checkpoint.resume restart: the run in run_dir moves, whole, into
    previous/<UTC time>/ (renames: nothing is copied or deleted). None if there was none."""
    present = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    if not present:
        return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target, n = run_dir / PREVIOUS / stamp, 1
    while target.exists():  # two restarts within a second
        target, n = run_dir / PREVIOUS / f"{stamp}.{n}", n + 1
    target.mkdir(parents=True)
    for path in present:
        os.replace(path, target / path.name)
    return target


class RunLock:
    """The exclusive lock of one run on its run_dir. `acquire` takes it at once or raises a
    ConfigError naming the holder (host, pid, start time); `release` (or the process's end,
    however it ends) frees it. The file stays: deleting a lock file races with the next
    taker."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(self._in_use()) from None
            # A file system without locks (some network mounts): run unguarded, and say so.
            print(f"meshtrain: warning: cannot lock {self.path} ({e.strerror}): a second run on this run_dir would "
                  "not be refused", file=sys.stderr, flush=True)
            return self
        self._fd = fd
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": started}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        return self

    def check_free(self) -> None:
        """Refuse at once, before the slow checks of a start, when another run holds the
        lock; touches nothing (a run_dir without a lock file has no holder)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(self._in_use()) from None
        finally:
            os.close(fd)

    def _in_use(self) -> str:
        return (f"run_dir={str(self.path.parent)!r} is in use by another run ({self.holder()}): wait for it to end "
                "or stop it, or give this run another run_dir")

    def holder(self) -> str:
        """Who holds the lock, in words, from what the holder wrote into the file."""
        try:
            h = json.loads(self.path.read_text())
            return f"host {h['host']}, pid {h['pid']}, started {h['started']}"
        except (OSError, ValueError, KeyError, TypeError):  # the holder is still writing it
            return "its holder is starting"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor frees the flock
            self._fd = None


def claim(cfg, rank: int, world: int) -> RunLock | None:
    """The run's lock on cfg.run_dir, taken by rank 0 for the whole job (None elsewhere),
    and with checkpoint.resume restart the old run moved aside. With more ranks they all
    learn, together, whether rank 0 got it: a refused job exits 2 on every rank."""
    run_dir, lock, error = Path(cfg.run_dir), None, None
    if rank == 0:
        try:
            lock = RunLock(run_dir).acquire()
            moved = move_aside(run_dir) if cfg.checkpoint.resume == "restart" else None
            if moved is not None:
                print(f"checkpoint.resume restart: the run that was in {run_dir} is now in {moved}", flush=True)
        except (ConfigError, OSError) as e:
            if lock is not None:
                lock.release()
            error = str(e) if isinstance(e, ConfigError) else f"run_dir={str(run_dir)!r}: cannot move the old run " \
                f"aside ({e.strerror or e}); nothing was deleted"
    if world > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ConfigError(error)
    return lock


def write_run_files(run_dir: Path, config_yaml: str, plan_json: str, step: int) -> None:
    """config.yaml and plan.json of this start, and the config again under
    configs/step_XXXXXXXX.yaml (the step it starts from; .1, .2, ... when a later start
    from the same step has another config): the history of a run's configs."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml)
    (run_dir / "plan.json").write_text(plan_json + "\n")
    configs = run_dir / "configs"
    configs.mkdir(exist_ok=True)
    name, n = f"step_{step:08d}", 1
    while (configs / f"{name}.yaml").exists() and (configs / f"{name}.yaml").read_text() != config_yaml:
        name, n = f"step_{step:08d}.{n}", n + 1
    (configs / f"{name}.yaml").write_text(config_yaml)


def kept_metrics(run_dir: Path, resumed_step: int | None) -> list[dict]:
    """A resumed run keeps the records up to its checkpoint's step; a new run starts empty."""
    path = run_dir / "metrics.jsonl"
    if resumed_step is None or not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if record.get("step", math.inf) <= resumed_step:
            kept.append(record)
    return kept
