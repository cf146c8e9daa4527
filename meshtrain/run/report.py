"""Where a run's numbers go: the console (rank 0), metrics.jsonl and TensorBoard.

The console is a scrolling table, one row per logged step, every row within 80 columns so
a terminal, a SLURM log and an editor show it alike; its header repeats every
HEADER_EVERY rows. On a terminal a live line under the table shows the progress bar and
the current step, and while the first step compiles, how long it has been compiling.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path

from ..errors import TrainingError

WIDTH = 80
HEADER_EVERY = 40


def _si(x: float) -> str:
    """1,234 / 12.3k / 4.56M: at most 6 characters up to 999.9G."""
    if x < 10_000:
        return f"{x:,.0f}"
    for unit, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9)):
        if x < 1000 * scale or unit == "G":
            return f"{x / scale:.1f}{unit}"
    return f"{x:.3g}"


def count(n: int) -> str:
    """A parameter count: 3.16M, 405.85B."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def banner(cfg, plan, specs: dict, data, world: int, device, accumulation: int, dp_size: int) -> str:
    """A run's first three short lines: the model and run_dir, the layout, the batch."""
    t = cfg.train
    n_params = sum(s.numel for s in specs.values())
    mesh = " x ".join(f"{a}={plan.mesh.size(a)}" for a in plan.mesh.axes)
    if plan.mesh.ep > 1:
        mesh += f", experts ep={plan.mesh.ep}"
    options = [t.precision + (f" {t.fp8_recipe}" if t.precision == "fp8" else "")]
    options += ["compiled"] * bool(t.compile)
    options += [f"{t.activation_checkpointing} recompute"] * (t.activation_checkpointing not in ("none", "offload"))
    options += ["activations offloaded"] * (t.activation_checkpointing == "offload")
    options += ["optimizer state offloaded"] * t.optimizer_offload
    masks = sum(p.has_loss_mask for p in data.train.parts)
    return (f"[bold]meshtrain fit[/] {cfg.model.arch} {count(n_params)} params -> {Path(cfg.run_dir)}\n"
            f"  world {world} ({mesh}) on {device.type}, {', '.join(options)}\n"
            f"  batch {t.global_batch} x {t.seq_len} tokens: {accumulation} micro-step(s) of "
            f"{t.micro_batch} x {dp_size} data-parallel rank(s)"
            + (f"; loss masks from {masks} of {len(data.names)} dataset(s)" if masks else ""))


