"""Run a function on N CPU processes joined by gloo, and get each rank's result back.

Every process group gets a timeout (a mismatched collective must fail, not hang), and
each rank's own exception is collected: the first real error is raised, not the peer's
"connection closed" that follows it.
"""

from __future__ import annotations

import datetime
import io
import os
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, queue, args, threads):
    import torch
    import torch.distributed as dist

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
_PRELOAD = ["torch", "torch.distributed.tensor", "meshtrain", "meshtrain.parallel.context", "meshtrain.train.step"]


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
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(results) + len(errors) < world:
            if datetime.datetime.now() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results) - set(errors))} "
                                   f"did not finish in {timeout} s")
            if queue.empty():
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
                import time

                time.sleep(0.05)
                continue
            rank, status, payload = queue.get()
            if status == "ok":
                import torch

                payload = torch.load(io.BytesIO(payload), weights_only=False)
            (results if status == "ok" else errors)[rank] = payload
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        # Prefer an error that is not a peer's hang-up.
        rank = min(errors, key=lambda r: ("Connection closed" in errors[r], r))
        raise RuntimeError(f"rank {rank} failed:\n{errors[rank]}")
    missing = sorted(set(range(world)) - set(results))
    if missing:
        raise RuntimeError(f"ranks {missing} exited without a result (exit codes "
                           f"{[procs[r].exitcode for r in missing]})")
    return [results[r] for r in range(world)]
