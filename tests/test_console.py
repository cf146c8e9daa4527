"""The console of `meshtrain fit` at 80 columns: the step table, the banner, and what the
first (compiling, warming-up) step does to tok/s and the ETA."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from meshtrain.cli import main
from meshtrain.run.report import Reporter, StepTable, duration
from support.cli import SMALL, TINY, read_metrics

RECORD = {"step": 14, "loss": 5.31327, "lr": 2.998e-4, "grad_norm": 2.0284, "tokens_per_s": 1234.5,
          "step_time_s": 0.0631, "mfu": None, "memory_gib": 0.352, "elapsed_s": 9.5, "eta_s": 430.0}


@pytest.mark.parametrize("total, extra, mfu", [
    (100, {}, False),
    (100_000, {"tokens_per_s": 163_840_000.0, "step_time_s": 12.8, "eta_s": 9 * 86_400.0}, False),
    (100_000, {"mfu": 0.523, "memory_gib": 71.25}, True),
    (100, {"aux_loss": 0.0513, "expert_imbalance": 3.87}, False),
    (100_000, {"aux_loss": 0.0513, "expert_imbalance": 3.87, "mfu": 0.41}, True),
    (100, {"val_loss": 4.1731, "val_ppl": 64.92, "skipped_steps": 2}, False),
])
def test_every_line_of_the_step_table_fits_80_columns(total, extra, mfu):
    table = StepTable(total, mfu)
    record = {**RECORD, **extra}
    rows = table.rows(record)  # the first row fixes the columns
    lines = [table.header(), *rows]
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    header, row = lines[0].split(), lines[1].split()
    assert header[:6] == ["step", "loss", "lr", "gnorm", "ms/step", "tok/s"]
    assert row[0] == f"14/{total}" and row[1] == "5.3133" and row[4] == f"{1e3 * record['step_time_s']:,.0f}"
    shown = " ".join(lines)
    assert "eta" in lines[0] and duration(record["eta_s"]) in shown
    for key, text in (("aux_loss", "0.0513"), ("expert_imbalance", "3.87"), ("val_loss", "4.1731")):
        assert (text in shown) == (key in record)
    assert ("52.3%" in shown or "41.0%" in shown) == mfu


def test_durations():
    assert [duration(s) for s in (None, float("inf"), 0.4, 61, 3 * 3600 + 62, 2 * 86_400 + 3600 * 4 + 120)] == \
        ["-", "-", "0:00:00", "0:01:01", "3:01:02", "2d 04:02"]


def test_a_pipe_gets_the_header_then_rows_and_the_compile_lines(tmp_path):
    rep = Reporter(True, tmp_path, 100)
    rep.console = Console(file=io.StringIO(), width=80, highlight=False, soft_wrap=True)
    rep.start([])
    rep.compiling()
    rep.compiled(34.06)
    for step in range(1, 43):
        rep.log({**RECORD, "step": step})
    rep.close()
    lines = rep.console.file.getvalue().splitlines()
    assert lines[:2] == ["compiling the step ...", "compiled in 34.1 s (with step 1, left out of ETA and tok/s)"]
    assert lines[2].split() == ["step", "loss", "lr", "gnorm", "ms/step", "tok/s", "mem", "GiB", "eta"]
    assert lines.count(lines[2]) == 2  # again after 40 rows
    assert len(lines) == 2 + 42 + 2 and all(len(line) <= 80 for line in lines)


def test_the_run_prints_a_short_banner_and_leaves_warm_up_out_of_the_eta(tmp_path, capsys, one_thread):
    """A real run through the CLI: every line of its console within 80 columns (the run dir
    aside), and the ETA and tok/s of step k from steps 2..k only: eta_s = (elapsed_s -
    warmup_s) / (k - 1) x (steps - k), exactly, since both are read at the same moment."""
    run_dir = tmp_path / "r"
    assert main(["fit", "--config", str(TINY), *SMALL, "--train.steps", "5", "--run_dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    for line in out.splitlines():
        assert len(line.replace(str(run_dir), "runs/x")) <= 80, line
    assert out.splitlines()[0].startswith("meshtrain fit llama ")
    records = read_metrics(run_dir)
    first = records[0]
    assert first["warmup_s"] == pytest.approx(first["step_time_s"]) and first["tokens_per_s"] is not None
    for r in records[1:]:
        k = r["step"]
        assert "warmup_s" not in r
        assert r["eta_s"] == pytest.approx((r["elapsed_s"] - first["warmup_s"]) / (k - 1) * (5 - k), rel=1e-6,
                                           abs=1e-9)
