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
from support.cli import ROOT, SMALL, TINY, cli_env

MOE = ROOT / "configs" / "tiny-moe.yaml"
PP2 = ROOT / "configs" / "tiny-pp2.yaml"


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
    ("--model.n_kv_heads", "x", "model.n_kv_heads='x': expected an integer or null"),
    ("--model.rope_scaling", "3", "model.rope_scaling='3': expected a mapping or null"),
    ("--parallel.pp_layout", "x", "parallel.pp_layout='x': expected a list of integers or null"),
])
def test_type_errors_say_the_key_the_value_and_the_type_in_words(capsys, flag, value, expected):
    assert _error(capsys, "fit", "--config", str(TINY), flag, value) == f"meshtrain: config error: {expected}"


def test_a_type_error_inside_the_moe_section_names_the_nested_key(capsys):
    assert _error(capsys, "fit", "--config", str(MOE), "--model.moe.top_k", "x") == \
        "meshtrain: config error: model.moe.top_k='x': expected an integer"


@pytest.mark.parametrize("flag, value, expected", [
    ("--checkpoint", "runs/x", "checkpoint is a section, not a value ('runs/x'): to resume from a checkpoint "
                               "directory, use --checkpoint.resume DIR; checkpoint has every, keep_last, resume"),
    ("--model", "gpt2", "model is a section, not a value ('gpt2'): to choose the model family, use --model.arch gpt2"),
    ("--data", "data/owt", "use --data.paths PREFIX; data has paths, tokenizer"),
    ("--train", "20", "to run 20 optimizer steps, use --train.steps 20; train has steps"),
    ("--parallel", "x", "parallel is a section, not a value ('x'): give its keys as --parallel.KEY VALUE; parallel "
                        "has nproc_per_node, dp"),
    ("--model.moe", "8", "model.moe is a section, not a value ('8'): to give each MoE block N experts, use "
                         "--model.moe.num_experts N; model.moe has num_experts, top_k"),
])
def test_a_value_given_to_a_section_names_its_keys_once(capsys, flag, value, expected):
    line = _error(capsys, "fit", "--config", str(TINY), flag, value)
    assert expected in line and line.count("is a section") == 1 and "Unable to load" not in line, line


