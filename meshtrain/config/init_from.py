"""`model.init_from` alone is enough: the model.* keys a run does not give are read from
the Hugging Face directory's config.json (interop's importer, read_hf_config), and the
keys it gives are checked against it.

    fill_from_init(cfg, given)   the RunConfig with model.* completed from config.json
    given_keys(mapping)          the dotted keys a nested mapping gives (a parsed YAML file,
                                 the dict a Python caller builds a RunConfig from)

Which keys were given is the caller's to say: the command line parses its --config files
and flags a second time without defaults (cli.py); a Python caller passes given_keys() of
the dict it built the config from, or nothing (every architecture key from config.json).

- A key not given takes config.json's value; a key config.json does not name takes the
  value the checkpoint implies, the field's default (qk_norm false, head_dim null, moe
  null for a dense model). Nested sections (model.moe, and any dataclass-valued field
  added later) are filled field by field: a section not given is config.json's whole; a
  section given by some of its keys keeps those and takes the others from config.json.
- A given key that differs from config.json is a ConfigError naming the key and both
  values, unless the checkpoint check (interop's check_same_model, the one a fresh start
  runs) lets it differ: keys that shape no weight, such as llama's max_seq_len (RoPE
  works at any length), ffn_dim when every block is MoE, model.moe.balance (an aux-free
  expert bias starts at 0, which routes as the checkpoint does). Those keep the value given.
- TRAINING_ONLY keys are never read from config.json nor compared.

This module imports interop (and so torch), as assemble.py does: `import meshtrain.config`
does not import it, and the command line imports it only for a run with model.init_from.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..interop.hf import check_same_model, read_hf_config
from ..models.config import ModelConfig
from .schema import RunConfig

# model.* keys that say how the model trains, not what it computes: no weight or output of
# the checkpoint depends on them, and config.json records them not at all or not as ours
# (router_aux_loss_coef is transformers' loss, pooled over the batch and the layers, top_k
# times ours). They keep meshtrain's defaults unless given, and are never compared with the
# checkpoint. model.init_from names the checkpoint itself.
TRAINING_ONLY = frozenset({"model.init_from", "model.moe.aux_coef", "model.moe.z_loss_coef",
                           "model.moe.capacity_factor", "model.moe.bias_update_rate", "model.mtp.loss_coef"})

_FIX = "drop the key to take the checkpoint's value, or point model.init_from at a matching checkpoint"


def given_keys(values: Mapping, prefix: str = "") -> set[str]:
    """The dotted keys a nested mapping gives: each key at any depth, a section (a
    mapping, or null) included as well as its keys. {"model": {"moe": {"top_k": 4}}} gives
    model, model.moe and model.moe.top_k."""
    out = set()
    for key, value in values.items():
        name = prefix + str(key)
        out.add(name)
        if isinstance(value, Mapping):
            out |= given_keys(value, name + ".")
    return out


def fill_from_init(cfg: RunConfig, given: Iterable[str] = ()) -> RunConfig:
    """`cfg` with the model.* keys not in `given` (dotted: model.dim, model.moe.top_k) read
    from `<model.init_from>/config.json`; a given key that config.json contradicts is a
    ConfigError. Without model.init_from, or without a config.json there, `cfg` itself
    (model.check and a fresh start's check_init_from say what is wrong; a resume ignores
    model.init_from). Filling also happens when the run resumes from its own checkpoint:
    it gives the same keys as at the start, which the checkpoint's shapes need."""
    path = cfg.model.init_from
    if not isinstance(path, str) or not path or not (Path(path) / "config.json").is_file():
        return cfg
    path = Path(path)
    # A key given gives its sections too: model.moe.top_k gives model.moe.
    given = {".".join(k.split(".")[:i]) for k in given if k.startswith("model.") for i in range(2, k.count(".") + 2)}
    # The model config.json describes: the importer's fields, the defaults standing for
    # what it leaves out (a dense model's moe null, a llama's qk_norm false).
    theirs = ModelConfig(**read_hf_config(path))
    model = ModelConfig(**_filled(cfg.model, theirs, given, "model."))
    _check_given(path, model, theirs, given)
    check_same_model(path, model.arch, model, key="model.init_from")  # as a fresh start checks it
    return dataclasses.replace(cfg, model=model)


