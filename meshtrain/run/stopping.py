"""How a run stops when it is asked to: SIGINT (Ctrl-C) or SIGTERM (`kill`, a cluster's
preemption notice or time limit, a launcher passing either on).

The first request lets every rank finish its step; the ranks agree on that step (the
training loop's per-step all-reduce), save one checkpoint and exit 0. Its line comes at
once, however long the step has left (first_line: rank 0 prints it, so one process of a
launch does; our launcher passes its signals on to the ranks). A terminal sends
Ctrl-C to every process of its foreground group, and torchrun, SLURM and our own launcher
pass on what they receive, so one request can reach a rank twice within milliseconds:
signals within DUPLICATE_S of the first are that same request. A later one stops the
process at once (`os._exit`, no traceback): a checkpoint being written is abandoned under
its temporary name, the previous one stays the latest, and the next start clears the rest.

Under our launcher a rank that stops at once leaves a note for it and prints nothing (the
launcher prints the one line); otherwise rank 0 prints it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)
DUPLICATE_S = 1.0
NOTE_DIR = "MESHTRAIN_FAILURE_DIR"  # set by our launcher in each rank (launch._REPORT_DIR)
RELAY_MARK = "launcher-signalled"  # in NOTE_DIR: our launcher received a stop signal


class StopRequest:
    """This process's stop request: installed once, read by the training loop.

    Signals are acted on by a thread of ours, not by a Python handler: the kernel may hand
    a process's signal to any of its threads (gloo starts several per process group), and
    then a Python handler waits for the main thread, which may sit in a sleep or a
    collective that the signal never interrupts. Python's C handler still catches the
    signal on whichever thread and writes its number to the wakeup pipe we read."""

    def __init__(self):
        self.name: str | None = None  # the first signal's name
        self.first_at = 0.0
        self.doing = "starting"  # what the loop is doing, for the lines a first and a second signal print
        self.after: Callable[[], str] | None = None  # what stays on disk, for that line
        self._previous: dict = {}
        self._wakeup: tuple[int, int] | None = None  # (previous wakeup fd, our pipe's write end)
        # Our launcher, while torch's elastic agent handles its signals: a file that tells
        # the ranks the agent got one and shuts down (see relayed()).
        self.relay_mark: Path | None = None

    def install(self) -> bool:
        """Handle SIGINT and SIGTERM from now on, with no request yet; False where that is
        impossible (not the main thread) or already done."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return False
        self.name, self.doing, self.after = None, "starting", None
        read, write = os.pipe()
        os.set_blocking(write, False)  # a signal handler never blocks on a full pipe
        self._wakeup = (signal.set_wakeup_fd(write, warn_on_full_buffer=False), write)
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, _caught)
        threading.Thread(target=self._watch, args=(read,), name="meshtrain-signals", daemon=True).start()
        return True

    def restore(self) -> None:
        """The handlers from before install(); the request stays readable."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._wakeup is not None:
            previous, write = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write)  # the watching thread reads the end of its pipe and leaves
            self._wakeup = None

    def _watch(self, read: int) -> None:
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while numbers := pipe.read(64):
                for sig in numbers:
                    # Only while our handler is the one installed: a launcher that took
                    # the signals over (torch's elastic agent) handles them itself.
                    if sig not in SIGNALS:
                        continue
                    if signal.getsignal(sig) is _caught:
                        self._handle(sig)
                    elif self.relay_mark is not None:
                        with contextlib.suppress(OSError):  # the launch ended meanwhile
                            self.relay_mark.touch()

    def _handle(self, sig: int) -> None:
        now = time.monotonic()
        if self.name is None:
            self.name, self.first_at = signal.Signals(sig).name, now
            if os.environ.get("RANK", "0") == "0":
                # From a thread of its own: a write blocked on a full stdout pipe must not
                # keep this one from acting on a second signal.
                threading.Thread(target=_print_line, args=(first_line(self.name, self.doing),), daemon=True,
                                 name="meshtrain-stop-line").start()
        elif now - self.first_at > DUPLICATE_S:
            self._stop_now(sig)

    def _stop_now(self, sig: int) -> None:
        name = signal.Signals(sig).name
        where = f"({self.doing})"
        try:
            if self.after is not None:
                where += f"; {self.after()}"
        except Exception:  # the line must not fail: the process is leaving anyway
            pass
        try:
            sys.stdout.flush()  # the step lines printed so far
        except Exception:  # interrupted in the middle of a write: leave what is there
            pass
        try:
            # Under our launcher it prints the line once for every rank.
            if not leave_note(name, True, where) and os.environ.get("RANK", "0") == "0":
                os.write(2, f"meshtrain: {at_once_line(name, where)}\n".encode())
        finally:
            os._exit(128 + sig)


def first_line(signal_name: str, doing: str) -> str:
    """The line of a first request: what the process is doing, and what happens next."""
    again = "press Ctrl-C again" if signal_name == "SIGINT" else f"send {signal_name} again"
    if doing.startswith("step "):  # the loop reads the request when this step is done
        return f"{signal_name}: stopping after this step ({doing}), a checkpoint will be saved; {again} to stop at once"
    return f"{signal_name}: stopping (now: {doing}); {again} to stop at once"


def _print_line(line: str) -> None:
    try:
        print(line, flush=True)  # stdout, beside the step lines and the final "stopped by" line
    except Exception:  # a closed or broken stdout: the stop itself goes on
        pass


def at_once_line(signal_name: str, where: str) -> str:
    """The one line of a run stopped at once: the signal, what it interrupted, what stays."""
    return f"stopped at once by a second {signal_name} {where}"


def _caught(sig: int, frame) -> None:
    """The Python handler: nothing to do on the main thread (the watching thread acts); it
    keeps SIGINT from raising KeyboardInterrupt and SIGTERM from ending the process."""


REQUEST = StopRequest()


class Interrupted(Exception):
    """The launcher's view of a stop that saved nothing or stopped at once; the CLI prints
    the message as one line and exits 128 + the signal's number, as a shell does."""

    def __init__(self, message: str, signal_name: str):
        super().__init__(message)
        self.exit_code = 128 + signal.Signals[signal_name].value


def relayed() -> bool:
    """Whether our launcher received a stop signal (its elastic agent then stops the ranks
    and no longer collects what they return). A signal that reached only ranks leaves the
    agent collecting: the ranks must return then, or it waits for them forever."""
    notes = os.environ.get(NOTE_DIR)
    return bool(notes) and Path(notes, RELAY_MARK).exists()


def leave_note(signal_name: str, at_once: bool, where: str = "") -> bool:
    """A rank under our launcher records how it stopped (and, stopped at once, where: see
    at_once_line); False under any other launcher."""
    notes = os.environ.get(NOTE_DIR)
    if notes:
        Path(notes, f"stop-rank{os.environ.get('RANK', '0')}.json").write_text(
            json.dumps({"at_once": at_once, "where": where, "signal": signal_name}))
    return bool(notes)


def read_notes(notes: Path) -> list[dict]:
    """The ranks' stop notes (launcher side)."""
    return [json.loads(p.read_text()) for p in sorted(notes.glob("stop-rank*.json"))]