def duration(seconds: float | None) -> str:
    """h:mm:ss, or Nd hh:mm past a day; '-' when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(round(seconds))
    if s >= 86_400:
        return f"{s // 86_400}d {s % 86_400 // 3600:02d}:{s % 3600 // 60:02d}"
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class StepTable:
    """Formats records as rows under a header. The columns are fixed for a run (from its
    first record), so rows line up; those that would pass WIDTH go on a second line."""

    def __init__(self, total_steps: int, mfu: bool):
        self.total, self.mfu = total_steps, mfu
        step_width = max(len("step"), 2 * len(str(total_steps)) + 1)
        self.columns = [  # (header, width, the record's key, its format)
            ("step", step_width, "step", lambda r: f"{r['step']}/{self.total}"),
            ("loss", 8, "loss", lambda r: f"{r['loss']:.4f}"),
            ("lr", 8, "lr", lambda r: f"{r['lr']:.2e}"),
            ("gnorm", 7, "grad_norm", lambda r: f"{r['grad_norm']:.3f}"),
            ("ms/step", 7, "step_time_s", lambda r: _unknown(r["step_time_s"], lambda x: f"{1e3 * x:,.0f}")),
            ("tok/s", 6, "tokens_per_s", lambda r: _unknown(r["tokens_per_s"], _si)),
        ]
        self.extra = []  # columns that did not fit: "header value" on a line of their own
        self.chosen = False

    def _choose(self, first: dict) -> None:
        optional = [("mfu", 6, "mfu", lambda r: _unknown(r["mfu"], lambda x: f"{100 * x:.1f}%"))] if self.mfu else []
        optional += [("mem GiB", 7, "memory_gib", lambda r: f"{r['memory_gib']:.2f}"),
                     ("eta", 8, "eta_s", lambda r: duration(r["eta_s"])),
                     ("aux_loss", 8, "aux_loss", lambda r: f"{r['aux_loss']:.4f}"),
                     ("imbal", 5, "expert_imbalance", lambda r: f"{r['expert_imbalance']:.2f}"),
                     ("mtp_loss", 8, "mtp_loss", lambda r: f"{r['mtp_loss']:.4f}")]
        for col in optional:
            if col[2] not in first:
                continue
            width = sum(c[1] + 1 for c in self.columns) + col[1]
            (self.columns if width <= WIDTH else self.extra).append(col)

    def header(self) -> str:
        """The column names (after the first row, which chooses the columns)."""
        return " ".join(f"{h:>{w}}" for h, w, _, _ in self.columns)

    def rows(self, r: dict) -> list[str]:
        """The record as its row, and a second line for what did not fit (extra columns,
        the validation loss, skipped steps, a checkpoint's stall and write time)."""
        if not self.chosen:
            self._choose(r)
            self.chosen = True
        lines = [" ".join(f"{fmt(r):>{w}}" for _, w, _, fmt in self.columns)]
        more = [f"{h} {fmt(r)}" for h, _, key, fmt in self.extra if key in r]
        if "val_loss" in r:
            more.append(f"val_loss {r['val_loss']:.4f} (ppl {r['val_ppl']:.2f})")
        if "skipped_steps" in r:
            more.append(f"skipped steps {r['skipped_steps']}")
        if "ckpt_stall_s" in r:
            more.append(f"checkpoint stall {r['ckpt_stall_s']:.2f} s")
        if "ckpt_write_s" in r:
            which = f" of step {r['ckpt_write_step']}" if r.get("ckpt_write_step", r["step"]) != r["step"] else ""
            more.append(f"checkpoint{which} written in {r['ckpt_write_s']:.2f} s")
        if more:
            lines.append(" " * 4 + "  ".join(more))
        return lines


def _unknown(x, fmt) -> str:
    return "-" if x is None else fmt(x)


class _Compiling:
    """The live line while the first step compiles: its age, re-rendered by rich's thread."""

    def __init__(self):
        self.since = time.perf_counter()

    def __rich__(self) -> str:
        return f"compiling the step ... {time.perf_counter() - self.since:.0f} s"


class Reporter:
    """Rank 0's outputs: the console table, metrics.jsonl and TensorBoard when it is
    installed. On other ranks every call does nothing."""

    def __init__(self, enabled: bool, run_dir: Path, total_steps: int, mfu: bool = False,
                 resumed_step: int | None = None):
        self.enabled, self.total = enabled, total_steps
        self.console = self.live = self.tb = None
        self.table, self.rows_printed = StepTable(total_steps, mfu), 0
        self.path = run_dir / "metrics.jsonl"
        self.tensorboard = run_dir / "tensorboard"
        if not enabled:
            return
        from rich.console import Console

        self.console = Console(highlight=False, soft_wrap=True)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            SummaryWriter = None
        if SummaryWriter is not None:
            # A resumed run hides what its last start logged past the checkpoint (a kill
            # between saves), as metrics.jsonl is cut back: no step is shown twice.
            purge = None if resumed_step is None else resumed_step + 1
            self.tb = SummaryWriter(str(self.tensorboard), purge_step=purge)

    def tensorboard_line(self) -> str:
        if self.tb is not None:
            return f"tensorboard: {self.tensorboard}"
        return "tensorboard: off (pip install tensorboard to log there too)"

    def print(self, *args, **kwargs) -> None:
        if self.console is not None:
            (self.live.console if self.live else self.console).print(*args, **kwargs)

    def start(self, kept: list[dict]) -> None:
        """Begin writing metrics.jsonl with the records a resumed run keeps."""
        if not self.enabled:
            return
        # Replaced whole: a kill during the rewrite must not lose the records kept.
        tmp = self.path.with_name(self.path.name + ".tmp")
        with self._writing():
            with open(tmp, "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        if self.console.is_terminal:
            from rich.live import Live

            self.live = Live(console=self.console, refresh_per_second=4, transient=True)
            self.live.start()

    def compiling(self) -> None:
        """The first step of a compiled run is about to start."""
        if self.live is not None:
            self.live.update(_Compiling())
        else:
            self.print("compiling the step ...")

    def compiled(self, seconds: float) -> None:
        self.print(f"compiled in {seconds:.1f} s (with step 1, left out of ETA and tok/s)")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self._writing(), open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(f"train/{key}" if not key.startswith("val_") else f"val/{key[4:]}",
                                       value, record["step"])
        lines = self.table.rows(record)
        if self.rows_printed % HEADER_EVERY == 0:
            lines.insert(0, self.table.header())
        self.rows_printed += 1
        for line in lines:
            self.print(line)
        if self.live is not None:
            self.live.update(_progress(record, self.total))

    @contextlib.contextmanager
    def _writing(self):
        try:
            yield
        except OSError as e:
            raise TrainingError(f"cannot write {self.path} ({e.strerror or e}): the checkpoints already written are "
                                "intact; free space or make run_dir writable, then run the same command again to "
                                "resume from the latest") from None

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
        if self.tb is not None:
            self.tb.close()


def _progress(r: dict, total: int):
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    bar = Table.grid(padding=(0, 2))
    bar.add_row(ProgressBar(total=total, completed=r["step"], width=40), f"step {r['step']}/{total}",
                f"eta {duration(r.get('eta_s'))}")
    return bar
