"""Models as pure functions of a flat parameter dict, one registered family per folder.

The package loads on first use: `import meshtrain.models` (as the config does, for its
model.* section in models/config.py) imports no torch until one of its names is asked for;
that first use registers the families below."""

from __future__ import annotations

import importlib

from ..lazy import lazy_exports

# The model families, by model.arch: one line per family (its folder's FAMILY).
FAMILY_FOLDERS = ("llama", "gpt2", "deepseek_v3")


def _register_families() -> None:
    register = importlib.import_module(".family", __name__).register
    for folder in FAMILY_FOLDERS:
        register(importlib.import_module(f".{folder}", __name__).FAMILY)


_EXPORTS = {**dict.fromkeys(["FAMILIES", "Family", "ModelDef", "build", "get_family", "register"], ".family"),
            "LocalContext": ".context", "ModelContext": ".context", "ParamSpec": ".spec", "ModelConfig": ".config"}
__getattr__ = lazy_exports(__name__, _EXPORTS, first_use=_register_families)
__all__ = sorted([*_EXPORTS, *FAMILY_FOLDERS])
