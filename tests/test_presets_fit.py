"""The GPU presets fit the hardware their first line names, by the planner's own numbers:
every preset at every world its first line lists plans within an H100's memory; every
config in configs/ plans without --world (a preset at the smallest world it names)."""

from __future__ import annotations

import json
import re

import pytest

from meshtrain import cli
from support.cli import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
GPU_PRESETS = [p for p in CONFIGS if not p.name.startswith("tiny")]
# The contract of a GPU preset's first line: "# <model>: worlds 8, 64 (nodes of 8 H100 80GB) — <layout>".
FIRST_LINE = re.compile(r"^# [^:]+: worlds (\d+(?:, \d+)*) \(nodes of 8 H100 80GB\) — \S.*$")


def worlds(path) -> list[int]:
    first = path.read_text().splitlines()[0]
    match = FIRST_LINE.match(first)
    assert match, f"{path.name}: first line {first!r} is not '# <model>: worlds 8, 64 (...) — <layout>'"
    return [int(w) for w in match.group(1).split(", ")]


def test_the_gpu_presets_are_the_seven_real_models():
    assert [p.stem for p in GPU_PRESETS] == ["deepseek-v3-671b", "llama3-1b", "llama3-405b", "llama3-70b",
                                             "llama3-8b", "mixtral-8x7b", "qwen3-moe-30b-a3b"]


@pytest.mark.parametrize("path, world", [(p, w) for p in GPU_PRESETS for w in worlds(p)],
                         ids=lambda x: x.stem if hasattr(x, "stem") else str(x))
def test_every_gpu_preset_fits_an_h100_at_the_worlds_its_first_line_names(path, world, tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = cli.main(["plan", "--config", str(path), "--world", str(world), "--gpu", "h100", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    plan = json.loads(out.read_text())
    assert plan["world"] == world and plan["fits"] is True
    assert plan["per_rank_bytes"]["peak"] <= 80 * 10**9


@pytest.mark.parametrize("path", GPU_PRESETS, ids=lambda p: p.stem)
def test_preset_headers_speak_of_features_not_issues(path):
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert not any(re.search(r"\bissue\s*#?\d", line, re.IGNORECASE) for line in header), header
    assert not any("comes with" in line for line in header), header  # "X comes with issue N": a promise


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_plans_without_world(path, tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = cli.main(["plan", "--config", str(path), "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    world = json.loads(out.read_text())["world"]
    if path in GPU_PRESETS:
        assert world == min(worlds(path))
