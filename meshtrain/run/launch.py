"""Where a run's processes come from: this process alone, a launcher's world, or ours.

- Under torchrun (or anything that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT,
  e.g. SLURM via `srun torchrun ...`) every process is one rank of the world it was given.
- Otherwise, when `parallel.nproc_per_node` asks for more than one process, this process
  becomes the launcher: it starts the ranks through torch.distributed's elastic agent on
  this machine (c10d rendezvous on a free local port, no restarts), waits for them, and
  reports the first rank that failed with that rank's own error, not the "connection
  closed" its peers see afterwards.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing.process
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from ..checkpoint import CheckpointError
from ..data.errors import DataError
from ..errors import ConfigError, TrainingError, lost_peer
from . import stopping

_REPORT_DIR = stopping.NOTE_DIR  # where self-launched ranks leave their error or stop note


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    local_rank: int
    launched: bool  # started by a launcher (env) or inside an existing process group


def detect(nproc_per_node: int) -> Ranks | None:
    """This process's place in the world, or None when it must launch the ranks itself."""
    env = os.environ
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        return Ranks(rank, world, int(env.get("LOCAL_RANK", rank)), True)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_world = env.get("LOCAL_WORLD_SIZE")
        if nproc_per_node > 1 and local_world is not None and int(local_world) != nproc_per_node:
            raise ConfigError(f"parallel.nproc_per_node={nproc_per_node}, but the launcher started {local_world} "
                              f"processes on this node: under a launcher its --nproc_per_node decides; set "
                              f"parallel.nproc_per_node to {local_world} (or 1) to match")
        if world > 1 and not ("MASTER_ADDR" in env and "MASTER_PORT" in env):
            raise ConfigError(f"WORLD_SIZE={world} is set but MASTER_ADDR/MASTER_PORT are not: start the "
                              "ranks with torchrun (or set all four variables)")
        return Ranks(rank, world, int(env.get("LOCAL_RANK", 0)), True)
    if nproc_per_node > 1:
        return None
    return Ranks(0, 1, 0, False)


def by_our_launcher() -> bool:
    """Whether this process is a rank that `launch` started (which holds the run's lock)."""
    return bool(os.environ.get(_REPORT_DIR))


class RankFailed(RuntimeError):
    """A self-launched rank failed; `report` is that rank's own error."""

    def __init__(self, report: dict):
        self.report = report
        super().__init__(f"rank {report['rank']} failed: {report['type']}: {report['message']}")


def launch(fn: Callable[..., Any], args: tuple, nproc: int) -> list[Any] | None:
    """Run `fn(*args)` on `nproc` local ranks; returns each rank's result, by rank, or None
    when the ranks all stopped cleanly on a SIGTERM / SIGINT (they checkpoint and exit:
    preemption, Ctrl-C); stopping.Interrupted when a second signal stopped them at once or
    one came before they could train.

    Raises the first failing rank's ConfigError, DataError or CheckpointError again as
    such (so the CLI exits 2 with its one-line message) and any other failure as
    RankFailed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # One thread per rank unless the user chose: ranks share this machine's cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                          # Spawned, not forked from a preloaded server: that starts faster
                          # but inductor compiled ~35% slower in forked ranks (test harness).
                          monitor_interval=0.1, start_method="spawn",
                          # Ranks that got a stop signal checkpoint first: give them time.
                          shutdown_timeout=int(os.environ.get("MESHTRAIN_SHUTDOWN_TIMEOUT", 300)))
    # The agent logs every rank's failure and every signal at length; we report the first
    # failure, or how the ranks stopped, ourselves. Its loggers set their own levels.
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
               if n.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"))]
    levels = [g.level for g in loggers]
    for g in loggers:
        g.setLevel(logging.CRITICAL)
    handlers = _agent_signal_handlers()
    with tempfile.TemporaryDirectory(prefix="meshtrain-ranks-") as reports:
        stopping.REQUEST.relay_mark = Path(reports, stopping.RELAY_MARK)
        mask = _block_sigint_in_ranks()
        stops = _StartStops(Path(reports), nproc) if mask is not None else None
        try:
            results = elastic_launch(config, _run_rank)(reports, fn, args)
        except (ChildFailedError, SignalException) as e:
            if isinstance(e, SignalException) and stops is not None:
                # The agent spawns no more and has closed the ranks it recorded: those it
                # never recorded are ours to end, and to reap, so none outlives the launcher.
                _reap(stops.end_unstarted())
            _raise_stop_or_failure(Path(reports), e)
            return None  # every rank stopped by a signal, checkpointed and exited
        finally:
            if stops is not None:
                stops.stop()
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            stopping.REQUEST.relay_mark = None
            for g, level in zip(loggers, levels):
                g.setLevel(level)
            for sig, handler in handlers.items():  # the agent leaves its own installed
                signal.signal(sig, handler)
    return [results[r] for r in sorted(results)]


def _agent_signal_handlers() -> dict:
    """This process's handlers of the signals torch's elastic agent takes over (in the
    main thread only: elsewhere it takes none), to put back after the launch."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")
    sigs = [getattr(signal, n.strip()) for n in names if hasattr(signal, n.strip())]
    return {sig: signal.getsignal(sig) for sig in sigs}


