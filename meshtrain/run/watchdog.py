"""The hang watchdog: a rank that makes no progress for `timeout_s` names the culprit and
ends the job, instead of waiting in a collective until the cluster's time limit.

The training loop marks its progress (`mark(step, operation)`: a few attribute writes,
no I/O). A daemon thread publishes the mark and a heartbeat to the process group's store
every second, and checks its own rank. When its rank has not moved for `timeout_s`, it
reads every rank's last mark and heartbeat and names the stalled rank(s):

- a rank whose heartbeat stopped (a frozen or dead process), else
- the ranks behind the others (the others wait for them in a collective), else
- every rank, all in the same operation (a collective that never completes).

It leaves that, with its own rank's Python stack (where the main thread is stuck), as the
rank's failure report for our launcher (a waiting rank a few seconds after the stalled
one, so that the stalled rank's report is the one shown), or prints it under torchrun,
and exits with status 3.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

from .launch import report_failure

EXIT_STALLED = 3
TRAIN_STEP = "forward, backward and optimizer update"  # the operation that includes the first compile
_KEY = "meshtrain/watchdog/{}"


class Watchdog:
    def __init__(self, rank: int, world: int, timeout_s: float, store=None, interval_s: float = 1.0):
        self.rank, self.world, self.timeout_s, self.store = rank, world, timeout_s, store
        self.interval_s = min(interval_s, timeout_s / 4)
        self.seq, self.step, self.op, self.since = 0, 0, "starting", time.time()
        self.first_step: int | None = None
        self._main = threading.get_ident()  # the training loop's thread, whose stack a report shows
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="meshtrain-watchdog", daemon=True)
        self._thread.start()

    def mark(self, step: int, op: str) -> None:
        """This rank now works on `op` of `step` (called by the training loop's thread)."""
        if self.first_step is None and op == TRAIN_STEP:
            self.first_step = step
        self.seq, self.step, self.op, self.since = self.seq + 1, step, op, time.time()

    def stop(self) -> None:
        self._stop.set()

    # --- the thread ------------------------------------------------------------------

    def _state(self) -> dict:
        return {"rank": self.rank, "seq": self.seq, "step": self.step, "op": self.op, "since": self.since,
                "beat": time.time()}

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.store is not None:
                try:
                    self.store.set(_KEY.format(self.rank), json.dumps(self._state()))
                except Exception:  # the store's host is gone: the job is ending anyway
                    pass
            if time.time() - self.since > self.timeout_s and not self._stop.is_set():
                self._fire()

    def _peers(self) -> list[dict]:
        if self.store is None:
            return [self._state()]
        def unknown(rank: int, op: str, beat: float) -> dict:
            return {"rank": rank, "seq": -1, "step": 0, "op": op, "since": 0.0, "beat": beat}

        states = []
        for r in range(self.world):
            key = _KEY.format(r)
            try:
                states.append(json.loads(self.store.get(key)) if self.store.check([key]) else
                              unknown(r, "not started", beat=0.0))
            except Exception:
                states.append(self._state() if r == self.rank else
                              unknown(r, "unknown (the store is unreachable)", beat=time.time()))
        return states

    def diagnose(self, states: list[dict], now: float) -> tuple[str, list[int]]:
        """The message naming the stalled rank(s), and their ranks, from every rank's last
        state."""
        frozen = [s for s in states if now - s["beat"] > max(5 * self.interval_s, 3.0)]
        ahead = max(s["seq"] for s in states)
        behind = [s for s in states if s["seq"] < ahead]
        stalled = frozen or behind or states
        waiting = [s for s in states if s not in stalled]

        def where(s: dict) -> str:
            return f"step {s['step']} in '{s['op']}'"

        parts = []
        for s in stalled:
            why = "stopped responding (no heartbeat)" if s in frozen else "stalled"
            parts.append(f"rank {s['rank']} {why} at {where(s)}, no progress for {now - s['since']:.0f} s")
        message = f"watchdog: {'; '.join(parts)} (parallel.watchdog_s={self.timeout_s:g})"
        if waiting:
            groups: dict[str, list[int]] = {}
            for s in waiting:
                groups.setdefault(where(s), []).append(s["rank"])
            who = {w: f"ranks {', '.join(map(str, r))} wait" if len(r) > 1 else f"rank {r[0]} waits"
                   for w, r in groups.items()}
            message += "; " + "; ".join(f"{names} at {w}" for w, names in who.items())
        elif len(states) > 1:
            message += ": every rank is in the same operation, so a collective in it never completed"
        if self.first_step is None or self.step == self.first_step:
            message += ". The first step also compiles and warms up: if it is only slow, raise parallel.watchdog_s"
        else:
            message += ". If that operation is only slow (a large checkpoint, a long evaluation), raise " \
                       "parallel.watchdog_s"
        return message, [s["rank"] for s in stalled]

    def _fire(self) -> None:
        message, stalled = self.diagnose(self._peers(), time.time())
        if self.rank not in stalled:
            # A waiting rank reports after the stalled one, whose report (with the stack
            # of where it is stuck) the launcher then shows first.
            time.sleep(3 * self.interval_s)
        frame = sys._current_frames().get(self._main)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        where = f"rank {self.rank}'s main thread was here:\n{stack}"
        if not report_failure({"rank": self.rank, "time": time.time(), "type": "Stalled", "message": message,
                               "bad_input": None, "traceback": where}):
            print(f"meshtrain: {message}\n{where}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_STALLED)
