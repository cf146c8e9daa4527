"""checkpoint.export: a run's final weights as a Hugging Face directory <run_dir>/export,
replaced whole (a reader sees the old export or the new one, never a mix)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from .. import checkpoint
from ..config import RunConfig
from ..interop.hf import export_checkpoint, export_dtype, save_hf


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
        ckpt = checkpoint.latest(run_dir / "checkpoints")
        if ckpt != checkpoint.step_dir(run_dir / "checkpoints", step):
            ckpt = save()
        if rank == 0:
            export_checkpoint(ckpt, fresh, dtype=dtype)
    else:
        save_hf(params, cfg.model.arch, cfg.family_config(), fresh, dtype=dtype, tokenizer=cfg.data.tokenizer)
    if rank == 0:
        if out.exists():
            out.rename(old)
        fresh.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    if world > 1:
        dist.barrier()
    return out
