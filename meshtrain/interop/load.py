"""Import of HF safetensors weights: plain tensors, or DTensors laid out by a Plan with each
rank reading only the slices of its own shards."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..errors import ConfigError
from ..layout.mesh import device_mesh_for
from ..models.hf import HFTensor, Piece
from .hf_config import _model_fields, read_hf_config
from .layout import hf_layout
from .pieces import _IGNORABLE, _ST_READ_DTYPES, INDEX_FILE, _family_cfg, _specs, hf_format


def load_hf_params(hf_dir: str | os.PathLike, arch: str, family_cfg, plan=None, mesh=None,
                   device: str | torch.device = "cpu", *, check_config: bool = True,
                   names=None) -> dict[str, torch.Tensor]:
    """Our parameters from a Hugging Face directory of safetensors weights.

    Every tensor the model needs must be present with its shape (else a one-line
    ConfigError naming the tensor, both shapes and the file), and no unknown weight may be
    left over. When config.json is there and `check_config`, it must describe the same
    model as `family_cfg` (max_position_embeddings may differ for llama).

    Without `plan`: full fp32 tensors on `device`. With `plan` (and `mesh`, the
    DeviceMesh; built from plan.mesh when None): fp32 DTensors laid out by the plan, as
    init_params makes them (requires_grad as the spec's `trainable`), each rank reading
    only the elements of its own local shard with `get_slice` (for GPT-2's fused c_attn
    and transposed Conv1D weights, the matching rows and columns of the file's tensor;
    for stacked expert weights, only the tensors of the rank's experts). `names`: load
    only these parameters (a pipeline stage's), still checking that the file has all of
    them. Parameters no HF file holds (the aux-free expert_bias) come back as zeros. A
    group the format lets start from the seed (its `seeded`: DeepSeek-V3's MTP modules)
    whose tensors the files hold none of is left out of the result: the caller starts
    those parameters from the seed (run/build.py says so in one line).
    """
    cfg = _family_cfg(arch, family_cfg)
    hf_dir = Path(hf_dir)
    if check_config and (hf_dir / "config.json").is_file():
        check_same_model(hf_dir, arch, cfg)
    with _WeightFiles(hf_dir) as files:
        layout = _pick_layout(files, arch, cfg)
        layout, unseen = _without_seeded(files, layout, hf_format(arch).seeded(cfg))
        where = files.match(layout, arch, cfg.tie_embeddings)
        specs = _specs(arch, cfg)
        wanted = set(specs if names is None else names) - unseen
        pieces = _pieces_of(layout)
        if plan is None:
            return {name: _read_param(files, where, pieces.get(name, ()), tuple(slice(0, n) for n in spec.shape))
                    .to(device) for name, spec in specs.items() if name in wanted}
        return _load_planned(files, where, pieces, specs, plan, mesh, device, wanted)


def _pick_layout(files: "_WeightFiles", arch: str, cfg) -> list[HFTensor]:
    """The layout the files hold: for MoE models, experts per expert (the hub's, what
    save_pretrained writes) or fused (save_pretrained(save_original_format=False))."""
    layout = hf_layout(arch, cfg)
    fmt = hf_format(arch)
    probe = fmt.fused_probe(cfg)
    if probe is None:
        return layout
    fused = probe in files.names or probe[len(fmt.base_prefix):] in files.names
    return hf_layout(arch, cfg, experts="fused") if fused else layout


def _without_seeded(files: "_WeightFiles", layout: list[HFTensor], prefixes) -> tuple[list[HFTensor], set[str]]:
    """The layout less the tensors of each group of `prefixes` that the files hold none
    of, and our parameters of those groups (left for the caller to start from the seed)."""
    unseen: set[str] = set()
    for prefix in prefixes:
        group = [t for t in layout if any(p.ours.startswith(prefix) for p in t.pieces) and not t.copy]
        if group and not any(t.name in files.names or t.name.removeprefix("model.") in files.names for t in group):
            unseen |= {p.ours for t in group for p in t.pieces}
    return [t for t in layout if not any(p.ours in unseen for p in t.pieces) or t.copy], unseen


def _pieces_of(layout: list[HFTensor]) -> dict[str, list[tuple[str, Piece]]]:
    """Our parameter -> the (HF tensor, piece) pairs holding it (copies left out)."""
    out: dict[str, list[tuple[str, Piece]]] = {}
    for t in layout:
        for piece in () if t.copy else t.pieces:
            out.setdefault(piece.ours, []).append((t.name, piece))
    return out


def _read_param(files: "_WeightFiles", where, pieces, index: tuple[slice, ...]) -> torch.Tensor:
    """ours[index] (fp32) from the HF tensors holding it, reading only those elements: a
    parameter split over tensors (one per expert) reads only the experts in `index`. No
    pieces: a parameter the files do not hold (the format's `absent`), zeros."""
    if len(pieces) == 1 and not pieces[0][1].lead:
        hf_name, piece = pieces[0]
        return files.read(where[hf_name], piece, index)
    out = torch.zeros(tuple(s.stop - s.start for s in index), dtype=torch.float32)
    for hf_name, piece in pieces:
        n = len(piece.lead)
        if all(s.start <= j < s.stop for s, j in zip(index, piece.lead)):
            at = tuple(j - s.start for s, j in zip(index, piece.lead))
            out[at] = files.read(where[hf_name], piece, index[n:])
    return out


def check_same_model(hf_dir: Path, arch: str, cfg, key: str | None = None) -> None:
    """`<hf_dir>/config.json` describes the model `cfg` (a family config): the same
    architecture and shapes. Free to differ: max_seq_len (llama), ffn_dim when every
    block is MoE, and model.moe's training-only fields (balance, aux_coef, z_loss_coef,
    capacity_factor, bias_update_rate). `key`: the config key that named hf_dir
    (model.init_from), which the message then names with the run's fix."""
    cfg = _family_cfg(arch, cfg)
    theirs = read_hf_config(hf_dir)
    ours = _model_fields(arch, cfg)
    fmt = hf_format(arch)
    extra = fmt.compare(theirs, ours, cfg)
    diffs = [(k, value, ours[k]) for k, value in theirs.items() if k not in fmt.free]
    for field, value, mine in diffs + extra:
        same = math.isclose(value, mine, rel_tol=1e-6) if isinstance(value, float) and isinstance(mine, (int, float)) \
            else value == mine
        if same:
            continue
        name, theirs_, ours_ = f"model.{field}", json.dumps(value), json.dumps(mine)
        if key is not None:  # the values as a YAML file or a flag spells them: gpt2, not "gpt2"
            theirs_, ours_ = (v if isinstance(v, str) and v else json.dumps(v) for v in (value, mine))
            raise ConfigError(f"{key}={str(hf_dir)!r} holds a model with {name}={theirs_} (its config.json), but "
                              f"this run has {name}={ours_}: set {name} {theirs_} to start from these weights, or "
                              f"give {key} the weights of a model with {name}={ours_}")
        raise ConfigError(f"{hf_dir / 'config.json'} gives {name}={theirs_} but the model config has {name}={ours_}: "
                          f"set {name} to {theirs_} or use weights of this model")


class _WeightFiles:
    """The safetensors files of a directory, opened lazily with safe_open."""

    def __init__(self, hf_dir: Path):
        self.dir = hf_dir
        self._open: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()
        self.names = self._index()

    def __enter__(self) -> "_WeightFiles":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _index(self) -> dict[str, Path]:
        if not self.dir.is_dir():
            raise ConfigError(f"{self.dir} is not a directory: give a Hugging Face model directory (config.json and "
                              "*.safetensors)")
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                entries = {str(k): v for k, v in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"{index}: not a safetensors index with a weight_map ({e}); restore it") from None
            # Every entry is checked before any file is touched: the index is data, and
            # must not make the loader open files elsewhere.
            names = {k: self._inside(v, f"{index}: weight_map entry {v!r} (tensor {k})") for k, v in entries.items()}
            for path in sorted(set(names.values())):
                if not path.is_file():
                    raise ConfigError(f"{index} names {path.name}, which is missing: restore the file")
            return names
        paths = sorted(self.dir.glob("*.safetensors"))
        if not paths:
            pickles = sorted(p.name for p in self.dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            found = f" (found {', '.join(pickles)}: pickle files, never loaded since they can run code)" if pickles \
                else ""
            raise ConfigError(f"{self.dir}: no *.safetensors weights{found}; save the model with transformers' "
                              "save_pretrained(..., safe_serialization=True)")
        names = {}
        for path in paths:
            self._inside(path.name, str(path))
            for name in self.handle(path).keys():
                if name in names:
                    raise ConfigError(f"{self.dir}: tensor {name} is in both {names[name].name} and {path.name}; "
                                      "keep one copy")
                names[name] = path
        return names

    def _inside(self, entry, what: str) -> Path:
        """<dir>/entry, refused unless it is a relative path that stays in the directory,
        symbolic links resolved. A Hugging Face hub snapshot (<repo>/snapshots/<revision>)
        may also link into its own <repo>/blobs, as the hub's cache does."""
        rule = f"weights are read only from inside {self.dir}"
        if not isinstance(entry, str) or not entry or "\0" in entry:
            raise ConfigError(f"{what} is not a file name; {rule}: restore the index")
        if os.path.isabs(entry):
            raise ConfigError(f"{what} is an absolute path; {rule}: restore the index")
        if ".." in Path(entry).parts:
            raise ConfigError(f"{what} leaves the model directory (..); {rule}: restore the index")
        root = Path(os.path.realpath(self.dir))
        roots = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
        real = Path(os.path.realpath(self.dir / entry))  # unlike resolve(), no error on a link loop
        if not any(real.is_relative_to(r) for r in roots):
            raise ConfigError(f"{what} resolves to {real}, outside the model directory (a symbolic link); {rule}: "
                              "copy the file into the directory instead of linking to it")
        return self.dir / entry

    def handle(self, path: Path):
        if path not in self._open:
            try:
                self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            except Exception as e:  # the library raises its own error types for a bad file
                raise ConfigError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); restore "
                                  "it") from None
        return self._open[path]

    def match(self, layout: list[HFTensor], arch: str, tied: bool) -> dict[str, tuple[Path, str]]:
        """Expected name -> (file, name in the file), shapes and dtypes checked, nothing left over."""
        prefix = hf_format(arch).base_prefix
        where: dict[str, tuple[Path, str]] = {}
        copies = set()
        for t in layout:
            candidates = [t.name] + ([t.name[len(prefix):]] if t.name.startswith(prefix) else [])
            found = next((c for c in candidates if c in self.names), None)
            if t.copy:  # read from the first copy; this one may be there or not
                copies |= {found} - {None}
                continue
            if found is None:
                raise ConfigError(f"{self.dir}: tensor {t.name} (shape {t.shape}) is missing from "
                                  f"{self._file_list()}: the weights do not match config.json / the model config")
            path = self.names[found]
            sl = self.handle(path).get_slice(found)
            shape, st_dtype = tuple(sl.get_shape()), sl.get_dtype()
            if shape != t.shape:
                raise ConfigError(f"{self.dir}: tensor {found} has shape {shape} in {path.name} but the model config "
                                  f"expects {t.shape}: the weights do not match config.json / the model config")
            if st_dtype not in _ST_READ_DTYPES:
                raise ConfigError(f"{self.dir}: tensor {found} in {path.name} has dtype {st_dtype}: only float "
                                  f"weights ({', '.join(sorted(_ST_READ_DTYPES))}) can be imported")
            where[t.name] = (path, found)
        used = {name for _, name in where.values()} | copies
        left = sorted(n for n in self.names if n not in used and not _IGNORABLE.search(n)
                      and not (tied and n == "lm_head.weight"))
        if left:
            raise ConfigError(f"{self.dir}: tensor {left[0]} in {self.names[left[0]].name} is not part of the "
                              f"{arch} model ({len(left)} such tensors): the checkpoint has features meshtrain's "
                              f"{arch} lacks; use a matching checkpoint")
        return where

    def _file_list(self) -> str:
        names = sorted({p.name for p in self.names.values()})
        return ", ".join(names) if len(names) <= 3 else f"{names[0]} ... ({len(names)} files)"

    def read(self, where: tuple[Path, str], piece: Piece, index: tuple[slice, ...]) -> torch.Tensor:
        """ours[index] (fp32) of `piece`, reading only those elements of the file's tensor."""
        path, name = where
        block = self.handle(path).get_slice(name)[piece.hf_index(index)]
        return block.permute(piece.inverse_perm).to(torch.float32).contiguous()


def _load_planned(files: _WeightFiles, where, pieces, specs, plan, mesh, device, wanted) -> dict[str, torch.Tensor]:
    from torch._prims_common import make_contiguous_strides_for

    if set(plan.params) != set(specs):
        missing = sorted(set(specs) ^ set(plan.params))[0]
        raise ConfigError(f"plan and model config differ at parameter {missing}: make the plan from this model's "
                          "specs (make_plan(build(arch, cfg).specs, ...))")

    if mesh is None:
        mesh = plan.mesh.build()
    device_mesh_for(mesh, plan.mesh.experts())  # built on every rank, holding experts or not
    out = {}
    for name, pp in plan.params.items():
        if name not in wanted:
            continue
        spec = pp.spec
        mesh_of = device_mesh_for(mesh, pp.mesh)
        runs = [_runs(_local_indices(n, d, mesh_of, pp.placements)) for d, n in enumerate(spec.shape)]
        local = torch.empty(tuple(sum(r[2] for r in dim_runs) for dim_runs in runs), dtype=spec.dtype)
        for combo in itertools.product(*runs):
            local_index = tuple(slice(lo, lo + n) for lo, _, n in combo)
            global_index = tuple(slice(go, go + n) for _, go, n in combo)
            local[local_index] = _read_param(files, where, pieces.get(name, ()), global_index)
        dt = DTensor.from_local(local.to(device), mesh_of, pp.placements, run_check=False,
                                shape=torch.Size(spec.shape), stride=make_contiguous_strides_for(spec.shape))
        out[name] = dt.requires_grad_(spec.trainable) if dt.is_floating_point() else dt
    return out


def _local_indices(size: int, dim: int, mesh, placements) -> list[int]:
    """Global indices along `dim` of this rank's local shard, in local order (handles
    nested and strided shards: the placements are applied to the index vector itself)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    one_dim = []
    for p in placements:
        if isinstance(p, _StridedShard) and p.dim == dim:
            one_dim.append(_StridedShard(0, split_factor=p.split_factor))
        elif isinstance(p, Shard) and p.dim == dim:
            one_dim.append(Shard(0))
        else:
            one_dim.append(Replicate())
    if all(isinstance(p, Replicate) for p in one_dim):
        return list(range(size))
    coords = torch.arange(size, device=mesh.device_type)
    return distribute_tensor(coords, mesh, one_dim, src_data_rank=None).to_local().cpu().tolist()


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs of `indices` as (local start, global start, length)."""
    runs: list[tuple[int, int, int]] = []
    for local, g in enumerate(indices):
        if runs and runs[-1][1] + runs[-1][2] == g:
            lo, go, n = runs[-1]
            runs[-1] = (lo, go, n + 1)
        else:
            runs.append((local, g, 1))
    return runs

