"""bench/gpu_kit.py's wiring, on the CPU with tiny shapes (`--smoke`): a fit run through
the CLI (its metrics and checkpoint read back, the run directory removed), a bench's
JSON collected, the summary's ratios, and a step the deadline leaves out. The GPU run
itself needs a lent machine (docs/gpu.md). bench/gpu_check.py's CUDA-only branches run here
on the CPU (`--smoke`: the same code, small shapes), and without `--smoke` it only says it
needs a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_the_gpu_check_runs_each_branch_on_the_cpu_through_the_kit(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "bench/gpu_kit.py", "--smoke", "--out", str(out), "--only", "gpu_check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "logs" / "gpu_check.log").read_text()
    results = json.loads((out / "results.json").read_text())
    check = results["steps"]["gpu_check"]["result"]
    assert results["summary"]["gpu_check_passed"] is True
    checks = check["checks"]
    assert list(checks) == ["async_save", "pinned", "fp8_tensorwise", "fp8_rowwise", "grouped_bfloat16",
                            "grouped_float32", "mla_bf16", "mla_fp32"], checks
    assert all(c["pass"] for c in checks.values()) and check["smoke"] and check["device"] == "cpu"
    assert checks["async_save"]["differing"] == [] and checks["async_save"]["tensors"] == 12
    assert checks["pinned"]["buffers"] == 12 and checks["pinned"]["pinned"] == 0  # CPU tensors: not pinned
    assert all(checks[f"fp8_{r}"]["scaled_mm_calls"] == 3 for r in ("tensorwise", "rowwise"))
    assert all(checks[f"grouped_{d}"]["grouped_mm_calls"] == 3 for d in ("bfloat16", "float32"))
    assert all(checks[f"mla_{p}"]["measured"] == checks[f"mla_{p}"]["planner"] > 0 for p in ("bf16", "fp32"))
    log = (out / "logs" / "gpu_check.log").read_text()
    assert sum(line.startswith("PASS ") for line in log.splitlines()) == 8, log


def test_the_gpu_check_without_a_gpu_says_it_needs_one(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the check runs for real")
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--json", str(tmp_path / "c.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "needs a CUDA GPU" in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "c.json").exists()
