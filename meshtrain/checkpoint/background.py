"""Checkpoints written in the background (checkpoint.async_save): the step waits only while
the state is copied to host memory, and a thread writes and commits the checkpoint.

`BackgroundSaver.save` waits for the save before it (raising its CheckpointError, if it
failed), begins the checkpoint on the calling thread (temporary directory, meta.json's
content with every rank's RNG states: store.begin), copies every tensor into staging
buffers made once (`reserve`, which a run calls at start, or the first save) and reused
(pinned host memory when the tensors live on a GPU), and returns. A thread then runs `Pending.finish` on the copies: DCP's tensor files,
the barrier, meta.json and the atomic rename by rank 0, pruning. Its collectives run on a
gloo process group of their own, made at the first save, so they never meet the
training's collectives on the default group. Until the rename the checkpoint is a
`.tmp-` directory, which `latest` never returns and `cleanup_incomplete` removes: a crash
at any moment leaves the previous checkpoint the latest. At most one save is in flight;
`wait` (the next save, the end of a run, a stop signal, an error, an export) joins it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..layout.placements import local_tensor
from .layout import _rank_world
from .store import Pending, TrainState, begin


class BackgroundSaver:
    """One run's checkpoints written in the background, one at a time (module docstring)."""

    def __init__(self):
        self._staging: dict[tuple, torch.Tensor] = {}
        self._group = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._written: tuple[Path, float] | None = None  # (checkpoint, seconds) of the last finished write

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def reserve(self, state: TrainState) -> None:
        """Make the staging buffers of `state` now (zeroed, so their pages exist), so that
        the first save copies instead of allocating 1x the state (a run calls it at start)."""
        self._stage(state, copy=False)

    def save(self, root, step: int, state: TrainState, extra: dict, keep_last: int,
             on_write: Callable[[], None] | None = None, before_commit: Callable[[], None] | None = None) -> Path:
        """Begin the checkpoint of `step` and write it in the background; returns the
        directory it will have once committed. Every rank calls it. `before_commit` runs
        on the writing thread before the rename, as store.save's."""
        self.wait()
        pending = begin(root, step, extra, keep_last, state)
        tensors = self._stage(state)
        if self._group is None and _rank_world()[1] > 1:
            self._group = dist.new_group(backend="gloo")
        self._thread = threading.Thread(target=self._finish, args=(pending, tensors, on_write, before_commit),
                                        name=f"checkpoint-{pending.final.name}", daemon=True)
        self._thread.start()
        return pending.final

    def wait(self) -> tuple[Path, float] | None:
        """Join the save in flight: (its checkpoint, the seconds it wrote for) once
        committed, None when none was in flight; its CheckpointError if it failed."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        done, self._written = self._written, None
        return done

    def done(self) -> bool:
        """True when nothing is in flight or the save in flight has finished."""
        return self._thread is None or not self._thread.is_alive()

    def _finish(self, pending: Pending, tensors: dict, on_write, before_commit) -> None:
        start = time.perf_counter()
        try:
            final = pending.finish(tensors, on_write, self._group, before_commit)
            self._written = (final, time.perf_counter() - start)
        except BaseException as e:  # raised by wait(), on the training thread
            self._error = e

    def _stage(self, state: TrainState, copy: bool = True) -> dict:
        """The state's tensors copied into the staging buffers, as DCP saves them."""
        def stage(key, t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            local = local_tensor(t)
            buf = self._staging.get(key)
            if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                buf = torch.zeros(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
                self._staging[key] = buf
            if copy:
                buf.copy_(local, non_blocking=local.is_cuda)
            if not isinstance(t, DTensor):
                return buf
            # The DTensor's own spec on the host copy (from_local would move it back to the
            # mesh's device): DCP reads only its global shape and this rank's offsets.
            return DTensor(buf, t._spec, requires_grad=False)

        out = {"params": {n: stage(("params", n), t) for n, t in state.params.items()},
               "optimizer": {k: {n: stage((k, n), t) for n, t in group.items()}
                             for k, group in state.optimizer.items()}}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the copies are in host memory before training goes on
        return out
