"""Hand-made hardware and timed dry runs for the step-time model's tests
(tests/test_step_time.py, tests/test_step_time_drift.py)."""

from __future__ import annotations

import math

import pytest
import yaml

from meshtrain.config import RunConfig
from meshtrain.estimate.dryrun import dry_run
from meshtrain.estimate.hardware import Curve, Hardware, Link
from meshtrain.estimate.hardware_builtins import BUILTINS

from .cli import ROOT

FREE = 1e30  # TFLOP/s or bytes/s: a piece priced at this costs ~1e-30 of the step


def hand(mm=FREE, fp8=None, attention=FREE, memory=FREE, intra=(0.0, FREE), inter=(0.0, FREE),
         launch=0.0) -> Hardware:
    """Flat curves (half 0), by default no host launch (sharded or not): every piece is its closed form."""
    rates = {"fp32": mm, "bf16": mm, "fp16": mm, "fp8": fp8 or mm}
    return Hardware(name="hand", memory_bytes=10**15, ranks_per_node=8, peak_tflops=dict(rates),
                    matmul={d: Curve(r, 0.0) for d, r in rates.items()},
                    attention={d: Curve(attention, 0.0) for d in rates}, memory_bandwidth=memory,
                    links={"intra_node": Link(*intra), "inter_node": Link(*inter)}, launch_s=launch,
                    sharded_launch_s=launch)


def tiny(name: str = "tiny", **sections) -> RunConfig:
    """configs/<name>.yaml with `sections` merged in: tiny(parallel={"fsdp": 2})."""
    raw = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())

    def merge(into: dict, new: dict) -> None:
        for k, v in new.items():
            if isinstance(v, dict):
                merge(into[k], v)
            else:
                into[k] = v

    merge(raw, sections)
    return RunConfig.from_dict(raw).validate()


def timed(cfg: RunConfig, world: int, hw: Hardware = BUILTINS["h100"]) -> dict:
    """The dry run's `time`, checked to add up and to give tokens/s and MFU from step_s."""
    run = dry_run(cfg, world, hw)
    t, b = run.time, run.time["breakdown"]
    parts = [v for k, v in b.items() if k != "exposed_comm"] + list(b["exposed_comm"].values())
    assert all(s >= 0 for s in parts), b
    assert math.fsum(parts) == pytest.approx(t["step_s"], rel=1e-12)
    tr = cfg.train
    assert t["tokens_per_s_per_gpu"] == pytest.approx(tr.global_batch * tr.seq_len / t["step_s"] / world, rel=1e-12)
    peak = hw.peak_tflops["bf16" if tr.precision == "fp8" else tr.precision] * 1e12
    assert t["mfu"] == pytest.approx(run.compute["step_flops_per_rank"] / t["step_s"] / peak, rel=1e-12)
    assert t["hardware"] == hw.name and t["hardware_given"]
    return {**t, "run": run, "comm": sum(b["exposed_comm"].values())}
