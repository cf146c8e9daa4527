"""Human-readable rendering of a Plan (rich table), grouping repeated layers."""

from __future__ import annotations

import io
import re
from collections import OrderedDict

from rich.console import Console
from rich.table import Table


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def plan_table(plan) -> Table:
    from .plan import placement_str

    mesh = " x ".join(f"{a}={plan.mesh.size(a)}" for a in plan.mesh.axes)
    cp = f", cp_comm {plan.cp_comm} (zigzag sequence)" if plan.mesh.cp > 1 else ""
    experts = plan.mesh.experts()
    if experts is not plan.mesh:  # expert weights' placements refer to the refolded mesh
        cp += ", expert mesh " + " x ".join(f"{a}={experts.size(a)}" for a in experts.axes) + " (*)"
    table = Table(title=f"plan: world {plan.mesh.world}, mesh {mesh}{cp}")
    for col in ("parameter", "count", "shape", "mesh axes", "placements", "local shape", "bytes/rank"):
        table.add_column(col, justify="right" if col in ("count", "bytes/rank") else "left")
    groups: OrderedDict[str, list] = OrderedDict()
    for p in plan.params.values():
        groups.setdefault(_pattern(p.name), []).append(p)
    for pattern, members in groups.items():
        p = members[0]
        axes = ", ".join("+".join(a) or "-" for a in p.layout.dim_axes)
        table.add_row(pattern + (" (*)" if p.mesh is not plan.mesh else ""), str(len(members)), str(tuple(p.spec.shape)), axes,
                      "[" + ", ".join(placement_str(x) for x in p.placements) + "]",
                      str(tuple(p.local_shape)), human_bytes(p.bytes_per_rank))
    table.add_section()
    table.add_row("total", str(len(plan.params)), "", "", "", "", human_bytes(plan.param_bytes_per_rank))
    return table


def activation_table(plan) -> Table:
    from .plan import MARKED_ACTIVATIONS, placement_str

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
