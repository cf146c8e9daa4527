"""What a model family's Hugging Face format is written in: where our parameters lie
inside the HF tensors (Piece, HFTensor), typed reads of config.json keys, and `HFFormat`,
the entry a family's folder gives the registry (models/family.py) so that interop/ can
export and import it. The machinery (streamed export, import by slices, file names) is
interop's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import ConfigError


@dataclass(frozen=True)
class Piece:
    """Where (part of) one of our parameters lies inside a Hugging Face tensor: the HF
    tensor holds ours[lead] (all of ours when lead is empty; e.g. lead (j,): expert j of
    a stacked expert weight), whose dim perm[j] is HF dim j, starting at offset[j]
    (non-zero only in a fused tensor). `shape` is our whole parameter's."""

    ours: str
    shape: tuple[int, ...]
    perm: tuple[int, ...]
    offset: tuple[int, ...]
    lead: tuple[int, ...] = ()

    @property
    def sub_shape(self) -> tuple[int, ...]:
        """The shape of ours[lead]."""
        return self.shape[len(self.lead):]

    @property
    def inverse_perm(self) -> tuple[int, ...]:
        inv = [0] * len(self.perm)
        for j, d in enumerate(self.perm):
            inv[d] = j
        return tuple(inv)

    def hf_index(self, index: tuple[slice, ...]) -> tuple[slice, ...]:
        """The HF slices holding ours[lead][index] (slices with start/stop, step 1)."""
        return tuple(slice(o + index[d].start, o + index[d].stop) for o, d in zip(self.offset, self.perm))

    def region(self) -> tuple[slice, ...]:
        return self.hf_index(tuple(slice(0, n) for n in self.sub_shape))


@dataclass(frozen=True)
class HFTensor:
    """`copy`: a second copy of a parameter another tensor holds (DeepSeek-V3's MTP layers
    repeat the embedding and the head): export writes it, import reads the first."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    copy: bool = False

    @property
    def plain(self) -> bool:
        """One piece, same layout: the HF tensor is our parameter as it is."""
        p = self.pieces[0]
        return len(self.pieces) == 1 and not p.lead and p.perm == tuple(range(len(p.shape)))


REQUIRED = object()


def get_key(config: Mapping, keys: tuple[str, ...], default: Any, source: str, kind: type = int) -> Any:
    """The first of `keys` that is set (not null), type-checked; else `default`."""
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            what = {float: "a number", int: "an integer", bool: "true or false"}.get(kind, kind.__name__)
            raise ConfigError(f"{source}: {key}={json.dumps(value)} must be {what}")
        return value
    if default is REQUIRED:
        raise ConfigError(f"{source}: {keys[0]} is missing; it is needed to build the model")
    return default


def refuse_key(config: Mapping, key: str, ok: Callable[[Any], bool], default: Any, why: str, source: str) -> None:
    value = config.get(key, default)
    if value is None:
        value = default
    if not ok(value):
        raise ConfigError(f"{source}: {key}={json.dumps(value)} is not supported: {why}")


@dataclass(frozen=True)
class HFFormat:
    """A family's Hugging Face format.

    architecture, base_prefix: the causal-LM class the plain family exports as, and the
      prefix of its base model's tensor names (files without it are read too).
    model_types: model_type -> (causal-LM class, base-model class) that import reads.
    tensors(cfg, specs, experts): the HF tensors in file order, each with its pieces;
      `experts` "hub" (one tensor per expert, what export writes) or "fused" (as
      transformers holds them in memory).
    absent(specs): our parameters no HF file holds (zeros on import).
    config(cfg): config.json's keys for cfg, architectures and model_type included (the
      token ids, dtype and the keys every family shares are interop's).
    fields(config, model_type, source): model.* fields of a config.json dict, refusing
      what the family's forward does not compute (`source` prefixes the message).
    model_fields(cfg): model.* fields of cfg beyond those every family has.
    compare(theirs, ours, cfg): for check_same_model, the (key, theirs, ours) triples the
      family compares itself, popping those keys (and keys that do not matter) from the
      two field dicts; `free` names the keys that may differ (not weight shapes).
    fused_probe(cfg): the name of a tensor whose presence means the fused expert layout,
      or None.
    seeded(cfg): prefixes of our parameters that start from the seed when the files hold
      none of their tensors (DeepSeek-V3's MTP modules, which some conversions drop)."""

    architecture: str
    base_prefix: str
    model_types: Mapping[str, tuple[str, str]]
    tensors: Callable[[Any, Mapping, str], list[HFTensor]]
    config: Callable[[Any], dict]
    fields: Callable[[Mapping, str, str], dict]
    absent: Callable[[Mapping], list[str]] = lambda specs: []
    model_fields: Callable[[Any], dict] = lambda cfg: {}
    compare: Callable[[dict, dict, Any], list] = lambda theirs, ours, cfg: []
    free: frozenset = frozenset()
    fused_probe: Callable[[Any], str | None] = lambda cfg: None
    seeded: Callable[[Any], tuple[str, ...]] = lambda cfg: ()


def same(specs: Mapping, hf: str, ours: str, copy: bool = False) -> HFTensor:
    """The HF tensor `hf` is our parameter `ours` as it is (`copy`: see HFTensor)."""
    shape = specs[ours].shape
    return HFTensor(hf, shape, (Piece(ours, shape, tuple(range(len(shape))), (0,) * len(shape)),), copy)


def transposed(specs: Mapping, hf: str, ours: str) -> HFTensor:
    """The HF tensor `hf` is our 2-D parameter `ours` transposed."""
    shape = specs[ours].shape
    return HFTensor(hf, shape[::-1], (Piece(ours, shape, (1, 0), (0, 0)),))
