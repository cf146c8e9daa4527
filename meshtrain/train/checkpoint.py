"""Checkpoints for `meshtrain fit`, written with torch.distributed.checkpoint (DCP).

On disk, under a root directory:

    <root>/step_00000100/        one complete checkpoint (8-digit zero-padded step)
        .metadata, __<rank>_0.distcp   DCP files of the tensors {"params": {name: t},
                                 "optimizer": {"exp_avg": {name: t}, "exp_avg_sq": {name: t}}}
        meta.json                written last: step, world, the caller's `extra`, and
                                 every rank's RNG states (base64 text), by rank
    <root>/.tmp-step_00000200/   a save in progress (or interrupted): never loaded
    <root>/.old-step_..., .del-step_...   a replaced / pruned checkpoint on its way out

Guarantees:
- A checkpoint is complete when it has its final name and a parseable meta.json; only
  complete checkpoints are found by `latest` or pruned by `save`. Every rank writes into
  the temporary directory, rank 0 then writes and fsyncs meta.json and renames the
  directory into place (an existing one of the same step is swapped out atomically where
  the OS can, renameat2 RENAME_EXCHANGE on Linux), fsyncs the parent directory, and only
  then deletes checkpoints beyond `keep_last`. A crash at any moment leaves the previous
  latest checkpoint as the latest, or the new one complete; `cleanup_incomplete` removes
  the leftovers (and puts back a replaced checkpoint whose replacement never landed).
- A save that fails on the disk (no space left, a read-only file system, any OSError
  while creating, writing, fsyncing or renaming) raises one CheckpointError on every
  rank: which checkpoint could not be written where, the OS reason, the latest complete
  checkpoint (untouched: nothing older is deleted before the new one is final) and the
  fix; the partial temporary directory is removed where the disk allows. Failing to
  delete old checkpoints after the new one is final is a warning, not a failed save.
- Any layout loads any other and a single process loads a sharded checkpoint: DCP
  reshards DTensors by global offsets. Parameter names and global shapes are checked
  first, and every failure is a `CheckpointError` naming the path and the fix.
- Loading never unpickles code: tensors are read by DCP with torch.load(weights_only=True)
  and DCP's `.metadata` (a pickle) is read by an unpickler that only admits DCP's own
  metadata classes, torch.Size and dtypes. RNG states travel between ranks as uint8
  tensors (all_gather), not pickled objects.
- With a process group, every rank calls `save`, `load` and `cleanup_incomplete`, and
  `root` must be one shared filesystem; rank 0 alone writes meta.json and renames or
  deletes directories. Without one, a single process saves and loads plain tensors.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import importlib
import json
import os
import pickle
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.api import CheckpointException

if TYPE_CHECKING:
    from .step import TrainState

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


# --------------------------------------------------------------------------- save


def save(root: str | os.PathLike, step: int, state: TrainState, extra: dict, keep_last: int,
         on_write: Callable[[], None] | None = None) -> Path:
    """Write `state` (a TrainState: params, optimizer, step) as the checkpoint of `step`
    under `root` and return its directory. Every rank calls it when a process group
    exists; it returns on no rank before the checkpoint is final and pruned. `on_write`
    runs when this rank has opened its first tensor file (the fault injection's hook)."""
    root = Path(root)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint under {root}: step={step!r} must be an int >= 0")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise CheckpointError(f"checkpoint under {root}: keep_last={keep_last!r} must be an int >= 1 "
                              "(the newest checkpoints to keep)")
    try:
        extra_json = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint under {root}: `extra` must be JSON-serialisable ({e}); "
                              "convert it to dicts, lists, strings and numbers") from None
    final = root / _name(step)
    tmp = root / f".tmp-{final.name}"
    rank, world = _rank_world()
    doing = "creating its temporary directory"
    try:
        # Rank 0 empties the temporary directory before anyone writes into it.
        _on_rank0(lambda: _fresh_dir(tmp), f"create {tmp}")
        doing = "writing the tensor files"
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        writer.fs = _RecordingFileSystem(on_write)
        try:
            with _quiet_dcp():
                dcp.save(_tensors(state), storage_writer=writer)
        except CheckpointException as e:
            # torch.save turns a failed write into "RuntimeError: ... unexpected pos": the
            # OSError that a rank's stream saw says why, and every rank learns it.
            error = _first_os_error(writer.fs.error) or _failure(e)[1]
            if not isinstance(error, OSError):
                raise
            raise error from None
        # An all_gather completes on no rank before every rank has finished dcp.save, so it
        # is also the barrier between the tensor files and meta.json.
        rng = _gather_rng()
        meta = {"format": FORMAT_VERSION, "step": step, "world": world, "extra": extra_json, "rng": rng}
        doing = f"writing {META} and renaming the directory into place"
        _on_rank0(lambda: _publish(root, tmp, final, meta, keep_last), f"finish checkpoint {final}")
    except OSError as e:
        raise _not_written(root, final, tmp, e, doing) from None
    return final


