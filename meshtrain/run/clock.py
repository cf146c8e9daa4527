"""The times of one start's steps. Its first step (compile, allocator and first-collective
warm-up) is its own (warmup_s), left out of tokens/s and the ETA: the rates of step k are
over steps 2..k, or since the last logged step, and evaluation time is not training time."""

from __future__ import annotations

import time


class StepClock:
    def __init__(self, first_step: int, stop: int, tokens_per_step: int, compiled: bool):
        self.first_step, self.stop, self.tokens_per_step, self.compiled = first_step, stop, tokens_per_step, compiled
        self.start = self.warm = time.perf_counter()
        self.warmup_s: float | None = None
        self.last_time, self.last_step = self.start, first_step

    def stepped(self) -> float | None:
        """Call after each step: the first step's seconds, once (None after)."""
        if self.warmup_s is not None:
            return None
        self.warm = time.perf_counter()
        self.warmup_s = self.warm - self.start
        return self.warmup_s

    def fields(self, done: int) -> dict:
        """step_time_s, tokens_per_s, elapsed_s and eta_s of a record at step `done`."""
        now = time.perf_counter()
        if self.last_step == self.first_step:  # the window starts after the warm-up step
            self.last_time, self.last_step = self.warm, self.first_step + 1
        steps = done - self.last_step
        step_time = (now - self.last_time) / steps if steps else self.warmup_s
        # A compiled run's first step is mostly compiling: no rate from it.
        known = steps or not self.compiled
        after_warmup = done - self.first_step - 1
        # No ETA from the warm-up step alone: it is slower than the rest.
        eta = (now - self.warm) / after_warmup * (self.stop - done) if after_warmup else None
        return {"tokens_per_s": self.tokens_per_step / step_time if known else None, "step_time_s": step_time,
                "elapsed_s": now - self.start, "eta_s": eta}

    def window(self, done: int) -> None:
        """The next rates start here (after a record and its evaluation)."""
        self.last_time, self.last_step = time.perf_counter(), done

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
