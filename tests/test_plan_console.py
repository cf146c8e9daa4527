"""What `meshtrain plan` prints: the verdict first (parameters, peak per rank, fits or not
and the layouts that do), every line within 80 columns with whole parameter names, a
parameter table that agrees with the memory table under pp, and advice whose flags,
applied, really fit."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex

import pytest

from meshtrain import cli
from meshtrain.estimate.dryrun import GPU_MEMORY, dry_run
from meshtrain.layout.plan_table import human_bytes
from support.cli import ROOT
from support.configs import preset

# The first screen: 405B at its showcase scale as the README used to run it
# (no checkpointing, compiled), which does not fit; and the MoE preset with the longest names.
OVER = ["--train.activation_checkpointing", "none", "--train.compile", "true"]


def plan_text(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setenv("COLUMNS", "80")
    code = cli.main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("config, world, extra, verdict", [
    ("llama3-405b", 16384, OVER, "does NOT fit on h100"),
    ("deepseek-v3-671b", 1024, ["--parallel.pp", "16"], "fits on h100"),  # its own pp: one stage's rows
    ("llama3-70b", 512, ["--parallel.pp", "4", "--train.compile", "false"], "fits on h100"),
])
def test_first_screen_at_80_columns(monkeypatch, capsys, config, world, extra, verdict):
    code, out, err = plan_text(monkeypatch, capsys, "--config", str(ROOT / "configs" / f"{config}.yaml"),
                               "--world", str(world), "--gpu", "h100", *extra)
    assert code == (2 if "NOT" in verdict else 0), err
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    head = "\n".join(lines[:10])
    cfg = preset(config)
    n = sum(s.numel for s in cfg.model_def().specs.values())
    assert f"{n / 1e9:.1f}B parameters" in lines[0]
    assert "peak memory" in head and verdict in head and f"world {world}" in head
    assert "…" not in out  # nothing cut with an ellipsis
    # The parameter table's rows each start with a whole name pattern (expert weights
    # marked (*)); without pp, every pattern has its row.
    names = {re.sub(r"\.\d+\.", ".*.", name) for name in cfg.model_def().specs}
    start = lines.index(next(line for line in lines if line.startswith("parameter ")))
    rows = [line.split()[0] for line in lines[start + 2:lines.index(next(
        line for line in lines[start:] if line.startswith("total ")))] if line.strip()]
    assert set(rows) <= names, set(rows) - names
    assert "--parallel.pp" in extra or set(rows) == names


def test_render_is_80_columns_by_default():
    run = dry_run(preset("qwen3-moe-30b-a3b"), 32, "h100")
    text = run.render()
    assert max(len(line) for line in text.splitlines()) <= 80
    specs = preset("qwen3-moe-30b-a3b").model_def().specs
    total = sum(s.numel for s in specs.values())
    routed = sum(s.numel for s in specs.values() if s.axes[0] == "experts")
    active = total - routed + routed * 8 // 128  # a token visits top_k = 8 of 128 experts
    assert text.splitlines()[0].startswith(f"{total / 1e9:.1f}B parameters ({active / 1e9:.1f}B active)")


def test_pp_parameter_table_agrees_with_the_memory_table():
    """Under pp the parameter table is the most loaded pp rank's: its total is the memory
    table's params, and both equal an independent sum, the unpipelined plan of the stage
    mesh (world / pp ranks) over the layers of that rank's stage plus the embedding."""
    cfg = preset("llama3-70b", compile=False)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=4)).validate()
    run = dry_run(cfg, 512)
    rank = run.memory["pp_rank"]
    (stage,) = [st for st in run.pipeline.stages if st.rank == rank]
    flat = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=1)).validate()
    stage_plan = flat.plan(world=512 // 4)
    expected = sum(p.bytes_per_rank for name, p in stage_plan.params.items()
                   if (name.startswith("layers.") and stage.layers[0] <= int(name.split(".")[1]) < stage.layers[1])
                   or (name == "tok_emb" and stage.has_embedding) or (name in ("norm", "output") and stage.has_head))
    assert run.memory["params"] == expected
    text = run.render()
    total = re.search(r"^total +(\d+) +(.+)$", text, re.MULTILINE)
    assert total.group(2).strip() == human_bytes(expected)
    assert re.search(rf"│ params +│ +{re.escape(human_bytes(expected))} │", text)
    # The table lists that rank's tensors only: 1 embedding + 9 per layer.
    assert int(total.group(1)) == stage.has_embedding + stage.has_head * 2 + 9 * (stage.layers[1] - stage.layers[0])


@pytest.mark.parametrize("config, world, extra, first", [
    ("llama3-405b", 16384, OVER, "--train.activation_checkpointing selective"),
    # 70B at 32 without checkpointing, gathered weights kept, one sequence per micro-batch
    # (nothing to halve): two compiled pipeline stages are modelled faster than four or
    # than re-gathering (the step-time model ranks the advice).
    ("llama3-70b", 32, ["--train.activation_checkpointing", "none", "--parallel.reshard_after_forward", "false",
                        "--data.document_mask", "false", "--train.micro_batch", "1"], "--parallel.pp 2"),
])
def test_advice_lists_the_fastest_change_first_and_its_flags_fit(monkeypatch, capsys, tmp_path, config, world, extra,
                                                            first):
    args = ["--config", str(ROOT / "configs" / f"{config}.yaml"), "--world", str(world), "--gpu", "h100", *extra]
    out = tmp_path / "plan.json"
    code, text, err = plan_text(monkeypatch, capsys, *args, "--json", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    plan = json.loads(out.read_text())
    assert plan["fits"] is False and plan["per_rank_bytes"]["peak"] > GPU_MEMORY["h100"]
    advice = plan["advice"]
    assert advice and advice[0]["flags"] == first
    assert all(a["flags"] in err for a in advice)
    for a in advice:  # applied, each suggestion fits, at the peak it was listed with
        again = tmp_path / "again.json"
        code, _, err = plan_text(monkeypatch, capsys, *args, *shlex.split(a["flags"]), "--json", str(again))
        assert code == 0, (a, err)
        replanned = json.loads(again.read_text())
        assert replanned["per_rank_bytes"]["peak"] == a["peak"]
        # ranked by the step-time model: each at the speed it was listed with, fastest first
        assert replanned["time"]["tokens_per_s_per_gpu"] == pytest.approx(a["tokens_per_s_per_gpu"], rel=1e-12)
    speeds = [a["tokens_per_s_per_gpu"] for a in advice]
    assert speeds == sorted(speeds, reverse=True)


def test_advice_says_so_when_nothing_fits(monkeypatch, capsys):
    """Mixtral on one node: its parameters, gradients and optimizer state alone (16 bytes per
    parameter over 8 ranks) exceed an H100, whatever the checkpointing, tp or pp."""
    code, text, err = plan_text(monkeypatch, capsys, "--config", str(ROOT / "configs" / "mixtral-8x7b.yaml"),
                                "--world", "8", "--gpu", "h100")
    n = sum(s.numel for s in preset("mixtral-8x7b").model_def().specs.values())
    assert 16 * n / 8 > GPU_MEMORY["h100"]
    assert code == 2 and "at world 8; no layout fits" in err and "add ranks" in err
    assert "no layout fits" in "\n".join(text.splitlines()[:10])


def test_default_world_is_valid_for_a_folded_expert_axis():
    """Without a preset's worlds: the least world whose fsdp x cp the ep axis divides,
    on whole nodes (qwen3: tp 2 x ep 8 = 16 ranks, two nodes)."""
    from meshtrain.estimate.dryrun import default_world

    cfg = preset("qwen3-moe-30b-a3b")
    world = default_world(cfg)
    assert world == 16 and world % cfg.parallel.nproc_per_node == 0
    assert math.prod(dry_run(cfg, world).plan.mesh.shape) == world
