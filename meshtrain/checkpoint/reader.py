"""Reading DCP files without trusting them: no unpickled code, names and shapes checked
before any tensor is read."""

from __future__ import annotations

import contextlib
import importlib
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

from .layout import CheckpointError


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


class SafeReader(dcp.FileSystemReader):
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
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_files(path: Path, file: Path, metadata) -> None:
    """Every tensor the metadata names lies in a file of the checkpoint directory itself
    (a plain name, no path), and none is a pickled object (DCP loads those with full
    unpickling; meshtrain saves only tensors)."""
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
    _check_optimizer(path, {key[1] for key in saved if key[0] == "optimizer"}, set(state.optimizer))
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


# train.optimizer by the groups of optimizer state it keeps (train/optim.py, train/muon.py).
_OPTIMIZERS = {frozenset({"exp_avg", "exp_avg_sq"}): "adamw", frozenset({"exp_avg", "exp_avg_sq", "momentum"}): "muon"}


def _check_optimizer(path: Path, saved: set, wanted: set) -> None:
    """The checkpoint's optimizer state groups against the state's (none wanted: a load of
    the parameters alone)."""
    if not wanted or saved == wanted:
        return

    def name(groups):
        optimizer = _OPTIMIZERS.get(frozenset(groups))
        return f"train.optimizer={optimizer} ({', '.join(sorted(groups))})" if optimizer else \
            f"optimizer state {', '.join(sorted(groups)) or 'none'}"

    raise CheckpointError(f"checkpoint {path} holds the state of {name(saved)}, but this run needs {name(wanted)}: "
                          "resume it with the train.optimizer it was saved with, or start a fresh run (another "
                          "run_dir, or checkpoint.resume restart)")


@contextlib.contextmanager
def quiet_dcp():
    """DCP warns on every call without a process group; that is our single-process mode."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield

