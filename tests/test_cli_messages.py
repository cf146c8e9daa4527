"""The command line's first-hour edges: one line that names the key and the fix for typos,
wrong types, broken YAML and missing paths; --version; a bare `meshtrain`; slices for
model.moe.layers; flags spelled with dashes or underscores."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from meshtrain.cli import main
from test_cli import ROOT, TINY, _env

MOE = ROOT / "configs" / "tiny-moe.yaml"


def _error(capsys, *argv: str) -> str:
    """The one line a refused command prints (exit 2, nothing on stdout)."""
    code = main(list(argv))
    out = capsys.readouterr()
    assert code == 2, out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err and out.out == "", out
    return lines[0]


@pytest.mark.parametrize("argv, expected", [
    (["fit", "--config", str(TINY), "--train.step", "5"],
     "unknown key 'train.step' (did you mean train.steps?)"),
    (["fit", "--config", str(TINY), "--train.stop-at", "5"], "unknown key 'train.stop-at' (did you mean train.stop_at?)"),
    (["plan", "--config", str(TINY), "--wrld", "8"], "unknown key 'wrld' (did you mean world?)"),
    (["export", "--checkpoint", "x", "--ot", "y"], "unknown key 'ot' (did you mean out?)"),
    (["fitt", "--config", str(TINY)], "unknown command 'fitt' (did you mean fit?)"),
])
def test_typos_get_the_nearest_key_or_command(capsys, argv, expected):
    assert expected in _error(capsys, *argv)


def test_a_typo_inside_a_yaml_file_gets_the_nearest_key(capsys, tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text("trian:\n  steps: 5\n")
    assert "unknown key 'trian.steps' (did you mean train.steps?)" in _error(capsys, "fit", "--config", str(config))


@pytest.mark.parametrize("flag, value, expected", [
    ("--train.steps", "ten", "train.steps='ten': expected an integer"),
    ("--train.lr", "fast", "train.lr='fast': expected a number"),
    ("--train.compile", "maybe", "train.compile='maybe': expected true or false"),
])
def test_type_errors_say_the_key_the_value_and_the_type_in_words(capsys, flag, value, expected):
    assert _error(capsys, "fit", "--config", str(TINY), flag, value) == f"meshtrain: config error: {expected}"


def test_a_type_error_inside_the_moe_section_names_the_nested_key(capsys):
    assert _error(capsys, "fit", "--config", str(MOE), "--model.moe.top_k", "x") == \
        "meshtrain: config error: model.moe.top_k='x': expected an integer"


def test_broken_yaml_names_the_file_and_the_line(capsys, tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("seed: 0\ntrain:\n  steps: [1\n")
    line = _error(capsys, "fit", "--config", str(config))
    assert line.startswith(f"meshtrain: config error: --config {config}: not valid YAML at line 4") and \
        "unicode string" not in line


def test_a_missing_config_file_is_named(capsys, tmp_path):
    assert _error(capsys, "fit", "--config", str(tmp_path / "nope.yaml")) == \
        f"meshtrain: config error: --config {tmp_path / 'nope.yaml'}: No such file or directory"


def test_a_resume_path_that_does_not_exist_says_so(capsys, tmp_path):
    line = _error(capsys, "fit", "--config", str(TINY), "--checkpoint.resume", str(tmp_path / "gone"),
                  "--run_dir", str(tmp_path / "run"))
    assert f"checkpoint.resume={str(tmp_path / 'gone')!r} does not exist" in line
    assert not (tmp_path / "run").exists()


def test_version_and_a_bare_command(capsys):
    import torch

    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("meshtrain 0.") and f"torch {torch.__version__}" in out
    assert main([]) == 0
    out = capsys.readouterr()
    assert "error" not in out.out + out.err
    for command in ("fit", "plan", "preprocess", "export", "generate"):
        assert f"meshtrain {command} " in out.out


@pytest.mark.parametrize("value, layers", [("1:", "1:"), ("'1:'", "1:"), ('"::2"', "::2"), ("[1, 3]", [1, 3])])
def test_moe_layers_takes_slices_on_the_command_line(capsys, value, layers):
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(MOE), "--model.moe.layers", value, "--print_config"])
    assert e.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    from meshtrain.config import RunConfig

    assert RunConfig.from_dict(printed).model.moe.layers == layers


def test_moe_layers_1_colon_trains_with_a_dense_first_block(tmp_path):
    """The documented value, unquoted, through the real command line."""
    proc = subprocess.run([sys.executable, "-m", "meshtrain.cli", "fit", "--config", str(MOE), "--model.moe.layers",
                           "1:", "--parallel.nproc_per_node", "1", "--parallel.ep", "1", "--parallel.fsdp", "1",
                           "--train.steps", "1", "--train.global_batch", "4", "--train.micro_batch", "4",
                           "--train.seq_len", "32", "--run_dir", str(tmp_path)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    names = {p["name"] for p in plan["params"]}
    assert not any(n.startswith("layers.0.moe") for n in names) and any(n.startswith("layers.1.moe") for n in names)


def test_subcommand_flags_take_underscores_and_dashes(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"body": "hello"}) + "\n")
    for spelling in ("--output_prefix", "--output-prefix"):
        prefix = tmp_path / spelling.strip("-")
        proc = subprocess.run([sys.executable, "-m", "meshtrain.cli", "preprocess", "--input", str(data), spelling,
                               str(prefix), "--text-key" if "-" in spelling[2:] else "--text_key", "body"],
                              cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and prefix.with_suffix(".bin").exists(), proc.stdout + proc.stderr
