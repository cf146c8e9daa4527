"""The worlds a preset is meant for, from its first line.

A GPU preset opens with `# <model>: worlds 8, 64 (nodes of 8 H100 80GB) — <layout>`: the
word `worlds` and a comma-separated list of rank counts at which `meshtrain plan --gpu
h100` fits. `meshtrain plan` without --world plans at the smallest of them.
"""

from __future__ import annotations

import re
from pathlib import Path

_WORLDS = re.compile(r"\bworlds\s+(\d+(?:\s*,\s*\d+)*)")


def preset_worlds(path: str | Path) -> list[int]:
    """The worlds the first line of the YAML file at `path` names, or [] if it names none."""
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    match = _WORLDS.search(first) if first.startswith("#") else None
    return [int(n) for n in match.group(1).split(",")] if match else []
