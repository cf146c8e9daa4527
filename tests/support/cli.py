"""`meshtrain ...` in a subprocess, and what its run directories hold.

Subprocess runs pin OMP_NUM_THREADS=1: on a small, shared CPU box a few threads spinning
against other processes make a tiny model a hundred times slower.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from meshtrain.data import build_data

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"

# The tiny config shrunk to seconds on one CPU core (1 layer, dim 64, 8 x 32 tokens), saving
# no checkpoint unless a test asks for one.
SMALL = ["--train.steps", "3", "--train.warmup_steps", "1", "--model.n_layers", "1", "--model.dim", "64",
         "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn_dim", "128", "--model.vocab_size", "264",
         "--model.max_seq_len", "64", "--train.seq_len", "32", "--train.global_batch", "8",
         "--train.micro_batch", "2", "--checkpoint.every", "0"]


def cli_env() -> dict:
    """The environment of a subprocess run: one thread, this checkout's meshtrain."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run_cli(*args: str, launcher: list[str] | None = None, timeout: float = 300,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """`python [launcher] -m meshtrain.cli args` in its own process group: on a timeout the
    whole group (a launcher's workers included) gets SIGABRT, so Python prints where each
    process was stuck, and nothing is left running."""
    cmd = [sys.executable, *(launcher or []), "-m", "meshtrain.cli", *args]
    env = {**cli_env(), "PYTHONFAULTHANDLER": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def step_rows(stdout: str) -> list[int]:
    """The steps of the console's table rows (`  3/3   5.4817 ...`)."""
    return [int(m) for m in re.findall(r"^ *(\d+)/\d+ ", stdout, re.M)]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> torch.Tensor:
    """A run's logged losses, in float64."""
    return torch.tensor([r["loss"] for r in read_metrics(run_dir)], dtype=torch.float64)


def global_batches(run_dir: Path) -> list[torch.Tensor]:
    """Each step's global batch, (global_batch, seq_len + 1) tokens, as `fit` reads them:
    samples [step x global_batch, (step + 1) x global_batch) of the training split its
    config.yaml's data section and seed make."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    d, t = cfg["data"], cfg["train"]
    data = build_data(d["paths"], d["tokenizer"], t["seq_len"], cfg["seed"], cfg["model"]["vocab_size"],
                      d["valid_fraction"])
    return [data.train.batch(step * t["global_batch"], t["global_batch"]) for step in range(t["steps"])]
