"""Publishing a directory by rename: what a reader sees is the old directory whole or the
new one whole, never a half-written one. Checkpoints, Hugging Face exports and a run's
export all publish this way (one place, so a crash-safety fix lands in all three)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import sys
from pathlib import Path

_RENAME_EXCHANGE = 2  # renameat2's flag: swap the two names in one step


_AT_FDCWD = -100


def rename(src: Path, dst: Path) -> None:
    """os.rename, by name here so tests can plant a crash at each rename."""
    os.rename(src, dst)


def exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux renameat2); False where the OS cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def fsync_dir(path: Path) -> None:
    """Make a directory's entries durable (a no-op where a directory cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: Path, value, indent: int = 2) -> None:
    """`value` as JSON with a final newline, on disk before this returns."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=indent)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def publish_dir(tmp: Path, final: Path, aside: Path) -> Path | None:
    """Put the finished directory `tmp` at `final` and return where the directory it
    replaced now is (the caller deletes it), or None if there was none. With an atomic
    swap there is no moment without a `final`; without one the old directory is moved to
    `aside` first, and put back if the second rename fails (a crash between the two
    leaves it whole at `aside`, for the caller's clean-up to restore)."""
    fsync_dir(tmp)
    replaced = None
    if not final.exists():
        rename(tmp, final)
    elif exchange(tmp, final):
        replaced = tmp
    else:
        if aside.exists():
            shutil.rmtree(aside)
        rename(final, aside)
        try:
            rename(tmp, final)
        except OSError:
            with contextlib.suppress(OSError):
                rename(aside, final)  # put it back now, not at the next start
            raise
        replaced = aside
    fsync_dir(final.parent)
    return replaced
