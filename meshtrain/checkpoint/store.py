"""save and load: a TrainState (parameters, AdamW moments, every rank's RNG) to and from
one checkpoint directory."""

from __future__ import annotations

import base64
import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.api import CheckpointException

from ..train.loss_scale import ScaleState
from .layout import (FORMAT_VERSION, META, CheckpointError, _all_gather_bytes, _first_os_error,
                     _fresh_dir, _name, _not_written, _on_rank0, _publish, _rank_world, read_meta)
from .reader import SafeReader, _check_layout, _failure, quiet_dcp


class TrainState(Protocol):
    """What a checkpoint holds of a run (meshtrain.train.step.TrainState has it)."""
    params: dict
    optimizer: dict  # {"exp_avg": {name: tensor}, "exp_avg_sq": {name: tensor}}
    step: int


def save(root: str | os.PathLike, step: int, state: TrainState, extra: dict, keep_last: int,
         on_write: Callable[[], None] | None = None, before_commit: Callable[[], None] | None = None) -> Path:
    """Write `state` (a TrainState: params, optimizer, step) as the checkpoint of `step`
    under `root` and return its directory. Every rank calls it when a process group
    exists; it returns on no rank before the checkpoint is final and pruned. `on_write`
    runs when this rank has opened its first tensor file (the fault injection's hook);
    `before_commit` once every rank's files are written, before the rename (a run logs
    the step there, so no committed checkpoint lacks its step's metrics line)."""
    pending = begin(root, step, extra, keep_last, state)
    return pending.finish(_tensors(state), on_write, before_commit=before_commit)


@dataclass
class Pending:
    """A checkpoint begun: its temporary directory made and its meta.json content fixed
    (step, world, extra, every rank's RNG states at `begin`). `finish` writes the tensors
    and commits; it may run on another thread (checkpoint/background.py) with `group`, a
    process group of all ranks that nothing else uses meanwhile."""

    root: Path
    final: Path
    tmp: Path
    meta: dict
    keep_last: int

    def finish(self, tensors: dict, on_write: Callable[[], None] | None = None, group=None,
               before_commit: Callable[[], None] | None = None) -> Path:
        """Every rank's tensor files into the temporary directory, then `before_commit`,
        then meta.json and the atomic rename by rank 0, then pruning: the directory once
        final."""
        doing = "writing the tensor files"
        try:
            writer = dcp.FileSystemWriter(self.tmp, sync_files=True)
            writer.fs = _RecordingFileSystem(on_write)
            try:
                with quiet_dcp():
                    dcp.save(tensors, storage_writer=writer, process_group=group)
            except CheckpointException as e:
                # torch.save turns a failed write into "RuntimeError: ... unexpected pos":
                # the OSError that a rank's stream saw says why, and every rank learns it.
                error = _first_os_error(writer.fs.error, group) or _failure(e)[1]
                if not isinstance(error, OSError):
                    raise
                raise error from None
            # The exchange completes on no rank before every rank has finished dcp.save,
            # so it is also the barrier between the tensor files and meta.json.
            _all_gather_bytes(b"", group)
        except OSError as e:
            raise _not_written(self.root, self.final, self.tmp, e, doing) from None
        if before_commit is not None:
            before_commit()
        try:
            doing = f"writing {META} and renaming the directory into place"
            _on_rank0(lambda: _publish(self.root, self.tmp, self.final, self.meta, self.keep_last),
                      f"finish checkpoint {self.final}", group)
        except OSError as e:
            raise _not_written(self.root, self.final, self.tmp, e, doing) from None
        return self.final


def begin(root: str | os.PathLike, step: int, extra: dict, keep_last: int, state=None) -> Pending:
    """Check the arguments, make the temporary directory (rank 0, the others wait) and fix
    meta.json's content with every rank's RNG states and `state`'s fp16 loss scale, if it
    has one: what a save does before it writes tensors. Every rank calls it, on the
    default process group."""
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
    _, world = _rank_world()
    try:
        # Rank 0 empties the temporary directory before anyone writes into it.
        _on_rank0(lambda: _fresh_dir(tmp), f"create {tmp}")
    except OSError as e:
        raise _not_written(root, final, tmp, e, "creating its temporary directory") from None
    meta = {"format": FORMAT_VERSION, "step": step, "world": world, "extra": extra_json, "rng": _gather_rng()}
    if getattr(state, "loss_scale", None) is not None:
        meta["loss_scale"] = state.loss_scale.to_dict()
    return Pending(root, final, tmp, meta, keep_last)


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


def _tensors(state) -> dict:
    return {"params": {n: t.detach() for n, t in state.params.items()},
            "optimizer": {k: {n: t.detach() for n, t in group.items()} for k, group in state.optimizer.items()}}


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
    reader = SafeReader(path)
    metadata = reader.read_metadata()
    _check_layout(path, metadata, state, set(state.params if model_names is None else model_names))
    try:
        with quiet_dcp(), torch.no_grad():
            dcp.load(_tensors(state), storage_reader=SafeReader(path))
    except CheckpointException as e:  # a missing or damaged tensor file: name it in one line
        rank, cause = _failure(e)
        # The first sentence: torch's weights-only refusal goes on to advise unsafe loading.
        detail = str(cause).splitlines()[0].split(". ")[0] if str(cause) else "no detail"
        raise CheckpointError(f"checkpoint {path}: reading the tensors failed on rank {rank} "
                              f"({type(cause).__name__}: {detail}); the files are damaged: load an earlier "
                              "checkpoint or delete this one") from None
    state.step = meta["step"]
    _load_scale(path, meta, state)
    rank, world = _rank_world()
    rng = meta.get("rng")
    if meta["world"] == world and isinstance(rng, list) and len(rng) == world:
        try:
            _set_rng(rng[rank])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path}: {META} has a corrupt RNG state for rank {rank} ({e}): "
                                  "load another checkpoint (latest(root)) or delete this one") from None
    return meta


def _load_scale(path: Path, meta: dict, state) -> None:
    """fp16's loss scale as saved (a checkpoint without one starts the scale afresh)."""
    saved = meta.get("loss_scale")
    try:
        state.loss_scale = None if saved is None else ScaleState.from_dict(saved)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {META} has a corrupt loss_scale ({e!r}): load another "
                              "checkpoint (latest(root)) or delete this one") from None


def _rng_bytes() -> tuple[bytes, bytes]:
    cpu = torch.get_rng_state().numpy().tobytes()
    cuda = b""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state().numpy().tobytes()
    return cpu, cuda


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

