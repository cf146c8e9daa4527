"""Packages that load their modules on first use: `import meshtrain.data` (or .models,
.checkpoint) costs nothing until a name of it is asked for, so the config, whose sections
live beside what they configure, parses and prints without importing torch."""

from __future__ import annotations

import importlib
from typing import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str], first_use: Callable[[], None] | None = None):
    """A module `__getattr__` for `package`: `exports` maps each public name to the
    submodule (relative, e.g. ".store") that defines it; any other name is tried as a
    submodule. `first_use` runs once, before the first name is resolved."""
    namespace = importlib.import_module(package).__dict__
    pending = [first_use] if first_use is not None else []

    def __getattr__(name: str):
        while pending:  # taken first (its own lookups must not run it again), put back if it fails
            first = pending.pop()
            try:
                first()
            except BaseException:
                pending.append(first)
                raise
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
        elif name.startswith("__"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        else:
            try:
                value = importlib.import_module(f".{name}", package)
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        namespace[name] = value
        return value

    return __getattr__
