"""What a run checks and finds before it trains: the data, the run_dir, model.init_from,
the checkpoint to resume from and its tokenizer, whether there is anything left to do,
and what changed in the config since the checkpoint. Nothing here writes, except
clearing what an interrupted save left behind (`resume_path(repair=True)`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import checkpoint
from ..config import RunConfig
from ..data import DataError, build_data
from ..data.tokenizer import EOS_TOKENS, describe_record, load_tokenizer, tokenizer_record
from ..errors import ConfigError
from ..interop.hf import check_same_model
from .rundir import refuse_fresh_start

DOCUMENT_KEYS = ("document_mask", "reset_positions", "eod_mask_loss")


def open_data(cfg: RunConfig):
    d, t = cfg.data, cfg.train
    try:
        data = build_data(d.paths, d.tokenizer, t.seq_len, cfg.seed, cfg.model.vocab_size, d.valid_fraction)
    except DataError as e:
        raise DataError(f"data.paths={d.paths!r}: {e}") from None
    keys = [k for k in DOCUMENT_KEYS if getattr(d, k)]
    off = f"set {' and '.join('data.' + k for k in keys)} to false"
    if keys and data.eod is None:
        raise DataError(f"data.{keys[0]} finds documents by their end-of-document token, but data.tokenizer="
                        f"{d.tokenizer!r} has none (looked for {', '.join(EOS_TOKENS)}); {off}, or use a tokenizer "
                        "with one")
    if keys:
        for part in data.train.parts:
            if not part.source.documents_end_with(data.eod):
                raise DataError(f"data.{keys[0]} finds documents by their end-of-document token (id {data.eod}), "
                                f"but the documents of dataset {part.source.name} do not end with it: re-run "
                                f"meshtrain preprocess with --append-eod, or {off}")
    return data


def check_start(cfg: RunConfig, data) -> Path | None:
    """What a start reads before it writes anything: the checkpoint to resume from (its
    path, or None), model.init_from when there is none, a fresh start that would bury a
    run, and the checkpoint's tokenizer against data.tokenizer."""
    path = resume_path(cfg)  # also checks an explicit checkpoint.resume
    if path is None and cfg.model.init_from:
        check_init_from(cfg)
    if cfg.checkpoint.resume == "none":
        refuse_fresh_start(Path(cfg.run_dir))
    if path is not None:
        check_tokenizer(path, data.tokenizer)
    return path


def check_tokenizer(path: Path, now: dict | None) -> None:
    """A checkpoint continues only on the tokenizer it was trained with: the same ids must
    mean the same text (a new vocabulary would silently reuse trained embeddings)."""
    meta = checkpoint.read_meta(path)
    before = _trained_tokenizer(meta["extra"]) if meta is not None else None
    if before is None or now is None or (before["kind"], before.get("sha256")) == (now["kind"], now.get("sha256")):
        return
    raise ConfigError(f"checkpoint {path} was trained with tokenizer {describe_record(before)}, but data.tokenizer is "
                      f"{describe_record(now)}: resume with data.tokenizer {before['name']} (and data it tokenized), "
                      "or start a new run: another run_dir, or --checkpoint.resume restart")


def _trained_tokenizer(extra: dict) -> dict | None:
    """The tokenizer record a checkpoint carries; for one written before records were kept,
    the record of its config's data.tokenizer where that can still be read (None: unknown)."""
    if isinstance(extra.get("tokenizer"), dict):
        return extra["tokenizer"]
    spec = extra.get("config", {}).get("data", {}).get("tokenizer")
    try:
        return tokenizer_record(load_tokenizer(spec)) if isinstance(spec, str) else None
    except DataError:
        return None


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
    check_same_model(path, cfg.model.arch, cfg.family_config(), key="model.init_from")


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
              "start over in another run_dir, or here with --checkpoint.resume restart (the run moves to "
              f"{Path(cfg.run_dir) / 'previous'}/)", flush=True)
    return True


def config_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """`key old -> new` (YAML's spelling) for every value that differs between two
    RunConfig dicts, except train.stop_at and checkpoint.resume (where this invocation
    stops and starts from, not what the run is)."""
    changes = []
    for key in [*new, *(k for k in old if k not in new)]:
        a, b, name = old.get(key), new.get(key), prefix + key
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, name + ".")
        elif a != b and name not in ("train.stop_at", "checkpoint.resume"):
            changes.append(f"{name} {_yaml(a)} -> {_yaml(b)}")
    return changes


def _yaml(value) -> str:
    """A config value as the YAML file spells it: true, null, 0.0003, [1, 2]."""
    return value if isinstance(value, str) and value else json.dumps(value)


def resume_path(cfg: RunConfig, repair: bool = False) -> Path | None:
    """The checkpoint this run starts from. `repair` (every rank of the run, together)
    first clears what an interrupted save left behind."""
    resume = cfg.checkpoint.resume
    if resume in ("none", "restart"):
        return None
    if resume == "auto":
        root = checkpoint.in_run(cfg.run_dir)
        if repair:
            checkpoint.cleanup_incomplete(root)
        return checkpoint.latest(root)
    path = Path(resume)
    if not path.exists():
        raise ConfigError(f"checkpoint.resume={resume!r} does not exist: give a <run_dir>/checkpoints/step_XXXXXXXX "
                          "directory, or auto (the newest in run_dir), or restart (start over, the run in run_dir "
                          "moved to previous/)")
    if not (path / "meta.json").is_file():
        raise ConfigError(f"checkpoint.resume={resume!r} is not a complete checkpoint directory (no meta.json): "
                          "give a <run_dir>/checkpoints/step_XXXXXXXX directory, or auto, or restart")
    return path


def load_resume(cfg: RunConfig, first: Path, state, specs) -> tuple[Path, dict, list[str]]:
    """Load the checkpoint to resume from, `first` (resume_path's), into `state`. With
    resume auto, a damaged newest checkpoint (missing or truncated files, bad metadata,
    shapes that do not fit) is skipped for the one before it. Returns the checkpoint
    loaded, what it keeps beside the tensors, and a one-line note per skipped checkpoint."""
    auto = cfg.checkpoint.resume == "auto"
    candidates = [p for p in reversed(checkpoint.complete(first.parent))] if auto else [first]
    notes, first_error = [], None
    for path in candidates:
        try:
            meta = checkpoint.load(path, state, specs)
        except checkpoint.CheckpointError as e:
            first_error = first_error or e
            notes.append(f"skipping {path.name}: {e}")
            continue
        return path, meta["extra"], notes
    raise checkpoint.CheckpointError(f"{first_error}; no earlier checkpoint in {first.parent} loads either "
                                     "(set checkpoint.resume restart to move it aside and start over)"
                                     if auto else str(first_error))