def _is_section(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _filled(mine: Any, theirs: Any, given: set[str], prefix: str) -> dict:
    """The fields of section `theirs` (config.json's, a dataclass) with those `given` and
    the TRAINING_ONLY ones taken from `mine` (the run's, the same dataclass or None: then
    the section's defaults), recursing into the sections config.json has."""
    out = {}
    for f in dataclasses.fields(theirs):
        name, b = prefix + f.name, getattr(theirs, f.name)
        a = getattr(mine, f.name) if mine is not None else None
        if name in TRAINING_ONLY:
            if mine is not None:
                out[f.name] = a
        elif name in given and not (_is_section(a) and _is_section(b)):
            out[f.name] = a
        elif _is_section(b):  # given by some of its keys, or not given
            out[f.name] = type(b)(**_filled(a if _is_section(a) else None, b, given, name + "."))
        else:
            out[f.name] = b
    return out


def _pairs(a: Any, b: Any, prefix: str) -> Iterator[tuple[str, Any, Any, bool]]:
    """(dotted key, ours, theirs, is a section) for every field of two sections, in field
    order, a section before its fields (which come only when both sides have it)."""
    for f in dataclasses.fields(a if a is not None else b):
        x, y = (getattr(s, f.name) if s is not None else None for s in (a, b))
        section = _is_section(x) or _is_section(y)
        yield prefix + f.name, x, y, section
        if section and x is not None and y is not None:
            yield from _pairs(x, y, prefix + f.name + ".")


def _same(a: Any, b: Any, section: bool) -> bool:
    if section:  # both present: their fields are compared one by one
        return (a is None) == (b is None)
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-6)
    return a == b


def _check_given(path: Path, model: ModelConfig, theirs: ModelConfig, given: set[str]) -> None:
    """Each given key equals config.json's, or the checkpoint check lets it differ (the
    checkpoint's model with that one key changed passes check_same_model)."""
    for name, a, b, section in _pairs(model, theirs, "model."):
        if name not in given or name in TRAINING_ONLY or _same(a, b, section):
            continue
        try:
            probe = _replaced(theirs, name.split(".")[1:], a)
            check_same_model(path, probe.arch, probe)
        except ConfigError:
            raise ConfigError(_message(path, name, a, b, model, given)) from None


def _replaced(section: Any, keys: list[str], value: Any) -> Any:
    """`section` with the field at the path `keys` set to `value` (each level rebuilt, so
    its own checks run)."""
    head, *rest = keys
    inner = value if not rest else _replaced(getattr(section, head), rest, value)
    return dataclasses.replace(section, **{head: inner})


def _message(path: Path, name: str, a: Any, b: Any, model: ModelConfig, given: set[str]) -> str:
    """`KEY=VALUE given, but DIR/config.json says THEIRS: fix`; for a section the
    checkpoint does not have, its first given key (model.moe.top_k=3 ... says model.moe
    null)."""
    source = path / "config.json"
    if _is_section(a) and b is None:
        key, value = _first_given(a, name + ".", given) or (name, a)
        return f"{key}={_spell(value, key)} given, but {source} says {name} null: {_FIX}"
    return f"{name}={_spell(a, name)} given, but {source} says {_spell(b, name)}: {_FIX}"


def _first_given(section: Any, prefix: str, given: set[str]) -> tuple[str, Any] | None:
    """(dotted key, value) of the first key of `section` (at any depth) that was given."""
    for f in dataclasses.fields(section):
        key, value = prefix + f.name, getattr(section, f.name)
        found = _first_given(value, key + ".", given) if _is_section(value) else (key, value) if key in given \
            else None
        if found:
            return found
    return None


def _spell(value: Any, name: str) -> str:
    """A value of key `name` as a YAML file or a flag spells it: gpt2, 4, null, true,
    {"num_experts": 4, ...} (a section without its TRAINING_ONLY keys)."""
    if _is_section(value):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                 if f"{name}.{f.name}" not in TRAINING_ONLY}
    if isinstance(value, str) and value:
        return value
    return json.dumps(value, default=list)
