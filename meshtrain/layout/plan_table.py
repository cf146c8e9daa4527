"""Human-readable rendering of a Plan (rich tables), grouping repeated layers: the full
table (`plan_table`, str(plan)) and the one `meshtrain plan` prints at 80 columns
(`param_table`)."""

from __future__ import annotations

import io
import re
from collections import OrderedDict

from rich import box
from rich.console import Console
from rich.table import Table

from .placements import MARKED_ACTIVATIONS, placement_str


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def plan_table(plan) -> Table:
    mesh = " x ".join(f"{a}={plan.mesh.size(a)}" for a in plan.mesh.axes)
    cp = f", cp_comm {plan.cp_comm} (zigzag sequence)" if plan.mesh.cp > 1 else ""
    experts = plan.mesh.experts()
    if experts is not plan.mesh:  # expert weights' placements refer to the refolded mesh
        cp += ", expert mesh " + " x ".join(f"{a}={experts.size(a)}" for a in experts.axes) + " (*)"
    table = Table(title=f"plan: world {plan.mesh.world}, mesh {mesh}{cp}")
    for col in ("parameter", "count", "shape", "mesh axes", "placements", "local shape", "bytes/rank"):
        table.add_column(col, justify="right" if col in ("count", "bytes/rank") else "left")
    for pattern, members in _groups(plan, plan.params).items():
        p = members[0]
        axes = ", ".join("+".join(a) or "-" for a in p.layout.dim_axes)
        table.add_row(pattern + (" (*)" if p.mesh is not plan.mesh else ""), str(len(members)), str(tuple(p.spec.shape)), axes,
                      "[" + ", ".join(placement_str(x) for x in p.placements) + "]",
                      str(tuple(p.local_shape)), human_bytes(p.bytes_per_rank))
    table.add_section()
    table.add_row("total", str(len(plan.params)), "", "", "", "", human_bytes(plan.param_bytes_per_rank))
    return table


def param_table(plan, names=None, title: str | None = None) -> Table:
    """The parameters in `names` (default: all), grouped by layer pattern, narrow enough for
    80 columns with whole names: shapes as AxB, the mesh axes of each dim (the DTensor
    placements are in the JSON), no vertical rules. A (*) marks expert weights, placed on
    the expert mesh."""
    names = plan.params if names is None else names
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=0, title_justify="left")
    for col in ("parameter", "n", "shape", "mesh axes", "local shape", "bytes/rank"):
        table.add_column(col, justify="right" if col in ("n", "bytes/rank") else "left",
                         no_wrap=col != "parameter", overflow="fold")
    for pattern, members in _groups(plan, names).items():
        p = members[0]
        table.add_row(pattern + (" (*)" if p.mesh is not plan.mesh else ""), str(len(members)),
                      _shape(p.spec.shape), ",".join("+".join(a) or "-" for a in p.layout.dim_axes),
                      _shape(p.local_shape), human_bytes(p.bytes_per_rank))
    table.add_section()
    table.add_row("total", str(sum(1 for n in plan.params if n in names)), "", "", "",
                  human_bytes(sum(p.bytes_per_rank for n, p in plan.params.items() if n in names)))
    return table


def _shape(shape) -> str:
    return "x".join(map(str, shape))


def _groups(plan, names) -> OrderedDict[str, list]:
    groups: OrderedDict[str, list] = OrderedDict()
    for p in plan.params.values():
        if p.name in names:
            groups.setdefault(_pattern(p.name), []).append(p)
    return groups


def activation_table(plan) -> Table:
    table = Table(title="marked activations")
    for col in ("activation", "logical axes", "mesh axes", "placements"):
        table.add_column(col)
    for name, axes in MARKED_ACTIVATIONS.items():
        layout = plan.activation(axes)
        table.add_row(name, "(" + ", ".join(a or "-" for a in axes) + ")",
                      ", ".join("+".join(a) or "-" for a in layout.dim_axes),
                      "[" + ", ".join(placement_str(p) for p in layout.placements) + "]")
    return table


def render(plan) -> str:
    console = Console(width=140, record=True, file=io.StringIO())
    console.print(plan_table(plan))
    console.print(activation_table(plan))
    return console.export_text()
