"""Worker pools for CPU work that starts no ranks (tokenizing, the layout search): started
from a forkserver where there is one. A worker forked from the caller itself inherits
whatever locks the caller's other threads held at the fork, and its signal handlers (seen
under pytest: a worker waited on a lock for ever). As with any spawned worker, a caller's
script needs its `if __name__ == "__main__":` guard."""

from __future__ import annotations

import multiprocessing as mp


def clean_pool(workers: int, preload: str, **kwargs):
    """A multiprocessing Pool of `workers`; the forkserver imports module `preload` once,
    so each worker starts with it imported. kwargs: Pool's (initializer, initargs)."""
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else None)
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload([preload])
    return ctx.Pool(workers, **kwargs)
