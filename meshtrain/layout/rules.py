"""Rules: logical axis name -> ordered mesh axes (major to minor), plus glob overrides."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from ..errors import ConfigError
from .mesh import MESH_AXES

# Logical axes the models use; a rule for any other name is a typo.
PARAM_AXES = ("vocab", "embed", "q_heads", "kv_heads", "mlp", "norm", "positions", "experts")
ACTIVATION_AXES = ("batch", "seq", "seq_sp")
LOGICAL_AXES = PARAM_AXES + ACTIVATION_AXES


@dataclass(frozen=True)
class Rules:
    """`mapping[axis]` lists the mesh axes that shard a dim named `axis`, major first.

    `overrides` maps a parameter-name glob to a partial mapping that replaces the
    defaults for matching parameters (first matching glob wins).
    """

    mapping: dict[str, tuple[str, ...]]
    overrides: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)

    @staticmethod
    def default(sp: bool = False) -> "Rules":
        return Rules({
            "batch": ("dp", "fsdp"),
            "seq": ("cp",),
            "seq_sp": ("cp", "tp") if sp else ("cp",),
            "vocab": ("tp",),
            "embed": ("fsdp", "cp"),
            "q_heads": ("tp",),
            "kv_heads": ("tp",),
            "mlp": ("tp",),
            "norm": ("fsdp", "cp"),
            "positions": (),
            "experts": ("ep",),
        })

    def __post_init__(self) -> None:
        object.__setattr__(self, "mapping", {k: tuple(v) for k, v in self.mapping.items()})
        object.__setattr__(self, "overrides", {g: {k: tuple(v) for k, v in m.items()}
                                               for g, m in self.overrides.items()})
        for where, mapping in [("rules", self.mapping)] + [(f"rules.overrides[{g!r}]", m)
                                                           for g, m in self.overrides.items()]:
            for axis, mesh_axes in mapping.items():
                if axis not in LOGICAL_AXES:
                    raise ConfigError(f"{where}: unknown logical axis {axis!r}; known axes are "
                                      f"{', '.join(LOGICAL_AXES)}")
                if len(set(mesh_axes)) != len(mesh_axes):
                    raise ConfigError(f"{where}[{axis!r}]: mesh axes {list(mesh_axes)} repeat an axis; "
                                      "list each mesh axis at most once")
                for m in mesh_axes:
                    if m not in MESH_AXES + ("ep",):
                        raise ConfigError(f"{where}[{axis!r}]: unknown mesh axis {m!r}; mesh axes are "
                                          f"{', '.join(MESH_AXES + ('ep',))}")

    def lookup(self, axis: str | None, param: str | None = None) -> tuple[str, ...]:
        if axis is None:
            return ()
        if param is not None:
            for pattern, mapping in self.overrides.items():
                if fnmatch.fnmatchcase(param, pattern) and axis in mapping:
                    return mapping[axis]
        return self.mapping.get(axis, ())

    def key(self) -> tuple:
        """Hashable, equal for equal rules (overrides in their order: the first match wins)."""
        return (tuple(sorted(self.mapping.items())),
                tuple((g, tuple(sorted(m.items()))) for g, m in self.overrides.items()))

    def to_dict(self) -> dict:
        return {"mapping": {k: list(v) for k, v in self.mapping.items()},
                "overrides": {g: {k: list(v) for k, v in m.items()} for g, m in self.overrides.items()}}
