"""A run's checkpoint saves: synchronous, or written by a thread from staged copies
(checkpoint.async_save), with what each step logs of them (ckpt_stall_s: what the step
waited; ckpt_write_s: a finished write's seconds, with ckpt_write_step when it was an
earlier step's background write)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from .. import checkpoint


class Saves:
    """`mark(step, what)` tells the watchdog and a second stop signal what the run waits
    for; `extra()` is what a checkpoint keeps beside the tensors (data position, config,
    tokenizer); `in_save(step)` is the fault-injection hook inside a write."""

    def __init__(self, run_dir: Path, keep_last: int, background: bool, extra: Callable[[], dict],
                 mark: Callable[[int, str], None], in_save: Callable[[int], None]):
        self.root, self.keep_last = checkpoint.in_run(run_dir), keep_last
        self.extra, self.mark, self.in_save = extra, mark, in_save
        self.saver = checkpoint.BackgroundSaver() if background else None
        self.finished_everywhere = True  # every rank's background save had finished at the last step's end

    def reserve(self, state) -> None:
        """The staging buffers of background saves, before the first step."""
        if self.saver is not None:
            self.saver.reserve(state)

    @property
    def writing(self) -> bool:
        """A background save is in flight and has not finished on this rank."""
        return self.saver is not None and not self.saver.done()

    def save(self, state, before_commit=None) -> Path:
        """This step's checkpoint: written and committed, or with checkpoint.async_save
        begun and writing in the background (the directory it will have)."""
        step = state.step
        self.mark(step, "checkpoint save")
        save = checkpoint.save if self.saver is None else self.saver.save
        return save(self.root, step, state, self.extra(), self.keep_last, on_write=lambda: self.in_save(step),
                    before_commit=before_commit)

    def at_step(self, state, stop: int, log: Callable[[dict], None]) -> dict:
        """Save at this step, and `log` the step with the save's metrics before the
        checkpoint commits: a checkpoint on disk always has its step's metrics line. A
        synchronous save, and the run's last (nothing is left to overlap it with), log once
        written, just before the rename; a background one once staged."""
        start, done = time.perf_counter(), state.step
        finished = self.wait(done)
        background = self.saver is not None and done != stop

        def written() -> None:
            now = time.perf_counter() - start
            log({"ckpt_stall_s": now, "ckpt_write_s": now})

        path = self.save(state, before_commit=None if background else written)
        if background:
            log({"ckpt_stall_s": time.perf_counter() - start, **(_write_fields(finished) if finished else {})})
        else:
            self.wait(done)
        return {"path": path, "background": background}

    def written(self) -> dict:
        """The fields of a background write that every rank had finished by the end of the
        last step (`finished_everywhere`, agreed by the ranks), if one had."""
        if self.saver is None or not self.finished_everywhere:
            return {}
        finished = self.saver.wait()
        return {} if finished is None else _write_fields(finished)

    def wait(self, step: int) -> tuple[Path, float] | None:
        """Join the background save in flight, if any: (its checkpoint, write seconds)."""
        if self.saver is None or not self.saver.in_flight:
            return None
        self.mark(step, "waiting for the checkpoint written in the background")
        return self.saver.wait()

    def settle(self, step: int, report: Callable[[str], None]) -> None:
        """After an error stopped the loop: a save in the background finishes (or fails)
        before the error is reported; its own failure is reported here."""
        if self.saver is not None and self.saver.in_flight:
            try:
                self.wait(step)
            except checkpoint.CheckpointError as e:
                report(str(e))


def _write_fields(finished: tuple[Path, float]) -> dict:
    """A background write that finished: its seconds and its checkpoint's step (earlier
    than the step whose record it is logged with)."""
    path, seconds = finished
    return {"ckpt_write_s": seconds, "ckpt_write_step": int(path.name.removeprefix("step_"))}
