"""`meshtrain plan`: the dry run at any scale through the CLI and the Python API, golden
plans for the GPU presets, node placement, and layouts that cannot run.

The memory and collective numbers themselves are validated against real steps in
tests/test_memory_estimate.py and tests/test_comms_estimate.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from meshtrain.config import RunConfig
from meshtrain.errors import ConfigError
from meshtrain.estimate.dryrun import GPU_MEMORY, dry_run
from meshtrain.layout.traffic import Traffic
from support.cli import ROOT, run_cli
from support.configs import preset

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("MESHTRAIN_REGEN_GOLDEN") == "1"
# The presets at their recipe scale: 8B on 8 nodes, 70B on 64, 405B on 2048 nodes (16384 GPUs).
PRESETS = {"llama3-8b": 64, "llama3-70b": 512, "llama3-405b": 16384}


# And every preset at 16384 ranks, with a global batch that 16384 / tp data-parallel ranks divide.
AT_16384 = {"llama3-8b": 16384, "llama3-70b": 2048, "llama3-405b": 2048}


@pytest.mark.parametrize("name, world", [*PRESETS.items(), *((n, 16384) for n in AT_16384 if PRESETS[n] != 16384)])
def test_golden_plans_of_the_presets(name, world):
    cfg = preset(name) if world == PRESETS[name] else preset(name, global_batch=AT_16384[name])
    got = dry_run(cfg, world).to_dict()
    path = GOLDEN / f"dryrun_{name}_{world}.json"
    if REGEN:
        path.write_text(json.dumps(got, indent=1) + "\n")
    assert got == json.loads(path.read_text()), f"plan changed; regenerate with MESHTRAIN_REGEN_GOLDEN=1 ({path})"


@pytest.mark.alone
def test_405b_at_16384_ranks_through_the_cli_in_under_60_s(tmp_path):
    out = tmp_path / "plan.json"
    start = time.perf_counter()
    proc = run_cli("plan", "--config", str(ROOT / "configs" / "llama3-405b.yaml"), "--world", "16384",
                   "--json", str(out))
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert seconds < 60, seconds
    plan = json.loads(out.read_text())
    assert {"world", "mesh", "per_rank_bytes", "collectives", "params"} <= set(plan)
    assert plan["world"] == 16384 and plan["mesh"] == {"fsdp": 2048, "tp": 8}
    assert set(plan["per_rank_bytes"]) == {"params", "grads", "optimizer", "activations", "peak"}
    assert {"axis", "op", "phase", "count", "bytes"} == set(plan["collectives"][0])
    assert {"name", "shape", "placements", "local_shape"} <= set(plan["params"][0])
    assert plan == dry_run(preset("llama3-405b"), 16384).to_dict()  # the CLI prints the Python API's numbers
    for words in ("fsdp", "2048 nodes", "layers.*.attn.wq", "peak", "reduce_scatter_sum"):
        assert words in proc.stdout, words


def test_state_bytes_follow_from_the_parameter_count():
    """params + grads + optimizer = 16 bytes per parameter, spread over the ranks that
    shard it (fsdp x tp, norms over fsdp only), to within the norms' share."""
    cfg = preset("llama3-405b")
    run = dry_run(cfg, 16384)
    n = sum(s.numel for s in cfg.model_def().specs.values())
    state = sum(run.memory[k] for k in ("params", "grads", "optimizer"))
    assert state == pytest.approx(16 * n / 16384, rel=0.01)


def test_which_ranks_share_a_node():
    run = dry_run(preset("llama3-70b"), 512)
    assert run.axis_nodes == {"fsdp": 64, "tp": 1} and not run.warnings
    cfg = preset("llama3-70b")
    import dataclasses

    wide = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, nproc_per_node=4)).validate()
    run = dry_run(wide, 512)
    assert run.axis_nodes["tp"] == 2
    assert any("parallel.tp=8 spans 2 nodes" in w for w in run.warnings)


def test_over_the_gpu_memory_names_layouts_that_fit():
    cfg = preset("llama3-8b", micro_batch=4, global_batch=256, compile=False)
    run = dry_run(cfg, 64, "h100")
    assert run.memory["peak"] > GPU_MEMORY["h100"]
    assert run.error and "exceeds the h100" in run.error and "fastest first" in run.error
    assert run.advice and all(f.flags in run.error and f.peak <= GPU_MEMORY["h100"] for f in run.advice)
    speeds = [f.tokens_per_s_per_gpu for f in run.advice]  # ranked by the step-time model
    assert speeds == sorted(speeds, reverse=True)
    with pytest.raises(ConfigError):
        run.check()
    proc = run_cli("plan", "--config", str(ROOT / "configs" / "llama3-8b.yaml"), "--world", "64", "--gpu", "h100",
                   "--train.micro_batch", "4", "--train.global_batch", "256", "--train.compile", "false")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and run.advice[0].flags in proc.stderr
    assert "memory of the most loaded rank" in proc.stdout  # the plan is shown before the error


