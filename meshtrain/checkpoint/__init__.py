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
- `BackgroundSaver` (checkpoint.async_save) writes the same checkpoint from copies of the
  tensors on a thread, with the same commit: until its rename it is a temporary
  directory, so every guarantee above holds at every moment of a background write; its
  failure is raised, as the same CheckpointError, by the next `save` or `wait`.
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

from ..lazy import lazy_exports

# Loaded on first use: the config imports checkpoint/config.py without torch.
_EXPORTS = {**dict.fromkeys(["META", "CheckpointError", "cleanup_incomplete", "complete", "in_run", "latest",
                             "newest_under", "read_meta", "step_dir"], ".layout"),
            "BackgroundSaver": ".background", "SafeReader": ".reader", "quiet_dcp": ".reader",
            "load": ".store", "save": ".store", "CheckpointConfig": ".config"}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
