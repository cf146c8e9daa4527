"""Where checkpoints live on disk, and the atomic publish, prune and clean-up around them
(the guarantees are in meshtrain/checkpoint/__init__.py)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from .. import files

META = "meta.json"


FORMAT_VERSION = 1


_FINAL = re.compile(r"^step_(\d{8,})$")


_LEFTOVER = re.compile(r"^\.(tmp|old|del)-step_(\d{8,})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded. The message names the path and the fix."""


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The final directory of the checkpoint at `step`."""
    return Path(root) / _name(step)


def _name(step: int) -> str:
    return f"step_{step:08d}"


def _first_os_error(mine: OSError | None, group=None) -> OSError | None:
    """The OSError of the lowest rank that saw one (every rank calls this together)."""
    _, world = _rank_world()
    if world == 1:
        return mine
    reports = _all_gather_bytes(b"" if mine is None else json.dumps(_os_report(mine)).encode(), group)
    return next((_os_error(json.loads(r)) for r in reports if r), None)


def _os_report(error: OSError) -> dict:
    def text(name):
        return None if name is None else os.fsdecode(name) if isinstance(name, (str, bytes)) else str(name)

    return {"errno": error.errno, "strerror": error.strerror, "filename": text(error.filename),
            "filename2": text(error.filename2), "message": str(error)}


def _os_error(info: dict) -> OSError:
    """The OSError an _os_report describes, as the same subclass (FileNotFoundError, ...)."""
    if info["errno"] is None:
        return OSError(info["message"])
    return OSError(info["errno"], info["strerror"], info["filename"], None, info["filename2"])


def _not_written(root: Path, final: Path, tmp: Path, error: OSError, doing: str) -> CheckpointError:
    """The error of a save the disk refused (every rank builds the same one); rank 0
    removes the partial temporary directory first, where the disk allows."""
    rank, _ = _rank_world()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    reason = os.strerror(error.errno) if error.errno else type(error).__name__
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free space on the disk of {root}, or copy the run_dir to another disk and point run_dir there"
    elif error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = f"make {root} writable, or copy the run_dir to a writable disk and point run_dir there"
    else:
        fix = "fix that, or copy the run_dir to another disk and point run_dir there"
    intact, previous = _intact(root)
    then = ("then run the command again (with no checkpoint it starts from the beginning)" if previous is None
            else f"then run the command again to resume from {previous.name}")
    return CheckpointError(f"checkpoint {final.name} could not be written under {root}: {reason} "
                           f"({doing}: {error}); {intact}; {fix}, {then}")


def _intact(root: Path) -> tuple[str, Path | None]:
    """What a failed write or cleanup left of the complete checkpoints under root, in
    words, and the latest of them."""
    try:
        previous = latest(root)
    except OSError as e:
        return f"no complete checkpoint was touched, but {root} cannot be listed ({e})", None
    if previous is None:
        return "no complete checkpoint exists there, so none is lost", None
    return f"the previous checkpoints are intact, the latest complete one is {previous}", previous


def _fresh_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _publish(root: Path, tmp: Path, final: Path, meta: dict, keep_last: int) -> None:
    """Rank 0: meta.json last, then the atomic rename, then pruning. An OSError before
    the new checkpoint is final leaves every complete checkpoint as it was; one after
    it (deleting the replaced or the oldest ones) is only a warning. Without an atomic
    swap the replaced one waits under .old-, where cleanup_incomplete puts it back."""
    files.write_json(tmp / META, meta, indent=1)
    replaced = files.publish_dir(tmp, final, aside=root / f".old-{final.name}")
    if replaced is not None:
        try:
            shutil.rmtree(replaced)
        except OSError as e:
            warnings.warn(f"checkpoint {final}: written, but the one it replaced could not be deleted from "
                          f"{replaced} ({e}); the next start removes it", stacklevel=3)
    _prune(root, keep_last, final)


def _prune(root: Path, keep_last: int, keep: Path) -> None:
    """Delete the oldest complete checkpoints beyond keep_last (never `keep`)."""
    try:
        others = [p for _, p in _complete(root) if p.name != keep.name]
    except OSError as e:
        warnings.warn(f"checkpoints under {root}: could not list them to keep the last {keep_last} ({e})",
                      stacklevel=3)
        return
    for path in others[:max(len(others) - (keep_last - 1), 0)]:
        trash = root / f".del-{path.name}"
        try:
            if trash.exists():
                shutil.rmtree(trash)
            files.rename(path, trash)  # it stops counting as complete at once
            files.fsync_dir(root)
            shutil.rmtree(trash)
        except OSError as e:
            warnings.warn(f"checkpoint {path}: could not delete it while keeping the last {keep_last} "
                          f"({e}); delete it by hand", stacklevel=3)


def read_meta(path: Path) -> dict | None:
    """meta.json if present and well formed, else None."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), int) for k in ("step", "world")):
        return None
    return meta


def _complete(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root, oldest step first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _FINAL.match(entry.name)
        if m and entry.is_dir() and read_meta(entry) is not None:
            found.append((int(m.group(1)), entry))
    return sorted(found)


def complete(root: str | os.PathLike) -> list[Path]:
    """Every complete checkpoint under root, oldest first."""
    return [path for _, path in _complete(Path(root))]


def latest(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under root, or None."""
    found = _complete(Path(root))
    return found[-1][1] if found else None


def in_run(run_dir: str | os.PathLike) -> Path:
    """Where a run_dir keeps its checkpoints: <run_dir>/checkpoints."""
    return Path(run_dir) / "checkpoints"


def newest_under(path: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of a run_dir, or of a checkpoints root; None if none."""
    return latest(in_run(path)) or latest(path)


def cleanup_incomplete(root: str | os.PathLike) -> None:
    """Remove what interrupted saves left under root: temporary and half-deleted
    directories and final-named ones without a valid meta.json; a checkpoint that was
    being replaced when the save died is put back. Every rank calls it when a process
    group exists (rank 0 alone touches the disk, the others wait for it)."""
    try:
        _on_rank0(lambda: _cleanup(Path(root)), f"clean up {root}")
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else type(e).__name__
        raise CheckpointError(f"checkpoints under {root}: could not remove what an interrupted save left there: "
                              f"{reason} ({e}); {_intact(Path(root))[0]}; make {root} writable (or free space on its "
                              "disk), then run the command again") from None


def _cleanup(root: Path) -> None:
    if not root.is_dir():
        return
    entries = sorted(root.iterdir())
    for entry in entries:
        if _FINAL.match(entry.name) and entry.is_dir() and read_meta(entry) is None:
            shutil.rmtree(entry)
    for entry in entries:
        m = _LEFTOVER.match(entry.name)
        if not m or not entry.exists():
            continue
        final = root / f"step_{m.group(2)}"
        if m.group(1) == "old" and not final.exists() and read_meta(entry) is not None:
            files.rename(entry, final)
        elif entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    files.fsync_dir(root)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _comm_device(group=None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _on_rank0(fn: Callable[[], None], what: str, group=None) -> None:
    """fn() on rank 0; every other rank waits for it and fails if it failed: with the same
    OSError (so that every rank reports a disk error alike), else a CheckpointError
    quoting rank 0's. `group`: the process group of all ranks to use (default: the
    default group)."""
    rank, world = _rank_world()
    if world == 1:
        fn()
        return
    error = None
    if rank == 0:
        try:
            fn()
        except BaseException as e:  # tell the other ranks before raising
            error = e
    report = b""
    if isinstance(error, OSError):
        report = json.dumps(_os_report(error)).encode()
    elif error is not None:
        report = json.dumps({"type": type(error).__name__, "message": str(error)}).encode()
    device = _comm_device(group)
    size = torch.tensor([len(report)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0, group=group)
    if int(size.item()):
        data = torch.frombuffer(bytearray(report), dtype=torch.uint8).to(device) if rank == 0 else \
            torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(data, src=0, group=group)
        report = data.cpu().numpy().tobytes()
    if error is not None:
        raise error
    if report:
        info = json.loads(report)
        if "errno" in info:
            raise _os_error(info)
        raise CheckpointError(f"rank 0 failed to {what}: {info['type']}: {info['message']}")


def _all_gather_bytes(data: bytes, group=None) -> list[bytes]:
    """Every rank's bytes, by rank (uint8 all_gather, no pickling)."""
    _, world = _rank_world()
    if world == 1:
        return [data]
    device = _comm_device(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(s.item()) for s in sizes]
    mine = torch.zeros(max(max(sizes), 1), dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return [t.cpu().numpy().tobytes()[:n] for n, t in zip(sizes, gathered)]
