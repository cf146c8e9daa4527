"""`meshtrain plot`: runs' metrics.jsonl drawn into one image, through the real CLI.

The runs are synthetic metrics.jsonl files (no training), so these take seconds.
"""

from __future__ import annotations

import json
import math
import struct
import sys

import pytest

from meshtrain.cli import main
from meshtrain.plot import read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir, steps=20, lr=3e-4, eval_every=5, extra_lines=()):
    """A run_dir with a metrics.jsonl as fit writes it (the keys the plot reads, and some it
    does not), then `extra_lines` as they are."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "loss": 6.0 - step * 0.1, "lr": lr * min(1, step / 5), "grad_norm": 5.0 / step,
                  "tokens_per_s": None if step == 1 else 2000.0 + step, "step_time_s": 0.5, "mfu": None}
        if eval_every and step % eval_every == 0:
            record |= {"val_loss": 6.1 - step * 0.1, "val_ppl": math.exp(6.1 - step * 0.1)}
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join([*lines, *extra_lines]) + "\n")
    return run_dir


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000
    return struct.unpack(">II", data[16:24])  # IHDR: width, height


def test_one_run_writes_a_png(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    out = tmp_path / "one.png"
    assert main(["plot", str(run), "--out", str(out)]) == 0
    assert png_size(out) == (1200, 800)
    line = capsys.readouterr().out.strip()
    assert line == f"wrote {out}: 1 run, 20 steps ({run} 20)"


def test_two_runs_overlaid(tmp_path, capsys):
    a = write_run(tmp_path / "a")
    b = write_run(tmp_path / "b", steps=12, lr=1e-3, eval_every=0)
    out = tmp_path / "two.png"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert png_size(out) == (1200, 800)
    assert capsys.readouterr().out.strip() == f"wrote {out}: 2 runs, 32 steps ({a} 20, {b} 12)"


def test_cut_lines_nulls_and_repeated_steps(tmp_path):
    """A line cut short by a crash is skipped, a null value is left out of its series, and
    a step recorded twice keeps its last record."""
    run = write_run(tmp_path / "run", steps=4, eval_every=2,
                    extra_lines=[json.dumps({"step": 4, "loss": 1.5, "lr": 1e-4, "grad_norm": 0.5}),
                                 '{"step": 5, "loss": 1.4, "lr"'])
    series = read_metrics(run)
    assert [s for s, _ in series["loss"]] == [1, 2, 3, 4] and series["loss"][-1] == (4, 1.5)
    assert [s for s, _ in series["tokens_per_s"]] == [2, 3]  # step 1: null; step 4: its last record has none
    assert [s for s, _ in series["val_loss"]] == [2]


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "nowhere", "no such run directory"),
    (lambda d: d, "no metrics.jsonl"),
    (lambda d: (d / "metrics.jsonl").write_text('{"step": 1, "lo\n') and d, "no step records"),
])
def test_a_bad_run_dir_exits_2_naming_it(tmp_path, capsys, make, words):
    good, bad = write_run(tmp_path / "good"), make(tmp_path)
    out = tmp_path / "x.png"
    assert main(["plot", str(good), str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and words in err and "Traceback" not in err
    assert not out.exists()


def test_an_unwritable_or_unknown_out_exits_2(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    assert main(["plot", str(run), "--out", str(tmp_path / "no" / "dir" / "x.png")]) == 2
    assert "cannot write it" in capsys.readouterr().err
    assert main(["plot", str(run), "--out", str(tmp_path / "x.txt")]) == 2
    assert "give a .png file" in capsys.readouterr().err


def test_without_matplotlib_exits_2_naming_the_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    run = write_run(tmp_path / "run")
    assert main(["plot", str(run), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install "meshtrain[plot]"' in err and "pip install matplotlib" in err


def test_run_dirs_and_out_are_required(capsys):
    assert main(["plot", "--out", "x.png"]) == 2
    assert main(["plot", "runs/tiny"]) == 2