@pytest.mark.parametrize("args, words", [
    (["--parallel.tp", "3"], ["parallel.tp=3", "choose parallel.tp among"]),
    (["--world", "12"], ["--world 12", "multiple of 8"]),
    (["--world", "24"], ["parallel.fsdp", "global_batch"]),
])
def test_layouts_that_cannot_work_exit_2_with_the_valid_choices(args, words):
    proc = run_cli("plan", "--config", str(ROOT / "configs" / "llama3-8b.yaml"), *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert all(w in proc.stderr for w in words), proc.stderr


def tiny(**parallel) -> RunConfig:
    raw = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    raw["parallel"].update(parallel)
    return RunConfig.from_dict(raw).validate()


@pytest.mark.parametrize("bucket", ["block", "param", 2])
def test_plan_counts_the_collectives_of_the_configured_bucket(bucket):
    """parallel.bucket reaches the collective table: configs/tiny.yaml (an untied Llama
    of L = 4 blocks, fp32, eager) on fsdp 2, m = 16 / (4 x 2) = 2 micro-steps. block: L + 2
    buckets (the table, each block, the final norm with the output table), each gathered
    and reduce-scattered once per micro-step and gathered again in backward but the
    table's; param: the same with one collective per parameter (9 L + 3). The bytes do not
    change; `buckets` says how many there are and the largest one's bytes."""
    from meshtrain.estimate.comms import step_collectives

    cfg = tiny(bucket=bucket)
    run = dry_run(cfg, 2)
    L, d, V, f = cfg.model.n_layers, cfg.model.dim, cfg.model.vocab_size, cfg.model.ffn_dim
    kv = cfg.model.n_kv_heads * d // cfg.model.n_heads
    block, table = 4 * (2 * d + 2 * d * d + 2 * kv * d + 3 * f * d), 4 * V * d
    rows = {(c["axis"], c["op"], c["phase"]): (c["count"], c["bytes"]) for c in run.collectives}
    m, units = 2, {"block": L + 2, "param": 9 * L + 3}.get(bucket)
    gathered = 2 * table + L * block + 4 * d  # fp32 bytes of every parameter
    assert rows[("fsdp", "all_gather", "forward")][1] == m * gathered
    assert rows[("fsdp", "reduce_scatter_sum", "backward")][1] == m * gathered
    # Gathered again in backward: all but the lookup table, unless (2 MB) the table shares
    # its bucket with block 0's first weights, whose saves need the bucket again.
    assert rows[("fsdp", "all_gather", "backward")][1] == m * (gathered - (table if units else 0))
    assert rows[("fsdp", "all_reduce_sum", "forward")] == (1, 4)  # the loss, once per step
    if units is not None:
        assert rows[("fsdp", "all_gather", "forward")][0] == m * units
        assert rows[("fsdp", "reduce_scatter_sum", "backward")][0] == m * units
        assert rows[("fsdp", "all_gather", "backward")][0] == m * (units - 1)
    plan = cfg.plan(world=2)
    assert run.collectives == step_collectives(plan, cfg.model_def(), micro_batch_rows=8, seq_len=cfg.train.seq_len,
                                               micro_steps=m, traffic=Traffic(bucket=bucket))
    b = run.to_dict()["buckets"]
    if bucket == "block":
        assert b == {"unit": "block", "count": L + 2, "largest_bytes": block}
    elif bucket == "param":
        assert b == {"unit": "param", "count": 0, "largest_bytes": 0}
    else:  # 2 MB: a block (2.9 MB) is cut in two; no bucket over 2 MB (no parameter is)
        assert b["unit"] == 2.0 and L + 2 < b["count"] < 9 * L + 3 and 0 < b["largest_bytes"] <= 2 * 2**20
        assert rows[("fsdp", "all_gather", "forward")][0] == m * b["count"]
    text = run.render(width=200)
    assert f"parallel.bucket {'2 MB' if bucket == 2 else bucket}" in text
    assert ("one collective per parameter" in text) == (bucket == "param")


def test_plan_json_reports_the_bucket_through_the_cli(tmp_path):
    out = tmp_path / "plan.json"
    proc = run_cli("plan", "--config", str(ROOT / "configs" / "tiny.yaml"), "--world", "2", "--parallel.bucket",
                   "param", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(out.read_text())
    assert plan["buckets"] == {"unit": "param", "count": 0, "largest_bytes": 0}
    assert {(c["axis"], c["op"], c["phase"]): c["count"] for c in plan["collectives"]}[
        ("fsdp", "all_gather", "forward")] == 2 * (9 * 4 + 3)
    assert "parallel.bucket param" in proc.stdout


def test_a_compiled_plan_buckets_as_an_eager_one():
    """llama3-8b compiles: one all-gather per bucket (32 blocks, the embedding, the final
    norm and head) per micro-step forward and one reduce-scatter backward, as eager."""
    run = dry_run(preset("llama3-8b"), 64)
    assert run.to_dict()["buckets"] == {"unit": "block", "count": 34, "largest_bytes": run.buckets["largest_bytes"]}
    assert "parallel.bucket block, 34 buckets" in run.render(width=200)
    cfg = preset("llama3-8b")
    mesh = cfg.plan(world=64).mesh
    m = cfg.accumulation_steps(mesh.dp * mesh.fsdp)
    rows = {(c["axis"], c["op"], c["phase"]): c["count"] for c in run.collectives if c["axis"] == "fsdp"}
    assert rows[("fsdp", "all_gather", "forward")] == 34 * m
    assert rows[("fsdp", "reduce_scatter_sum", "backward")] == 34 * m


