"""`python ctrl_c_mid_spawn.py -m meshtrain.cli fit ...`: the CLI, with a Ctrl-C (SIGINT to
the whole process group) sent right after the agent started its second rank, while it
still spawns the others: the moment a terminal's Ctrl-C can only hit by chance."""

import os
import runpy
import signal
import sys
from multiprocessing import context

_start = context.SpawnProcess.start
_started = []


def _start_then_interrupt(process) -> None:
    _start(process)
    _started.append(process)
    if len(_started) == 2:
        os.killpg(0, signal.SIGINT)


if __name__ == "__main__":  # the spawned ranks import this file too: they patch nothing
    assert sys.argv[1:3] == ["-m", "meshtrain.cli"], sys.argv
    context.SpawnProcess.start = _start_then_interrupt
    sys.argv = [sys.argv[0], *sys.argv[3:]]
    runpy.run_module("meshtrain.cli", run_name="__main__")