def test_a_section_given_a_value_in_a_yaml_file_gets_the_yaml_spelling(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("checkpoint: runs/x\n")
    assert "to resume from a checkpoint directory, write checkpoint: {resume: DIR}" in \
        _error(capsys, "fit", "--config", str(config))


@pytest.mark.parametrize("command", ["fit", "plan"])
def test_a_config_file_without_config_gets_the_flag(capsys, command):
    assert _error(capsys, command, str(TINY)) == \
        f"meshtrain: config error: unexpected argument {str(TINY)!r} (did you mean --config {TINY}?)"
    assert "(did you mean --config new.yml?)" in _error(capsys, command, "new.yml")


@pytest.mark.parametrize("argv, expected", [
    (["plan", "--config", str(TINY), "--gpu", "h1000"], "--gpu 'h1000': choose from h100, h200, b200, a100 (did you mean "
                                                        "h100?)"),
    (["export", "--checkpoint", "x", "--out", "y", "--dtype", "bf61"],
     "--dtype 'bf61': choose from bf16, fp16, fp32 (did you mean bf16?)"),
    (["generate", "--checkpoint", "x", "--output-format", "xml"], "--output_format 'xml': choose from text, json"),
    (["fit", "--config", str(TINY), "--train.precision", "fp9"],
     "train.precision='fp9': choose one of fp32, bf16, fp16, fp8 (did you mean fp8?)"),
    (["fit", "--config", str(TINY), "--parallel.pp_schedule", "xyz"],
     "parallel.pp_schedule='xyz': choose one of gpipe, 1f1b, interleaved, zb"),
    (["plan", "--config", str(TINY), "--train.activation_checkpointing", "ful"],
     "train.activation_checkpointing='ful': choose one of none, selective, full, offload (did you mean full?)"),
    (["fit", "--config", str(TINY), "--model.arch", "lama"], "model.arch='lama': choose one of llama, gpt2"),
])
def test_an_option_value_out_of_its_choices_names_the_option_and_its_values(capsys, argv, expected):
    line = _error(capsys, *argv)
    assert expected in line and "command" not in line, line


def test_every_option_with_choices_is_explained_as_an_option(capsys):
    """Each choices= option of each subcommand: a wrong value is that option's, not a command."""
    from meshtrain.cli import build_parser

    commands = build_parser()._subcommands_action._name_parser_map
    required = {"export": ["--checkpoint", "x", "--out", "y"], "generate": ["--checkpoint", "x"],
                "preprocess": ["--input", "x", "--output_prefix", "y"], "plot": ["x", "--out", "y"]}
    seen = 0
    for name, sub in commands.items():
        for action in sub._actions:
            if action.choices and action.option_strings:
                seen += 1
                line = _error(capsys, name, *required.get(name, []), action.option_strings[0], "nope")
                assert f"{action.option_strings[0]} 'nope': choose from {', '.join(action.choices)}" in line, line
    assert seen >= 3


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


def test_an_init_from_of_another_model_names_the_key_the_difference_and_the_fix(capsys, tmp_path):
    import dataclasses

    from meshtrain.config import RunConfig
    from meshtrain.interop.hf import to_hf_config

    cfg = RunConfig.from_dict(yaml.safe_load(TINY.read_text()))
    hf = tmp_path / "hf"
    hf.mkdir()
    other = dataclasses.replace(cfg.family_config(), ffn_dim=cfg.model.ffn_dim * 2)
    (hf / "config.json").write_text(json.dumps(to_hf_config(cfg.model.arch, other)))
    line = _error(capsys, "fit", "--config", str(TINY), "--model.init_from", str(hf),
                  "--run_dir", str(tmp_path / "run"))
    ffn, theirs = cfg.model.ffn_dim, cfg.model.ffn_dim * 2
    assert line == (f"meshtrain: config error: model.ffn_dim={ffn} given, but {hf / 'config.json'} says {theirs}: drop "
                    "the key to take the checkpoint's value, or point model.init_from at a matching checkpoint")
    assert not (tmp_path / "run").exists()


def test_keep_gathered_without_sharded_weights_is_refused_naming_the_fix(capsys, tmp_path):
    """pp_keep_gathered with parallel.fsdp and cp fixed at 1 can never act: an error."""
    line = _error(capsys, "fit", "--config", str(PP2), "--parallel.pp_keep_gathered", "true", "--run_dir",
                  str(tmp_path / "run"))
    assert "parallel.pp_keep_gathered=true" in line and "parallel.fsdp=1 and parallel.cp=1 shard none" in line
    assert "set parallel.fsdp > 1 (or -1, the remaining ranks), or parallel.pp_keep_gathered false" in line
    assert not (tmp_path / "run").exists()


def test_settings_that_do_nothing_at_the_world_are_noted_by_plan(capsys):
    """A schedule without a pipeline, and pp_keep_gathered where fsdp=-1 takes one rank:
    noted (a preset run at another size), not refused."""
    assert main(["plan", "--config", str(TINY), "--parallel.pp_schedule", "zb"]) == 0
    assert "warning: parallel.pp_schedule=zb does nothing with parallel.pp=1 (no pipeline to schedule); set " \
           "parallel.pp > 1 to run it" in " ".join(capsys.readouterr().out.split())
    assert main(["plan", "--config", str(PP2), "--parallel.fsdp", "-1", "--parallel.pp_keep_gathered", "true"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as one line, however wide the console is
    assert "warning: parallel.pp_keep_gathered=true does nothing at world size 2: parallel.fsdp=-1 takes 1 rank " \
           "(parallel.cp=1), so no stage weights are sharded" in out
    assert main(["plan", "--config", str(PP2), "--parallel.fsdp", "-1", "--parallel.pp_keep_gathered", "true",
                 "--world", "4"]) == 0
    assert "pp_keep_gathered=true does nothing" not in capsys.readouterr().out  # fsdp 2 there


def test_a_schedule_without_a_pipeline_is_noted_at_the_start_of_fit(capsys, tmp_path):
    assert main(["fit", "--config", str(TINY), *SMALL, "--train.steps", "1", "--parallel.pp_schedule", "gpipe",
                 "--run_dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    note = "note: parallel.pp_schedule=gpipe does nothing with parallel.pp=1"
    assert note in out and out.index(note) < out.index(" 1/1 "), out


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
                           "--train.seq_len", "32", "--run_dir", str(tmp_path)], cwd=ROOT, env=cli_env(),
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
                              cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and prefix.with_suffix(".bin").exists(), proc.stdout + proc.stderr