class _RecordingFileSystem(dcp_filesystem.FileSystem):
    """DCP's file system, remembering the first OSError of a write to one of its streams."""

    def __init__(self, on_write: Callable[[], None] | None = None):
        super().__init__()
        self.error: OSError | None = None
        self.on_write = on_write

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if self.on_write is not None and "w" in mode:
                self.on_write, on_write = None, self.on_write
                on_write()
            yield _RecordingStream(stream, self, path) if "w" in mode or "a" in mode else stream


class _RecordingStream:
    def __init__(self, stream, fs: _RecordingFileSystem, path):
        self._stream, self._fs, self._path = stream, fs, path

    def _record(self, fn, *args):
        try:
            return fn(*args)
        except OSError as e:
            if self._fs.error is None:  # a buffered write's error does not name the file
                self._fs.error = e if e.filename is not None or e.errno is None else \
                    OSError(e.errno, e.strerror, os.fspath(self._path))
            raise

    def write(self, data):
        return self._record(self._stream.write, data)

    def flush(self):
        return self._record(self._stream.flush)

    def close(self):
        return self._record(self._stream.close)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _first_os_error(mine: OSError | None) -> OSError | None:
    """The OSError of the lowest rank that saw one (every rank calls this together)."""
    _, world = _rank_world()
    if world == 1:
        return mine
    reports = _all_gather_bytes(b"" if mine is None else json.dumps(_os_report(mine)).encode())
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


def _tensors(state) -> dict:
    return {"params": {n: t.detach() for n, t in state.params.items()},
            "optimizer": {k: {n: t.detach() for n, t in group.items()} for k, group in state.optimizer.items()}}


