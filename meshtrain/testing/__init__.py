"""Run a function on N CPU processes joined by gloo, and get each rank's result back.

Every process group gets a timeout (a mismatched collective must fail, not hang), and
each rank's own exception is collected: the cause is raised, not the peers' "connection
reset" that follows it, and a rank that dies without a report is named with its signal.
"""

from __future__ import annotations

import datetime
import faulthandler
import io
import os
import signal
import socket
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import lost_peer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, queue, args, threads):
    # A rank that dies in C++ (SIGABRT, SIGSEGV) leaves its Python stacks on stderr: CI once
    # saw a rank abort without a word, its stderr full of torch's DTensor warning below.
    faulthandler.enable(all_threads=True)
    warnings.filterwarnings("ignore", message="To construct DTensor from torch.Tensor")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        result = fn(*args)
        # Serialise by value: tensors shared by file descriptor die with this process.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Ranks fork from one server process that has imported these once: a spawned rank spends
# seconds importing torch, and a suite launches ranks dozens of times.
_PRELOAD = ["torch", "torch.distributed.tensor", "meshtrain", "meshtrain.parallel.context", "meshtrain.train.step",
            "meshtrain.testing.warmup"]


_ERROR_GRACE_S = 5


def _exit_reason(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        return f"signal {name}" + (": out of memory?" if name == "SIGKILL" else "")
    return f"exit code {code}"


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 600, threads: int = 1,
              start: str = "forkserver") -> list[Any]:
    """fn(*args) on `world` gloo ranks; returns the results by rank. start="spawn" for
    ranks that compile with inductor, which compiles slower in forked ranks (measured on 2
    cores: 87 s forked vs 64 s spawned for tests/test_equivalence.py's inductor layouts)."""
    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, queue, args, threads), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            if time.monotonic() > deadline:
                if errors:
                    break
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results) - set(errors))} "
                                   f"did not finish in {timeout} s")
            if queue.empty():
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
                time.sleep(0.05)
                continue
            rank, status, payload = queue.get()
            if status == "ok":
                payload = torch.load(io.BytesIO(payload), weights_only=False)
            elif not errors:
                # The failing rank's own report can arrive after its peers' "connection
                # reset" (gloo closes the pair before Python unwinds): wait briefly for it.
                deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
            (results if status == "ok" else errors)[rank] = payload
    finally:
        killed = set()
        for r, p in enumerate(procs):
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                killed.add(r)
    silent = {r: _exit_reason(procs[r].exitcode) for r in range(world)
              if r not in results and r not in errors and r not in killed and procs[r].exitcode not in (None, 0)}
    if errors or silent:
        # The cause first: a rank's own error, then a rank that died without a word (killed,
        # crashed), and only then a peer's reaction to either.
        causes = [(lost_peer(e), r, f"rank {r} failed:\n{e}") for r, e in errors.items()]
        causes += [(False, world + r, f"rank {r} died without a report ({why})") for r, why in silent.items()]
        raise RuntimeError(min(causes)[2])
    missing = sorted(set(range(world)) - set(results))
    if missing:
        raise RuntimeError(f"ranks {missing} exited without a result (exit codes "
                           f"{[procs[r].exitcode for r in missing]})")
    return [results[r] for r in range(world)]
