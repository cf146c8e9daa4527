"""A run's weights as a Hugging Face directory: checkpoint.export (<run_dir>/export at
the end, replaced whole: a reader sees the old export or the new one, never a mix) and
`meshtrain export` of a checkpoint, whose model comes from the run config it carries."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Mapping

import torch.distributed as dist

from .. import checkpoint
from ..checkpoint import CheckpointError, read_meta
from ..files import publish_dir
from ..config import RunConfig
from ..interop.export import export_dcp
from ..interop.hf import export_dtype, resolve_checkpoint, save_hf
from ..interop.pieces import GiB


def export_run(cfg: RunConfig, run_dir: Path, params: dict, step: int, pipelined: bool, rank: int, world: int,
               save: Callable[[], Path]) -> Path:
    """Every rank calls it. `save` writes this step's checkpoint: a pipelined run exports
    from it, as no rank holds every stage."""
    out = run_dir / "export"
    fresh, old = run_dir / ".export-new", run_dir / ".export-old"
    if rank == 0:
        for leftover in (fresh, old):
            shutil.rmtree(leftover, ignore_errors=True)
    if world > 1:
        dist.barrier()
    dtype = export_dtype(cfg.train.precision)
    if pipelined:
        ckpt = checkpoint.latest(checkpoint.in_run(run_dir))
        if ckpt != checkpoint.step_dir(checkpoint.in_run(run_dir), step):
            ckpt = save()
        if rank == 0:
            export_checkpoint(ckpt, fresh, dtype=dtype)
    else:
        save_hf(params, cfg.model.arch, cfg.family_config(), fresh, dtype=dtype, tokenizer=cfg.data.tokenizer)
    if rank == 0:
        replaced = publish_dir(fresh, out, aside=old)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
    if world > 1:
        dist.barrier()
    return out


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str | None = None,
                      max_shard_bytes: int = 2 * GiB) -> dict:
    """Export a meshtrain DCP checkpoint to a Hugging Face directory (see save_hf for what
    is written). `checkpoint` is a step_XXXXXXXX directory, a checkpoints root, or a run
    directory (its newest complete checkpoint). The model comes from meta.json's
    extra.config (the RunConfig); tokenizer files come from its data.tokenizer; dtype None
    is export_dtype of its train.precision, as checkpoint.export writes.

    Streaming: parameters are read from the checkpoint one at a time (a dcp.load of a
    state dict holding only that tensor, with meshtrain's safe metadata reader), converted
    and appended to the current safetensors file, whose header was written up front; no
    shard is assembled in memory. Peak memory is therefore a few copies of the largest
    parameter, whatever the model's size or max_shard_bytes: about three fp32 copies (the
    bytes DCP reads, the tensor torch.load makes of them, the target they are copied
    into) plus the converted tensor when the dtype or layout changes (for GPT-2's fused
    c_attn, the whole (d, 3d) tensor; a stacked expert weight is read once and kept while
    its per-expert tensors are written). Measured (tests/test_hf.py): exporting a 100 MiB
    checkpoint whose largest parameter is 4 MiB raises peak RSS by about 20 MiB.
    Nothing is written under `out` unless the export completes.
    Returns a summary dict: out, checkpoint, step, arch, dtype, files, total_bytes, config.
    """
    path = resolve_checkpoint(checkpoint)
    meta, run = saved_run(path, "export a checkpoint written by meshtrain fit, or use save_hf")
    dtype = export_dtype(run.train.precision) if dtype is None else dtype
    summary = export_dcp(path, run.model.arch, run.family_config(), out, dtype, tokenizer=run.data.tokenizer,
                         max_shard_bytes=max_shard_bytes)
    return {**summary, "checkpoint": str(path), "step": meta["step"]}


def saved_run(path: Path, fix: str) -> tuple[dict, RunConfig]:
    """meta.json of the checkpoint at `path` and the RunConfig it was trained with (its
    extra.config); a CheckpointError that ends with `fix` when either is missing."""
    meta = read_meta(path)
    if meta is None:
        raise CheckpointError(f"checkpoint {path}: meta.json is missing or corrupt: {fix}")
    config = (meta.get("extra") or {}).get("config")
    if not isinstance(config, Mapping):
        raise CheckpointError(f"checkpoint {path}: meta.json has no extra.config (the run's RunConfig), so the "
                              f"model is unknown: {fix}")
    return meta, RunConfig.from_dict(config)