def _raise_stop_or_failure(reports: Path, error: Exception) -> None:
    """Why the ranks ended early: a second signal that stopped them at once, the first
    rank that failed, or a signal before any rank could train; returns when every rank
    stopped cleanly on a signal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    notes = stopping.read_notes(reports)
    at_once = next((n for n in notes if n["at_once"]), None)
    if at_once is not None:
        # The signal the user sent is the one this process got: the agent, interrupted in
        # its shutdown, passes on a SIGTERM of its own, which a rank may see first.
        name = error.sigval.name if isinstance(error, SignalException) else at_once["signal"]
        raise stopping.Interrupted(stopping.at_once_line(name, at_once["where"]), name)
    first = (None if isinstance(error, SignalException) else _killed(error)) or _first_failure(reports)
    if first is not None:
        _raise_bad_input(first)
        raise RankFailed(first) from None
    if not isinstance(error, SignalException):
        raise error
    if not notes:
        name = error.sigval.name
        raise stopping.Interrupted(f"stopped by {name} before the ranks began training: nothing was saved", name)


# A Ctrl-C reaches every process of the terminal's group, ranks still importing torch
# included, before any code of ours runs in them: each would print a KeyboardInterrupt
# traceback of its own. So the ranks start with SIGINT blocked (a signal mask survives
# fork and exec; the launcher blocks it in the thread that starts them) and unblock it
# once their handler is installed (_take_signals). The launcher still receives it: the
# kernel hands it to a thread that does not block it (our signal watcher,
# stopping.REQUEST), and Python runs the elastic agent's handler in the main thread.
# While the ranks start, a thread of the launcher (_StartStops) ends those that have not
# started yet when the launcher got a stop signal, rather than after their imports; and
# once the agent gave up, the launcher ends them itself (a signal during the agent's
# spawning leaves ranks it never recorded, which would fail loudly on its lost pipes).
_STARTED = "started-{pid}"  # in the report directory: this rank handles signals itself


def _block_sigint_in_ranks() -> set | None:
    """Block SIGINT in this thread while it starts the ranks; the previous mask, or None
    where nothing was blocked (not the main thread, or no watcher of ours to take it)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not stopping._caught:
        return None
    # Started now, not by the first rank's spawn: starting it unblocks SIGINT afterwards
    # (its own guard of the same race, bpo-33613), which would undo ours.
    resource_tracker.ensure_running()
    return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