def _fresh_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _publish(root: Path, tmp: Path, final: Path, meta: dict, keep_last: int) -> None:
    """Rank 0: meta.json last, then the atomic rename, then pruning. An OSError before
    the new checkpoint is final leaves every complete checkpoint as it was; one after
    it (deleting the replaced or the oldest ones) is only a warning."""
    with open(tmp / META, "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    replaced = None  # where the checkpoint this one replaces went, to be deleted
    if not final.exists():
        _rename(tmp, final)
    elif _exchange(tmp, final):
        replaced = tmp
    else:
        # No atomic swap: move the old one aside first. A crash between the two renames
        # leaves it complete under .old-, and cleanup_incomplete puts it back.
        old = root / f".old-{final.name}"
        if old.exists():
            shutil.rmtree(old)
        _rename(final, old)
        try:
            _rename(tmp, final)
        except OSError:
            with contextlib.suppress(OSError):
                _rename(old, final)  # put it back now, not at the next start
            raise
        replaced = old
    _fsync_dir(root)
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
            _rename(path, trash)  # it stops counting as complete at once
            _fsync_dir(root)
            shutil.rmtree(trash)
        except OSError as e:
            warnings.warn(f"checkpoint {path}: could not delete it while keeping the last {keep_last} "
                          f"({e}); delete it by hand", stacklevel=3)


def _rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
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


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms that cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- find


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
            _rename(entry, final)
        elif entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    _fsync_dir(root)


# --------------------------------------------------------------------------- load


def load(path: str | os.PathLike, state: TrainState, model_names=None) -> dict:
    """Load the checkpoint at `path` into state.params and state.optimizer in place (any
    layout, or plain tensors in one process), set state.step, restore this rank's RNG
    states when the world size is the one it was saved with, and return meta.json's dict.
    `model_names`: every parameter name of the model, when state.params holds only some
    of them (a pipeline stage's); the checkpoint must hold no other."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist: pass a step_XXXXXXXX directory written "
                              "by save(), e.g. latest(root)")
    if not (path / META).is_file():
        raise CheckpointError(f"checkpoint {path} has no {META}, so its save never finished: load a "
                              "complete one (latest(root) finds it) or delete this directory")
    meta = read_meta(path)
    if meta is None:
        raise CheckpointError(f"checkpoint {path}: {META} is corrupt (not JSON with integer step and world): "
                              "load another checkpoint (latest(root)) or delete this one")
    reader = _SafeReader(path)
    metadata = reader.read_metadata()
    _check_layout(path, metadata, state, set(state.params if model_names is None else model_names))
    try:
        with _quiet_dcp(), torch.no_grad():
            dcp.load(_tensors(state), storage_reader=_SafeReader(path))
    except CheckpointException as e:  # a missing or damaged tensor file: name it in one line
        rank, cause = _failure(e)
        # The first sentence: torch's weights-only refusal goes on to advise unsafe loading.
        detail = str(cause).splitlines()[0].split(". ")[0] if str(cause) else "no detail"
        raise CheckpointError(f"checkpoint {path}: reading the tensors failed on rank {rank} "
                              f"({type(cause).__name__}: {detail}); the files are damaged: load an earlier "
                              "checkpoint or delete this one") from None
    state.step = meta["step"]
    rank, world = _rank_world()
    rng = meta.get("rng")
    if meta["world"] == world and isinstance(rng, list) and len(rng) == world:
        try:
            _set_rng(rng[rank])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path}: {META} has a corrupt RNG state for rank {rank} ({e}): "
                                  "load another checkpoint (latest(root)) or delete this one") from None
    return meta


def _failure(e: CheckpointException) -> tuple[int, BaseException]:
    """The rank and the exception behind DCP's CheckpointException (an OSError first)."""
    causes = [(rank, f[0] if isinstance(f, tuple) else getattr(f, "exc", f))  # (exc, frames)
              for rank, f in sorted(e.failures.items())]
    return next((c for c in causes if isinstance(c[1], OSError)), causes[0] if causes else (-1, e))


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata admitting only plain-data classes: no code runs."""

    _ALLOWED = {
        ("torch.distributed.checkpoint.metadata", n) for n in
        ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
         "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    } | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
         ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")} | {
        ("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")}

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"checkpoint {self.path}: .metadata refers to {module}.{name}, which is not "
                              "DCP metadata, so it is not loaded; use a checkpoint written by save()")


class _SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose .metadata is read without running code from the file."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        file = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        try:
            with open(file, "rb") as f:
                metadata = _MetadataUnpickler(f, Path(self.path)).load()
        except CheckpointError:
            raise
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {self.path} has no DCP {file.name}: it is incomplete or not a "
                                  "meshtrain checkpoint; load another one (latest(root))") from None
        except Exception as e:
            raise CheckpointError(f"checkpoint {self.path}: DCP {file.name} is unreadable "
                                  f"({type(e).__name__}: {e}); load another checkpoint") from None
        _check_files(Path(self.path), file, metadata)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_files(path: Path, file: Path, metadata) -> None:
    """Every tensor the metadata names lies in a file of the checkpoint directory itself
    (a plain name, no path), and none is a pickled object (DCP loads those with full
    unpickling; meshtrain saves only tensors)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            raise CheckpointError(f"checkpoint {path}: DCP {file.name} lists {fqn!r} as a pickled object, which "
                                  "meshtrain never saves and does not load; load another checkpoint")
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or Path(name).name != name or name in (".", "..") or \
                (path / name).resolve().parent != path.resolve():
            raise CheckpointError(f"checkpoint {path}: DCP {file.name} names the tensor file {name!r}, which is not "
                                  "a file of this directory; the metadata is damaged or hostile: load another "
                                  "checkpoint")


def _check_layout(path: Path, metadata, state, model_names: set) -> None:
    """Names and global shapes in the checkpoint against the state's, and no name the
    model lacks; the first difference is a CheckpointError."""
    saved: dict[tuple, tuple] = {}
    planner_data = getattr(metadata, "planner_data", None) or {}
    for fqn, md in metadata.state_dict_metadata.items():
        if hasattr(md, "size"):
            key = tuple(planner_data.get(fqn, tuple(fqn.split(".", 2 if fqn.startswith("optimizer.") else 1))))
            saved[key] = tuple(md.size)
    groups = [("parameter", ("params",), state.params)] + \
        [(f"optimizer {k} of", ("optimizer", k), group) for k, group in state.optimizer.items()]
    fix = "load it with the model config it was saved with, or start fresh"
    for what, prefix, tensors in groups:
        for name, t in tensors.items():
            shape = tuple(t.shape)
            key = prefix + (name,)
            if key not in saved:
                raise CheckpointError(f"checkpoint {path}: {what} {name} (shape {shape}) is in the model but not "
                                      f"in the checkpoint: {fix}")
            if saved[key] != shape:
                raise CheckpointError(f"checkpoint {path}: {what} {name} has shape {saved[key]} in the "
                                      f"checkpoint but {shape} in the model: {fix}")
        for key, shape in saved.items():
            if key[:len(prefix)] == prefix and key[-1] not in model_names:
                raise CheckpointError(f"checkpoint {path}: {what} {key[-1]} (shape {shape}) is in the checkpoint "
                                      f"but not in the model: {fix}")


# --------------------------------------------------------------------------- ranks and RNG


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _on_rank0(fn: Callable[[], None], what: str) -> None:
    """fn() on rank 0; every other rank waits for it and fails if it failed: with the same
    OSError (so that every rank reports a disk error alike), else a CheckpointError
    quoting rank 0's."""
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
    device = _comm_device()
    size = torch.tensor([len(report)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if int(size.item()):
        data = torch.frombuffer(bytearray(report), dtype=torch.uint8).to(device) if rank == 0 else \
            torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(data, src=0)
        report = data.cpu().numpy().tobytes()
    if error is not None:
        raise error
    if report:
        info = json.loads(report)
        if "errno" in info:
            raise _os_error(info)
        raise CheckpointError(f"rank 0 failed to {what}: {info['type']}: {info['message']}")


def _rng_bytes() -> tuple[bytes, bytes]:
    cpu = torch.get_rng_state().numpy().tobytes()
    cuda = b""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state().numpy().tobytes()
    return cpu, cuda


def _all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's bytes, by rank (uint8 all_gather, no pickling)."""
    _, world = _rank_world()
    if world == 1:
        return [data]
    device = _comm_device()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    sizes = [int(s.item()) for s in sizes]
    mine = torch.zeros(max(max(sizes), 1), dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return [t.cpu().numpy().tobytes()[:n] for n, t in zip(sizes, gathered)]


def _gather_rng() -> list[dict]:
    """Every rank's RNG states, by rank, as base64 text (uint8 all_gather, no pickling)."""
    cpu, cuda = _rng_bytes()
    return [{"cpu": base64.b64encode(a).decode("ascii"), "cuda": base64.b64encode(b).decode("ascii") if b else None}
            for a, b in zip(_all_gather_bytes(cpu), _all_gather_bytes(cuda))]


def _set_rng(entry: dict) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()

    torch.set_rng_state(tensor(entry["cpu"]))
    if entry.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor(entry["cuda"]))


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns on every call without a process group; that is our single-process mode."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
