"""Export to an HF directory: parameters in memory (save_hf) or streamed from a DCP
checkpoint (export_dcp), safetensors shards and tokenizer files, published whole."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ..checkpoint import META, CheckpointError, SafeReader, in_run, newest_under, quiet_dcp
from ..data.tokenizer import ByteTokenizer, load_tokenizer
from ..errors import ConfigError
from ..files import publish_dir, write_json
from .hf_config import to_hf_config
from .layout import hf_layout
from ..models.hf import HFTensor, Piece
from .pieces import DTYPES, INDEX_FILE, SINGLE_FILE, TOKENIZER_FILES, GiB, _family_cfg, _specs
from .safetensors_stream import StreamWriter, nbytes


def save_hf(params: Mapping[str, torch.Tensor], arch: str, family_cfg, out: str | os.PathLike,
            dtype: str = "bf16", max_shard_bytes: int = 2 * GiB, *, tokenizer: str | None = None,
            bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict:
    """Write `params` (our names) as a Hugging Face model directory `out`: config.json,
    generation_config.json, model.safetensors (or model-0000i-of-0000n.safetensors and
    model.safetensors.index.json when larger than max_shard_bytes) and, when `tokenizer`
    is a tokenizer.json path (or its directory), tokenizer.json plus the
    tokenizer_config.json / special_tokens_map.json beside it; for "bytes", those three
    files generated to encode as the bytes tokenizer does. bos/eos ids come from the
    tokenizer ("bytes": 256/257) unless given.

    Tensors are converted and appended to their file one at a time (headers are written
    first), so beyond `params` the extra memory is one converted tensor. DTensors are
    gathered one at a time with full_tensor(): then every rank must call save_hf, and
    rank 0 alone writes. `out` must not exist or be empty; it appears complete or not at
    all (written in a temporary sibling directory, then renamed). Returns a summary dict.
    """
    cfg = _family_cfg(arch, family_cfg)
    specs = _specs(arch, cfg)
    for name, spec in specs.items():
        if name not in params:
            raise ConfigError(f"save_hf: parameter {name} {spec.shape} of the {arch} model is missing from params")
        if tuple(params[name].shape) != tuple(spec.shape):
            raise ConfigError(f"save_hf: parameter {name} has shape {tuple(params[name].shape)} but the model "
                              f"config gives {spec.shape}: pass the config the parameters were built with")
    extra = sorted(set(params) - set(specs))
    if extra:
        raise ConfigError(f"save_hf: parameter {extra[0]} is not part of the {arch} model config: pass the config "
                          "the parameters were built with")

    gathered = any(isinstance(t, DTensor) for t in params.values()) and dist.is_initialized()

    def fetch(name: str) -> torch.Tensor:
        t = params[name]
        if isinstance(t, DTensor):
            t = t.full_tensor()
        return t.detach().cpu()

    summary = _export(arch, cfg, fetch, out, dtype, max_shard_bytes, tokenizer, bos_token_id, eos_token_id,
                      write=not gathered or dist.get_rank() == 0)
    if gathered:
        dist.barrier()  # no rank returns before rank 0 has published `out`
    return summary


def export_dtype(precision: str) -> str:
    """The dtype an export of a run trained in `precision` is written in unless told
    otherwise: fp32 runs keep their fp32 weights, fp16 runs get fp16 (what their hardware
    computes in), bf16 and fp8 runs get bf16."""
    return precision if precision in ("fp32", "fp16") else "bf16"


def export_dcp(path: Path, arch: str, family_cfg, out: str | os.PathLike, dtype: str, *,
               tokenizer: str | None = None, max_shard_bytes: int = 2 * GiB) -> dict:
    """Export the model `arch` / `family_cfg` from the DCP checkpoint directory `path`
    (a step_XXXXXXXX directory) to a Hugging Face directory `out`, streaming: parameters
    are read one at a time (a dcp.load of a state dict holding only that tensor, with
    meshtrain's safe metadata reader), converted and appended to the current safetensors
    file, whose header was written up front; no shard is assembled in memory (see
    run/export.py:export_checkpoint for the peak this gives). Returns the summary of
    save_hf's writer."""
    cfg = _family_cfg(arch, family_cfg)
    shapes = _checkpoint_params(path)
    for name, spec in _specs(arch, cfg).items():
        if name not in shapes:
            raise CheckpointError(f"checkpoint {path}: parameter {name} {spec.shape} of the {arch} model in its "
                                  "config is not in the checkpoint; the checkpoint is damaged or from another model")
        if shapes[name][0] != tuple(spec.shape):
            raise CheckpointError(f"checkpoint {path}: parameter {name} has shape {shapes[name][0]} but its "
                                  f"config gives {spec.shape}; the checkpoint is damaged or from another model")

    def fetch(name: str) -> torch.Tensor:
        return _read_checkpoint_param(path, name, *shapes[name])

    return _export(arch, cfg, fetch, out, dtype, max_shard_bytes, tokenizer, None, None)


def resolve_checkpoint(checkpoint: str | os.PathLike) -> Path:
    """A step directory as it is; a run directory or a checkpoints root: its newest
    complete checkpoint. CheckpointError when there is none."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist: give a run directory or one of its "
                              "checkpoints/step_XXXXXXXX directories")
    if (path / META).is_file() or (path / ".metadata").is_file():
        return path
    found = newest_under(path)
    if found is not None:
        return found
    raise CheckpointError(f"checkpoint {path}: no complete checkpoint in it or under {in_run(path)}: "
                          "train with checkpoint.every > 0, or give a step_XXXXXXXX directory")


def _checkpoint_params(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global shape and dtype of every parameter in a DCP checkpoint (metadata only)."""
    metadata = SafeReader(path).read_metadata()
    planner_data = getattr(metadata, "planner_data", None) or {}
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        key = tuple(planner_data.get(fqn, tuple(fqn.split(".", 1))))
        if len(key) == 2 and key[0] == "params" and hasattr(md, "size"):
            out[key[1]] = (tuple(md.size), md.properties.dtype)
    return out


def _read_checkpoint_param(path: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One parameter, read alone from the DCP checkpoint (any saved layout, no process group)."""

    target = torch.empty(shape, dtype=dtype)
    try:
        with quiet_dcp(), torch.no_grad():
            dcp.load({"params": {name: target}}, storage_reader=SafeReader(path), no_dist=True)
    except CheckpointException as e:  # a missing, damaged or hostile tensor file: one line, no traceback
        failure = next(iter(e.failures.values()))
        cause = failure[0] if isinstance(failure, tuple) else getattr(failure, "exc", failure)
        detail = str(cause).splitlines()[0].split(". ")[0] if str(cause) else "no detail"
        raise CheckpointError(f"checkpoint {path}: reading parameter {name} failed ({type(cause).__name__}: "
                              f"{detail}); the tensor files are damaged or not written by meshtrain: export "
                              "another checkpoint") from None
    return target


def _export(arch: str, cfg, fetch: Callable[[str], torch.Tensor], out, dtype: str, max_shard_bytes: int,
            tokenizer: str | None, bos: int | None, eos: int | None, write: bool = True) -> dict:
    if dtype not in DTYPES:
        raise ConfigError(f"export dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ConfigError(f"export max_shard_bytes={max_shard_bytes!r} must be a positive integer (bytes)")
    torch_dtype = DTYPES[dtype]
    to_hf_config(arch, cfg, dtype=dtype)  # what the target cannot hold: refused before any work
    layout = hf_layout(arch, cfg)
    tok_files, tok_bos, tok_eos = _tokenizer_files(tokenizer)
    bos = tok_bos if bos is None else bos
    eos = tok_eos if eos is None else eos
    config = to_hf_config(arch, cfg, dtype=dtype, bos_token_id=bos, eos_token_id=eos)
    fetch = _split_cache(layout, fetch)
    shards = _plan_shards(layout, torch_dtype, max_shard_bytes)
    files = [SINGLE_FILE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(nbytes(t.shape, torch_dtype) for t in layout)
    out = Path(out)
    _check_out(out)  # on every rank, before any collective a DTensor fetch makes

    def build(tmp: Path | None) -> None:
        for file, shard in zip(files, shards):
            writer = StreamWriter(tmp / file, [(t.name, t.shape, torch_dtype) for t in shard]) if tmp else None
            try:
                for t in shard:
                    tensor = _assemble(t, fetch, torch_dtype)
                    if writer:
                        writer.write(t.name, tensor)
                    del tensor
            except BaseException:
                if writer:
                    writer.abort()
                raise
            if writer:
                writer.close()
        if tmp is None:
            return
        if len(files) > 1:
            weight_map = {t.name: file for file, shard in zip(files, shards) for t in shard}
            write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        write_json(tmp / "config.json", config)
        generation = {"_from_model_config": True}
        generation.update({k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None})
        write_json(tmp / "generation_config.json", generation)
        for name, content in tok_files.items():
            with open(tmp / name, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())

    if write:
        _publish(out, build)
    else:
        build(None)
    return {"out": str(out), "arch": arch, "dtype": dtype, "files": files, "total_bytes": total, "config": config}


def _plan_shards(layout: list[HFTensor], dtype: torch.dtype, max_bytes: int) -> list[list[HFTensor]]:
    """Greedy, in order: a file takes tensors while it stays within max_bytes (a tensor
    larger than that gets a file of its own)."""
    shards: list[list[HFTensor]] = [[]]
    size = 0
    for t in layout:
        n = nbytes(t.shape, dtype)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def _split_cache(layout: list[HFTensor], fetch: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """`fetch`, keeping the last parameter that is split over several HF tensors (a
    stacked expert weight, one HF tensor per expert, which the layout lists in a row) so
    that it is fetched once, not once per expert. Others are fetched each time, as before."""
    split = {p.ours for t in layout for p in t.pieces if p.lead}
    kept: dict[str, torch.Tensor] = {}

    def cached(name: str) -> torch.Tensor:
        if name not in kept:
            kept.clear()
            if name not in split:
                return fetch(name)
            kept[name] = fetch(name)
        return kept[name]

    return cached


def _assemble(t: HFTensor, fetch: Callable[[str], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The HF tensor `t` in `dtype`, fetching its pieces one at a time."""
    if t.plain:
        src = fetch(t.pieces[0].ours)
        _check_piece(t.pieces[0], src)
        return src.to(dtype).contiguous()
    buf = torch.empty(t.shape, dtype=dtype)
    for piece in t.pieces:
        src = fetch(piece.ours)
        _check_piece(piece, src)
        buf[piece.region()].copy_(src[piece.lead].permute(piece.perm))
        del src
    return buf


def _check_piece(piece: Piece, src: torch.Tensor) -> None:
    if tuple(src.shape) != piece.shape:
        raise ConfigError(f"parameter {piece.ours} has shape {tuple(src.shape)}, expected {piece.shape}")


def _tokenizer_files(tokenizer: str | None) -> tuple[dict[str, bytes], int | None, int | None]:
    """({file name: content}, bos id, eos id) for data.tokenizer. Contents are read here, so
    what is checked below is what is written."""
    if tokenizer is None:
        return {}, None, None
    if tokenizer == "bytes":
        files = {name: text.encode("utf-8") for name, text in ByteTokenizer().hf_files().items()}
        return files, ByteTokenizer.bos_id, ByteTokenizer.eos_id
    path = Path(tokenizer)
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        warnings.warn(f"export: tokenizer {tokenizer} not found, so no tokenizer files are exported; copy "
                      "tokenizer.json next to the weights yourself", stacklevel=3)
        return {}, None, None
    # The path comes from the checkpoint's meta.json: a damaged or hostile one must not get
    # an arbitrary file copied into the export, which may then be published.
    try:
        files = {"tokenizer.json": path.read_bytes()}
        content = json.loads(files["tokenizer.json"])
        is_tokenizer = isinstance(content, dict) and "model" in content
    except (OSError, ValueError):
        is_tokenizer = False
    if not is_tokenizer:
        warnings.warn(f"export: tokenizer {path} is not a Hugging Face tokenizer.json (JSON with a model key), so "
                      "no tokenizer files are exported; copy the right tokenizer.json next to the weights yourself",
                      stacklevel=3)
        return {}, None, None
    files.update({n: (path.parent / n).read_bytes() for n in TOKENIZER_FILES if (path.parent / n).is_file()})
    try:
        tok = load_tokenizer(str(path))
        return files, tok.bos_id, tok.eos_id
    except Exception as e:  # tokenizers missing or unreadable file: still copy, without ids
        warnings.warn(f"export: could not read {path} ({e}); bos/eos ids are left out of config.json",
                      stacklevel=3)
        return files, None, None


def _publish(out: Path, build: Callable[[Path], None]) -> None:
    """build(tmp) in a temporary sibling of `out`, then rename it to `out`."""
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # mkdir, not tempfile.mkdtemp: the published directory gets the umask's mode (0o755
    # under umask 022), as one made by hand would, not mkdtemp's private 0o700.
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        build(tmp)
        replaced = publish_dir(tmp, out, aside=tmp.with_name(tmp.name + "-old"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if replaced is not None:  # the empty directory `out` was
        shutil.rmtree(replaced, ignore_errors=True)


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"export: {out} already exists and is not an empty directory: choose a new output "
                          "directory or delete it")