class _StartStops:
    """The launcher's thread while the elastic agent runs: a stop signal this process took
    before the agent handled signals is handed to the agent (which else never learns of
    it, and the ranks would train on), and once the agent has one, the ranks that have
    not started are ended."""

    def __init__(self, reports: Path, ranks: int):
        self.reports, self.ranks, self.done = reports, ranks, threading.Event()
        self.others = _child_pids()  # processes of the caller's own, never ours to end
        self.thread = threading.Thread(target=self._run, name="meshtrain-launch-stops", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def _run(self) -> None:
        handed = False
        while not self.done.wait(0.05):
            name = stopping.REQUEST.name
            if name and not handed and signal.getsignal(signal.SIGINT) is not stopping._caught:
                handed = True  # the agent's handler is in place now: it stops the ranks
                os.kill(os.getpid(), signal.Signals[name])
            if (self.reports / stopping.RELAY_MARK).exists() and \
                    len(list(self.reports.glob(_STARTED.format(pid="*")))) < self.ranks:
                self.end_unstarted()

    def end_unstarted(self) -> set[int]:
        """End the ranks that run no code of ours yet; returns their pids. By SIGKILL: there
        is nothing to save, and a rank forked but not yet exec'd still has the launcher's
        handlers. Only pids are read here: polling the processes would race the agent's
        own waits."""
        ended = set()
        for pid in _child_pids() - self.others:
            if not (self.reports / _STARTED.format(pid=pid)).exists():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    ended.add(pid)
        return ended


def _reap(pids: set[int], timeout: float = 10.0) -> None:
    """Wait for killed children to be gone: a SIGKILLed process still runs its exit for a
    while, and one whose parent left first becomes init's (which in a container may never
    reap it)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while True:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] or time.monotonic() > deadline:
                    break
            except ChildProcessError:  # reaped already
                break
            time.sleep(0.01)


def _child_pids() -> set[int]:
    """This process's children. From /proc where there is one: it also lists a rank whose
    start a signal cut short, which multiprocessing never recorded."""
    proc = Path("/proc")
    if not proc.is_dir():
        return {c._popen.pid for c in list(multiprocessing.process._children) if c._popen is not None}
    me, found = os.getpid(), set()
    for stat in proc.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == me:
                found.add(int(stat.parent.name))
    return found


def _take_signals(reports: str) -> None:
    """In a rank started with SIGINT blocked: our handler, then the signal unblocked (one
    that came meanwhile is a stop request now). A rank whose launcher got a stop signal
    while it started leaves at once, quietly: the agent is shutting down and collects
    nothing, and there is nothing to save."""
    if signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        return
    stopping.REQUEST.install()
    Path(reports, _STARTED.format(pid=os.getpid())).touch()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if stopping.relayed():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _run_rank(reports: str, fn: Callable[..., Any], args: tuple) -> Any:
    os.environ[_REPORT_DIR] = reports
    _take_signals(reports)
    try:
        return fn(*args)
    except BaseException as e:
        bad_input = next((name for name, cls in _bad_input_errors().items() if isinstance(e, cls)), None)
        report_failure({"rank": int(os.environ.get("RANK", -1)), "time": time.time(), "type": type(e).__name__,
                        "message": str(e), "bad_input": bad_input, "traceback": traceback.format_exc()})
        raise


def report_failure(report: dict) -> bool:
    """Leave this rank's error for our launcher, which shows the first one; False when
    there is no such launcher (torchrun, one process) and the rank must print it."""
    reports = os.environ.get(_REPORT_DIR)
    if not reports:
        return False
    if not Path(reports, f"rank{report['rank']}.json").exists():
        Path(reports, f"rank{report['rank']}.json").write_text(json.dumps(report))
    return True


def _killed(error) -> dict | None:
    """A rank that died by a signal (SIGKILL from the OOM killer, a segfault) leaves no
    report; its peers then fail on the broken connection and do. It is the cause."""
    for rank, failure in sorted(error.failures.items()):
        if failure.exitcode is not None and failure.exitcode < 0:
            name = failure.signal_name()
            return {"rank": rank, "time": 0.0, "type": name, "bad_input": None, "traceback": "",
                    "message": f"the process was killed by {name} (no Python error: killed from outside, e.g. by "
                               "the out-of-memory killer, or it crashed in native code); the other ranks stopped "
                               "when they lost it"}
    return None


def _bad_input_errors() -> dict[str, type]:
    """The errors the CLI prints as their one-line message: bad input (exit 2) and a run
    stopped by its own safeguards (exit 1)."""
    return {"config": ConfigError, "data": DataError, "checkpoint": CheckpointError, "training": TrainingError}


def _raise_bad_input(report: dict) -> None:
    """Raise a rank's one-line error again here, as the same class, without its traceback."""
    if report.get("bad_input"):
        raise _bad_input_errors()[report["bad_input"]](report["message"]) from None


def _first_failure(reports: Path) -> dict | None:
    """The earliest error any rank reported: the cause, not a peer's reaction to it (a
    rank that lost its peer can report before the failing rank has unwound and reported,
    e.g. while a prefetched gather was in flight)."""
    found = [json.loads(p.read_text()) for p in reports.glob("rank*.json")]
    return min(found, key=lambda r: (lost_peer(r["message"]), r["time"])) if found else None
