"""Fault injection for the reliability tests: make one rank misbehave at one step.

    MESHTRAIN_FAULT="stall@3:1"          rank 1 hangs while reading the batch of step 3
    MESHTRAIN_FAULT="raise@3:1"          rank 1 raises a RuntimeError there
    MESHTRAIN_FAULT="kill@3:1"           rank 1 dies by SIGKILL there (as an OOM kill would)
    MESHTRAIN_FAULT="sigterm@3:1"        rank 1 alone receives SIGTERM there (a signal that
                                         reaches only some ranks)
    MESHTRAIN_FAULT="nan@3,nan@4"        every rank's gradients are NaN in steps 3 and 4
    MESHTRAIN_FAULT="savestall@3"        every rank hangs in each checkpoint save from step 3 on,
                                         once it has opened its first tensor file
    MESHTRAIN_FAULT="savekill@3:0"       rank 0 dies by SIGKILL there

The rank defaults to every rank. Unset (the normal case) it costs one lookup per step.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

ENV = "MESHTRAIN_FAULT"
KINDS = ("stall", "raise", "kill", "sigterm", "nan", "savestall", "savekill")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None


def parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            kind, _, where = item.partition("@")
            step, _, rank = where.partition(":")
            fault = Fault(kind, int(step), int(rank) if rank else None)
        except ValueError:
            fault = None
        if fault is None or fault.kind not in KINDS:
            raise ValueError(f"{ENV}={text!r}: give kind@step[:rank] items, kind one of {', '.join(KINDS)}")
        faults.append(fault)
    return faults


class Faults:
    def __init__(self, rank: int):
        self.faults = [f for f in parse(os.environ.get(ENV, "")) if f.rank in (None, rank)]

    def _due(self, kind: str, step: int) -> bool:
        return any(f.kind == kind and f.step == step for f in self.faults)

    def before_batch(self, step: int) -> None:
        """At the start of `step`, before its batch is read."""
        if not self.faults:
            return
        if self._due("stall", step):
            while True:
                time.sleep(3600)
        if self._due("raise", step):
            raise RuntimeError(f"injected fault ({ENV}) at step {step}")
        if self._due("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due("sigterm", step):
            os.kill(os.getpid(), signal.SIGTERM)

    def in_save(self, step: int) -> None:
        """Inside the checkpoint save of `step` (checkpoint.save's on_write): a save fault
        fires in every save from its step on, since a stop's save step is not known ahead."""
        if any(f.kind == "savestall" and step >= f.step for f in self.faults):
            while True:
                time.sleep(3600)
        if any(f.kind == "savekill" and step >= f.step for f in self.faults):
            os.kill(os.getpid(), signal.SIGKILL)

    def poison_gradients(self, step: int, params: dict) -> None:
        """Make this step's gradients NaN (a hook on one parameter, removed after it fires)."""
        if not self._due("nan", step):
            return
        name = next(n for n, p in params.items() if p.requires_grad)
        handles = []

        def hook(grad):
            handles.pop().remove()
            return grad * float("nan")

        handles.append(params[name].register_hook(hook))
