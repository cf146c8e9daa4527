"""`meshtrain plan --gpu`'s advice is never worse than the layout given: the search plans
that layout among its candidates, names no layout whose peak is above it, and, when
nothing fits, says what would (more ranks, more cp), each suggestion planned again here
and fitting at the peak it was named with."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from meshtrain import cli
from meshtrain.config import RunConfig
from meshtrain.config.worlds import preset_worlds
from meshtrain.errors import ConfigError
from meshtrain.estimate.dryrun import GPU_MEMORY, dry_run
from meshtrain.layout.plan_table import human_bytes

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
GPU_PRESETS = sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("tiny"))
# One sequence of 256K tokens on the 1B model: its activations, not its state, are what
# is over, so more cp at the same world fits where more ranks alone would not.
LONG = ["--train.seq_len", "262144", "--model.max_seq_len", "262144"]


def plan(tmp_path, capsys, config: str, world: int, gpu: str, *flags: str) -> tuple[int, str, str, dict]:
    """`meshtrain plan` in-process: exit code, stdout (lines the console wrapped joined
    again), stderr and its --json."""
    out = tmp_path / "plan.json"
    code = cli.main(["plan", "--config", str(CONFIGS / f"{config}.yaml"), "--world", str(world), "--gpu", gpu,
                     *flags, "--json", str(out)])
    text, err = capsys.readouterr()
    return code, " ".join(text.split()), err, json.loads(out.read_text())


def with_flags(path: Path, flags: str) -> RunConfig:
    """The preset at `path` with command-line flags (`--section.key value`) applied."""
    values = yaml.safe_load(path.read_text())
    words = shlex.split(flags)
    for key, value in zip(words[::2], words[1::2]):
        section, name = key.removeprefix("--").split(".")
        values[section][name] = yaml.safe_load(value)
    return RunConfig.from_dict(values).validate()


def fits_as_named(tmp_path, capsys, config: str, gpu: str, extra: list[str], would: dict) -> None:
    """A what-would-fit suggestion, applied, fits at the peak it was named with."""
    code, _, err, again = plan(tmp_path, capsys, config, would["world"], gpu, *extra, *shlex.split(would["flags"]))
    assert code == 0, (would, err)
    assert again["fits"] and again["per_rank_bytes"]["peak"] == would["peak"]


def test_llama3_70b_on_one_node_names_its_own_layout_lowest_and_the_world_that_fits(tmp_path, capsys):
    code, text, err, got = plan(tmp_path, capsys, "llama3-70b", 8, "h100")
    peak = got["per_rank_bytes"]["peak"]
    assert code == 2 and got["fits"] is False and got["advice"] == []
    assert human_bytes(peak) == "155.69 GiB" and "peak memory 155.69 GiB per rank" in text
    # No change in the search lowers the peak (full checkpointing is refused compiled, pp
    # does not fit beside tp 8 on 8 ranks): the layout given is the lowest, not the 182.79
    # GiB of --train.activation_checkpointing none that it used to name.
    assert got["lowest"] == {"flags": "", "peak": peak}
    assert "the layout given has the lowest peak found (155.69 GiB)" in text
    assert "182.79" not in text + err
    # What would fit: 32 ranks as given (16 are still over), planned.
    (would,) = got["would_fit"]
    assert would["world"] == 32 and would["flags"] == "" and would["peak"] <= GPU_MEMORY["h100"]
    line = f"add ranks: --world 32 fits as given ({human_bytes(would['peak'])})"
    assert line in text and line in err and len(err.strip().splitlines()) == 1
    assert human_bytes(would["peak"]) == "53.01 GiB"
    fits_as_named(tmp_path, capsys, "llama3-70b", "h100", [], would)
    assert plan(tmp_path, capsys, "llama3-70b", 16, "h100")[3]["fits"] is False


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_no_advice_is_above_the_peak_of_the_layout_given(tmp_path, capsys, gpu):
    """Every GPU preset at 8, 64, 512 ranks and its own worlds (those its batch and axes
    allow): where the layout does not fit, the lowest peak named is at most its own, every
    layout advised and every what-would-fit suggestion fits, and the suggestions, applied
    through the CLI, plan at the peak they were named with."""
    capacity, over = GPU_MEMORY[gpu], []
    for path in GPU_PRESETS:
        cfg = RunConfig.from_dict(yaml.safe_load(path.read_text())).validate()
        for world in sorted({8, 64, 512, *preset_worlds(path)}):
            try:
                run = dry_run(cfg, world, gpu)
            except ConfigError:  # a world this preset's axes or batch cannot take
                continue
            if run.fits:
                continue
            over.append((path.stem, world))
            peak = run.memory["peak"]
            assert run.lowest.peak <= peak, (path.stem, world, run.lowest)
            assert f"{human_bytes(run.lowest.peak)}" in run.error
            assert all(f.peak <= capacity < peak for f in run.advice + run.would_fit), (path.stem, world)
            if not run.advice:
                assert run.would_fit, (path.stem, world, run.error)
                for would in run.would_fit:  # planned again, it fits at the peak it was named with
                    again = dry_run(with_flags(path, would.flags), would.world, gpu)
                    assert again.fits and again.memory["peak"] == would.peak, (path.stem, world, would)
    # The cases that test it: 70B and 405B on one node, 405B on 8 nodes... (DeepSeek-V3's ep
    # 32 folds from fsdp only at 1024 ranks and more, where it fits.)
    assert {("llama3-70b", 8), ("llama3-405b", 8), ("llama3-405b", 64)} <= set(over)


def test_nothing_fits_says_how_much_cp_would(tmp_path, capsys):
    code, text, err, got = plan(tmp_path, capsys, "llama3-1b", 8, "h100", *LONG)
    assert code == 2 and got["advice"] == [] and got["lowest"]["peak"] <= got["per_rank_bytes"]["peak"]
    cp = [w for w in got["would_fit"] if w["world"] == 8]
    assert len(cp) == 1 and cp[0]["flags"].startswith("--parallel.cp 2 ")
    assert f"split the sequence: {cp[0]['flags']} fits at world 8 ({human_bytes(cp[0]['peak'])})" in text
    for would in got["would_fit"]:
        fits_as_named(tmp_path, capsys, "llama3-1b", "h100", LONG, would)


def test_nothing_fits_says_when_neither_ranks_nor_cp_would(tmp_path, capsys):
    """An 8M-token sequence on three layers: even split 8 ways by cp and checkpointed, one
    layer's activations exceed an H100 at any world."""
    code, text, err, got = plan(tmp_path, capsys, "llama3-1b", 8, "h100", "--train.seq_len", "8388608",
                                "--model.max_seq_len", "8388608", "--model.n_layers", "3", "--parallel.tp", "8",
                                "--parallel.sp", "true")
    assert code == 2 and got["advice"] == [] and got["would_fit"] == []
    assert got["lowest"]["peak"] <= got["per_rank_bytes"]["peak"]
    words = "neither more ranks (the world doubled up to 8192) nor parallel.cp (doubled up to 8x) fits"
    assert words in text and words in err
