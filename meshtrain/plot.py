"""`meshtrain plot`: a PNG of one or more runs' metrics.jsonl, overlaid.

    meshtrain plot runs/tiny --out tiny.png
    meshtrain plot runs/lr3e-4 runs/lr1e-3 --out lr.png

Four panels with the step on the x axis: the loss (and the eval loss, dashed, where the
run evaluated), the learning rate, the gradient norm (before clipping) and tokens/s; one
colour per run, labelled by its run_dir as given. matplotlib is an optional dependency
(the `plot` extra), imported only here, and drawn with the Agg backend through its
object API (no pyplot state, no display).

Only the standard library and errors are imported at module level: reading metrics needs
neither torch nor matplotlib.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .errors import ConfigError

INSTALL = 'pip install "meshtrain[plot]" (or pip install matplotlib)'

# (the record's key, the panel's title); val_loss is drawn in the loss panel.
PANELS = (("loss", "loss (mean per target token)"), ("lr", "learning rate"),
          ("grad_norm", "grad norm (before clipping)"), ("tokens_per_s", "tokens/s (global)"))
KEYS = tuple(key for key, _ in PANELS) + ("val_loss",)


def read_metrics(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Each plotted key's (step, value) points, sorted by step.

    A line cut short by a crash mid-write is skipped (as a resumed run's reader does), and
    so are null and non-finite values (tokens_per_s of a compiled run's first step). A step
    recorded twice keeps its last record."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: {'not a directory' if run_dir.exists() else 'no such run directory'}")
    path = run_dir / "metrics.jsonl"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{run_dir}: no metrics.jsonl (is it a meshtrain fit run_dir?)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    by_step: dict[int, dict] = {}
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            by_step[step] = record  # the last record of a step wins
    if not by_step:
        raise ConfigError(f"{path}: no step records to plot")
    return {key: [(step, float(r[key])) for step, r in sorted(by_step.items()) if _number(r.get(key))]
            for key in KEYS}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plot_runs(run_dirs: list[str], out: str) -> str:
    """Draw the runs into `out` (a .png, or any format matplotlib writes: .svg, .pdf);
    returns the one line that says what was written."""
    runs = {name.rstrip("/") or name: read_metrics(name) for name in run_dirs}
    try:
        import matplotlib  # the package first: a cached submodule alone would import without it
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(f"meshtrain plot needs matplotlib: {INSTALL}") from None
    fig = Figure(figsize=(12, 8), dpi=100, layout="constrained")
    canvas = FigureCanvasAgg(fig)
    suffix = Path(out).suffix.lower().lstrip(".")
    if suffix and suffix not in canvas.get_supported_filetypes():
        raise ConfigError(f"--out {out}: give a .png file (or .svg, .pdf)")
    _draw(fig, runs, _colours(matplotlib.colormaps, len(runs)))
    try:
        fig.savefig(out, format=suffix or "png")
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write it ({e.strerror or e})") from None
    steps = {name: len({s for key in KEYS for s, _ in series[key]}) for name, series in runs.items()}
    each = f" ({', '.join(f'{name} {n:,}' for name, n in steps.items())})" if len(runs) <= 4 else ""
    return f"wrote {out}: {_count(len(runs), 'run')}, {_count(sum(steps.values()), 'step')}{each}"


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}" + "s" * (n != 1)


def _draw(fig, runs: dict[str, dict], colours: list) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter, MaxNLocator

    axes = list(fig.subplots(2, 2, sharex=True).flat)
    for ax, (key, title) in zip(axes, PANELS):
        ax.set_title(title, fontsize=11)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for colour, series in zip(colours, runs.values()):
            _line(ax, series[key], colour, "-")
            if key == "loss":
                _line(ax, series["val_loss"], colour, "--", marker="o")
    for ax in axes[2:]:
        ax.set_xlabel("step")
        ax.tick_params(labelbottom=True)
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    axes[3].yaxis.set_major_formatter(EngFormatter(sep=""))
    if any(series["val_loss"] for series in runs.values()):
        axes[0].legend(handles=[Line2D([], [], color="grey", ls="-", label="train"),
                                Line2D([], [], color="grey", ls="--", marker="o", label="eval (val_loss)")],
                       loc="upper right", fontsize=9)
    handles = [Line2D([], [], color=c, lw=2, label=name) for c, name in zip(colours, runs)]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(runs), 3), fontsize=10, frameon=False)


def _line(ax, points: list[tuple[int, float]], colour, style: str, marker: str | None = None) -> None:
    if not points:
        return
    steps, values = zip(*points)
    # Markers where there are few points, so a short run (or a single eval) still shows;
    # thinner lines where there are many, so noisy overlaid runs hide each other less.
    marker = marker or ("." if len(points) <= 30 else None)
    ax.plot(steps, values, color=colour, ls=style, marker=marker, markersize=4, lw=1.5 if len(points) <= 200 else 0.8)


def _colours(colormaps, n: int) -> list:
    """One distinct colour per run: tab10; up to 20, tab20's dark hues then its light ones
    (its own order pairs them, so neighbouring runs would look alike); then viridis."""
    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [colormaps["tab20"](2 * i % 20 + i // 10) for i in range(n)]
    return [colormaps["viridis"](i / (n - 1)) for i in range(n)]
