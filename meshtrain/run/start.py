"""What a run checks and finds before it trains: the data, the run_dir, model.init_from,
the checkpoint to resume from, whether there is anything left to do, and what changed
in the config since the checkpoint. Nothing here writes, except clearing what an
interrupted save left behind (`resume_path(repair=True)`)."""

from __future__ import annotations

import os
from pathlib import Path

from .. import checkpoint
from ..config import RunConfig
from ..data import DataError, build_data
from ..data.tokenizer import EOS_TOKENS
from ..errors import ConfigError
from ..interop.hf import check_same_model


def open_data(cfg: RunConfig):
    d, t = cfg.data, cfg.train
    try:
        data = build_data(d.paths, d.tokenizer, t.seq_len, cfg.seed, cfg.model.vocab_size, d.valid_fraction)
    except DataError as e:
        raise DataError(f"data.paths={d.paths!r}: {e}") from None
    keys = [k for k in ("document_mask", "reset_positions", "eod_mask_loss") if getattr(d, k)]
    if keys and data.eod is None:
        raise DataError(f"data.{keys[0]} finds documents by their end-of-document token, but data.tokenizer="
                        f"{d.tokenizer!r} has none (looked for {', '.join(EOS_TOKENS)}); set "
                        f"{' and '.join('data.' + k for k in keys)} to false, or use a tokenizer with one")
    return data


def check_writable(run_dir: Path) -> None:
    """A run_dir that cannot be written fails now, before any step is spent."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run_dir={str(run_dir)!r} cannot be written ({e.strerror or e}): make it writable, or set "
                          "run_dir to a directory that is; nothing in it was changed") from None


def check_init_from(cfg: RunConfig) -> None:
    """model.init_from must hold weights of the model the config describes."""
    path = Path(cfg.model.init_from)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.init_from={cfg.model.init_from!r} is not a Hugging Face model directory (no "
                          "config.json): give a directory written by save_pretrained or meshtrain export")
    check_same_model(path, cfg.model.arch, cfg.family_config())


def finished(cfg: RunConfig, print_it: bool) -> bool:
    """A run whose checkpoint to resume from is already at its last step does nothing: it
    rewrites no file and starts no rank (running the same command twice is harmless)."""
    path = resume_path(cfg)
    meta = checkpoint.read_meta(path) if path is not None else None
    t = cfg.train
    stop = min(t.stop_at or t.steps, t.steps)
    if meta is None or meta["step"] < stop:
        return False
    if print_it:
        until = f"train.stop_at={t.stop_at}" if t.stop_at and t.stop_at < t.steps else f"train.steps={t.steps}"
        print(f"nothing to do: {path} is at step {meta['step']} and {until}; raise train.steps to train further, or "
              "start over with --checkpoint.resume none or another run_dir", flush=True)
    return True


def config_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """`key old -> new` for every value that differs between two RunConfig dicts, except
    train.stop_at (where this invocation stops, not what the run is)."""
    changes = []
    for key in [*new, *(k for k in old if k not in new)]:
        a, b, name = old.get(key), new.get(key), prefix + key
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, name + ".")
        elif a != b and name != "train.stop_at":
            changes.append(f"{name} {a!r} -> {b!r}")
    return changes


def resume_path(cfg: RunConfig, repair: bool = False) -> Path | None:
    """The checkpoint this run starts from. `repair` (every rank of the run, together)
    first clears what an interrupted save left behind."""
    resume = cfg.checkpoint.resume
    if resume == "none":
        return None
    if resume == "auto":
        root = Path(cfg.run_dir) / "checkpoints"
        if repair:
            checkpoint.cleanup_incomplete(root)
        return checkpoint.latest(root)
    path = Path(resume)
    if not path.exists():
        raise ConfigError(f"checkpoint.resume={resume!r} does not exist: give a <run_dir>/checkpoints/step_XXXXXXXX "
                          "directory, or auto (the newest in run_dir), or none (start over)")
    if not (path / "meta.json").is_file():
        raise ConfigError(f"checkpoint.resume={resume!r} is not a complete checkpoint directory (no meta.json): "
                          "give a <run_dir>/checkpoints/step_XXXXXXXX directory, or auto, or none")
    return path
