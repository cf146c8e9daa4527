"""bench/gpu_kit.py's wiring, on the CPU with tiny shapes (`--smoke`): a fit run through
the CLI (its metrics and checkpoint read back, the run directory removed), a bench's
JSON collected, the summary's ratios, and a step the deadline leaves out. The GPU run
itself needs a lent machine (docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_kit_runs_its_steps_and_writes_one_json(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "bench/gpu_kit.py", "--smoke", "--out", str(out), "--only", "env",
                           "fit_fp8_tensorwise", "mfu_bf16", "mfu_fp8_tensorwise"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    steps = results["steps"]
    assert list(steps) == ["env", "fit_fp8_tensorwise", "mfu_bf16", "mfu_fp8_tensorwise"], steps
    assert results["failed"] == [] and results["skipped"] == []
    assert steps["env"]["device"] == "cpu"
    fit = steps["fit_fp8_tensorwise"]
    assert fit["steps"] == 3 and fit["checkpoints"] == ["step_00000003"] and fit["tokens_per_s"] > 0
    assert 0 < fit["last_loss"] < 10
    assert steps["mfu_bf16"]["result"]["ratio"] > 0
    summary = results["summary"]
    assert summary["fp8_tensorwise_over_bf16"] > 0 and summary["fp8_tensorwise_over_transformers"] > 0
    assert (out / steps["fit_fp8_tensorwise"]["log"]).exists()


def test_the_deadline_skips_what_it_cannot_fit(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "bench/gpu_kit.py", "--smoke", "--out", str(out), "--budget", "20",
                           "--only", "env", "fit_bf16"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    results = json.loads((out / "results.json").read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(results["steps"]) == [] and results["skipped"] == ["env", "fit_bf16"], results
