"""What the multi-rank CPU benches share: one verdict for every rank, and timing rounds
whose order alternates between the builds compared."""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist


def on_every_rank(ok: bool) -> bool:
    """True only when `ok` holds on every rank (one all-reduce)."""
    verdict = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    return verdict.item() == 0.0


def alternating_rounds(run, names: tuple[str, str], rounds: int, steps: int) -> dict[str, list[float]]:
    """Per name, each round's seconds for `steps` calls of run(name), the slowest rank's;
    the two names swap places every round, so neither always runs on a warmer machine."""
    seconds = {name: [] for name in names}
    for rnd in range(rounds):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                run(name)
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            seconds[name].append(took.item())
    return seconds
