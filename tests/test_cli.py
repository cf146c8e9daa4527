"""`meshtrain fit`: the config contract, the command line, and real (small) training runs.

Subprocess runs (support/cli.py's run_cli) pin OMP_NUM_THREADS=1: on a small, shared CPU
box a few threads spinning against other processes make a tiny model a hundred times slower.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from meshtrain.cli import main
from meshtrain.config import RunConfig
from meshtrain.errors import ConfigError
from meshtrain.run.fit import fit
from support.cli import ROOT, SMALL, TINY, cli_env, read_metrics, run_cli, step_rows
from support.configs import small_cfg

# The contract: exactly these keys in configs/tiny.yaml; at least these in --print_config.
CONTRACT = {
    "run_dir": None, "seed": None,
    "model": ["arch", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len",
              "rope_theta", "norm_eps", "tie_embeddings"],
    "parallel": ["nproc_per_node", "dp", "fsdp", "tp", "sp", "cp", "ep", "pp"],
    "train": ["steps", "global_batch", "micro_batch", "seq_len", "lr", "min_lr", "warmup_steps", "lr_schedule",
              "weight_decay", "grad_clip", "precision", "compile", "activation_checkpointing", "log_every",
              "eval_every"],
    "data": ["paths", "tokenizer"],
    "checkpoint": ["every", "keep_last", "resume", "export"],
}


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """The small config, 3 steps, one process, through the command line."""
    run_dir = tmp_path_factory.mktemp("single")
    proc = run_cli("fit", "--config", str(TINY), *SMALL, "--run_dir", str(run_dir))
    return proc, run_dir


# --- the config contract ---------------------------------------------------------------

def test_tiny_yaml_is_the_contract_and_the_defaults():
    raw = yaml.safe_load(TINY.read_text())
    assert {k: sorted(v) if isinstance(v, dict) else None for k, v in raw.items()} == \
        {k: sorted(v) if v else None for k, v in CONTRACT.items()}
    cfg = RunConfig.from_dict(raw).validate()
    # The dataclass defaults are the tiny run, but for the checkpoints the walk-through
    # (fit, export, generate in docs/interop.md) reads.
    assert cfg.checkpoint.every == 50 and RunConfig().checkpoint.every == 0
    assert dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, every=0)) == RunConfig()
    assert RunConfig.from_dict(yaml.safe_load(cfg.to_yaml())) == cfg


def test_every_field_has_a_docstring():
    import meshtrain.config.schema as schema
    from meshtrain.checkpoint import config as checkpoint_config
    from meshtrain.data import config as data_config
    from meshtrain.layout import config as parallel_config
    from meshtrain.models import config as model_config, moe
    from meshtrain.train import config as train_config

    checked = []
    for module in (schema, model_config, moe, parallel_config, train_config, data_config, checkpoint_config):
        for node in ast.parse(Path(module.__file__).read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
                checked.append(node.name)
                _check_docstrings(node)
    assert sorted(checked) == sorted(["RunConfig", "ModelConfig", "MoeConfig", "ParallelConfig", "TrainConfig",
                                      "DataConfig", "CheckpointConfig", "MuonConfig"])


def _check_docstrings(node):
    body = node.body
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.AnnAssign):
            doc = body[i + 1] if i + 1 < len(body) else None
            assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and \
                isinstance(doc.value.value, str) and doc.value.value.strip(), f"{node.name}.{stmt.target.id} has no docstring"


def test_help_shows_the_field_docstrings(capsys):
    with pytest.raises(SystemExit) as e:
        main(["fit", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--train.micro_batch" in out and "Sequences per data-parallel rank per micro-step" in out


@pytest.mark.parametrize("args, key, words", [
    (["--parallel.tp", "3"], "parallel.tp", "model.n_heads"),
    (["--train.precision", "fp12"], "train.precision", "bf16"),
    (["--model.arch", "gpt3"], "model.arch", "llama"),
    (["--train.lr_schedule", "step"], "train.lr_schedule", "cosine"),
    (["--train.activation_checkpointing", "some"], "train.activation_checkpointing", "selective"),
    (["--train.precision", "fp8", "--train.fp8_recipe", "blockwise"], "train.fp8_recipe", "rowwise"),
    (["--parallel.cp", "0"], "parallel.cp", "at least 1"),
    (["--parallel.cp", "2", "--parallel.cp_comm", "ulysses"], "parallel.cp_comm", "ring"),
    (["--parallel.cp", "2", "--parallel.nproc_per_node", "2", "--train.seq_len", "126"], "train.seq_len", "2 x cp"),
    (["--parallel.cp", "8", "--parallel.nproc_per_node", "8", "--parallel.cp_comm", "a2a"], "parallel.cp_comm=a2a",
     "model.n_kv_heads"),
    (["--parallel.fsdp", "2", "--parallel.nproc_per_node", "2", "--train.compile", "true",
      "--train.activation_checkpointing", "full"], "train.activation_checkpointing=full", "selective"),
    (["--parallel.fsdp_accumulate", "later"], "parallel.fsdp_accumulate", "unsharded"),
    (["--parallel.fsdp_accumulate", "unsharded", "--parallel.pp", "2", "--parallel.nproc_per_node", "2"],
     "parallel.fsdp_accumulate", "set parallel.fsdp_accumulate sharded"),
    (["--parallel.fsdp_accumulate", "unsharded", "--parallel.bucket", "param"], "parallel.fsdp_accumulate",
     "parallel.bucket param"),
    (["--parallel.ep", "2"], "parallel.ep", "model.moe is null"),
    (["--config", str(ROOT / "configs" / "tiny-moe.yaml"), "--parallel.ep", "4"], "parallel.ep", "must divide"),
    (["--config", str(ROOT / "configs" / "tiny-moe.yaml"), "--parallel.fsdp", "4", "--parallel.ep", "4",
      "--model.moe.num_experts", "6"], "model.moe.num_experts", "does not divide"),
    (["--config", str(ROOT / "configs" / "tiny-moe.yaml"), "--train.compile", "true",
      "--train.activation_checkpointing", "full"], "train.activation_checkpointing=full", "selective"),
    (["--config", str(ROOT / "configs" / "tiny-moe.yaml"), "--model.moe.top_k", "9"], "model.moe.top_k",
     "exceeds"),
    (["--config", str(ROOT / "configs" / "tiny-moe.yaml"), "--model.moe.router", "relu"], "model.moe.router",
     "choose one of"),
    (["--config", str(ROOT / "configs" / "tiny-moe.yaml"), "--model.moe.layers", "x:"], "model.moe.layers",
     "slice"),
    (["--config", str(ROOT / "configs" / "tiny-moe.yaml"), "--model.moe.capacity_factor", "0"],
     "model.moe.capacity_factor", "positive"),
    (["--parallel.pp", "2"], "parallel.fsdp=-1", "parallel.nproc_per_node"),  # 2 stages need 2 processes
    (["--model.init_from", ""], "model.init_from", "Hugging Face"),
    (["--checkpoint.resume", "runs/x/step_10"], "checkpoint.resume", "does not exist"),
    (["--checkpoint.resume", "configs"], "checkpoint.resume", "meta.json"),
    (["--data.paths", "data/owt_text_document"], "data/owt_text_document", ".idx"),
    (["--data.paths", "[[0, a], [1, b]]"], "data.paths", "positive"),
    (["--data.tokenizer", "gpt2"], "gpt2", "tokenizer"),
    (["--train.eval_every", "10", "--data.valid_fraction", "0"], "data.valid_fraction", "train.eval_every"),
    (["--data.valid_fraction", "1"], "data.valid_fraction", "below 1"),
    (["--train.stop_at", "-1"], "train.stop_at", "at least 0"),
    (["--model.vocab_size", "128"], "model.vocab_size", "258"),
    (["--train.seq_len", "512"], "train.seq_len", "model.max_seq_len"),
    (["--train.global_batch", "10"], "train.global_batch", "micro_batch"),
    (["--parallel.dp", "8"], "train.global_batch", "data-parallel size"),
    (["--parallel.tp", "2", "--parallel.sp", "true", "--train.seq_len", "127"], "train.seq_len", "parallel.sp"),
    (["--parallel.dp", "-1"], "parallel", "-1"),
    (["--model.n_kv_heads", "3"], "model.n_kv_heads", "divisible"),
    (["--model.arch", "gpt2"], "model.n_kv_heads", "--model.n_kv_heads null"),
    (["--model.arch", "gpt2", "--model.n_kv_heads", "null"], "model.rope_theta", "--model.rope_theta null"),
])
def test_config_errors_name_the_key(capsys, tmp_path, args, key, words):
    code = main(["fit", "--config", str(TINY), "--run_dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert key in err and words in err, err
    assert not (tmp_path / "run").exists()  # nothing is written for a config that cannot run


def test_accumulation_is_checked_against_the_resolved_world():
    cfg = RunConfig.from_dict({"train": {"global_batch": 16, "micro_batch": 4}}).validate()  # fsdp=-1
    assert cfg.accumulation_steps(1) == 4 and cfg.accumulation_steps(2) == 2 and cfg.accumulation_steps(4) == 1
    with pytest.raises(ConfigError, match="train.global_batch=16 .* data-parallel size 8"):
        cfg.accumulation_steps(8)


def test_unknown_keys_are_errors():
    with pytest.raises(ConfigError, match="train.stpes"):
        RunConfig.from_dict({"train": {"stpes": 3}})


# --- the command line in a subprocess ---------------------------------------------------

def test_fit_runs_and_writes_its_files(single_run):
    proc, run_dir = single_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert set(r) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s"}
        assert math.isfinite(r["loss"]) and 0 < r["loss"] < 10 and r["tokens_per_s"] > 0
    assert step_rows(proc.stdout) == [1, 2, 3] and "loss" in proc.stdout
    written = RunConfig.from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert written.train.steps == 3 and written.model.dim == 64 and written.run_dir == str(run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world"] == 1 and plan["params"]


# Max relative loss difference from the fp32 run over SMALL's 3 steps, measured: bf16 2.0e-5,
# fp8 (tensorwise) 1.6e-4; about 5x. The curve itself falls by 1.6% over those steps.
LOW_PRECISION_RTOL = {"bf16": 1e-4, "fp8": 1e-3}
DETERMINISTIC = ("step", "loss", "lr", "grad_norm")


def _api_config(run_dir: Path, *flags: str) -> RunConfig:
    """tiny.yaml with `--section.key value` flags applied by hand (not by the CLI's parser)."""
    raw = yaml.safe_load(TINY.read_text())
    for key, value in zip(flags[::2], flags[1::2]):
        section, name = key.removeprefix("--").split(".")
        raw[section][name] = yaml.safe_load(value)
    return RunConfig.from_dict({**raw, "run_dir": str(run_dir)})


def _curve(records: list[dict]) -> list[dict]:
    return [{k: r[k] for k in DETERMINISTIC} for r in records]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_low_precision_fit_through_the_cli_equals_the_python_api(single_run, tmp_path, one_thread, precision):
    """The flag reaches the step: the CLI run equals fit() of the same config bit for bit,
    and differs from the fp32 run (single_run) by rounding only."""
    flags = [*SMALL, "--train.precision", precision]
    proc = run_cli("fit", "--config", str(TINY), *flags, "--run_dir", str(tmp_path / "cli"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cli = _curve(read_metrics(tmp_path / "cli"))
    assert cli == _curve(fit(_api_config(tmp_path / "api", *flags)))
    cli_losses = torch.tensor([r["loss"] for r in cli])
    fp32 = torch.tensor([r["loss"] for r in read_metrics(single_run[1])])
    assert not torch.equal(cli_losses, fp32)  # not silently fp32
    torch.testing.assert_close(cli_losses, fp32, rtol=LOW_PRECISION_RTOL[precision], atol=0)


@pytest.mark.slow
def test_compiled_fit_through_the_cli_follows_the_eager_run(single_run, tmp_path):
    """--train.compile true compiles (inductor writes its generated code into its cache)
    and trains as the eager fp32 run (single_run) does: measured bit for bit on this CPU;
    the compiled layouts of test_equivalence allow rtol 1e-5, which this uses too."""
    cache = tmp_path / "inductor"
    proc = run_cli("fit", "--config", str(TINY), *SMALL, "--train.compile", "true", "--run_dir",
                   str(tmp_path / "run"), env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled in" in proc.stdout and any(p.suffix in (".py", ".cpp") for p in cache.rglob("*")), proc.stdout
    compiled, eager = read_metrics(tmp_path / "run"), read_metrics(single_run[1])
    assert [r["step"] for r in compiled] == [r["step"] for r in eager] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in compiled]), torch.tensor([r[key] for r in eager]),
                                   rtol=1e-5, atol=0, msg=lambda m, key=key: f"{key}: {m}")


def test_print_config_is_the_contract_yaml():
    proc = run_cli("fit", "--config", str(TINY), "--train.steps", "20", "--print_config")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert set(printed) == set(CONTRACT)
    for section, keys in CONTRACT.items():  # every contract key, plus the ones added since
        assert keys is None or set(keys) <= set(printed[section]), section
    assert printed["train"]["steps"] == 20 and printed["model"]["dim"] == 256


PP2 = ["--parallel.pp", "2", "--parallel.nproc_per_node", "2"]


@pytest.mark.parametrize("args, key", [
    (["--parallel.tp", "3"], "parallel.tp"),
    (["--train.precision", "fp12"], "train.precision"),
    (["--parallel.pp", "8", "--parallel.nproc_per_node", "8"], "parallel.pp=8"),  # 8 stages, 4 layers
    ([*PP2, "--parallel.pp_layout", "[3, 2]"], "parallel.pp_layout"),  # sums to 5, not 4
    ([*PP2, "--parallel.pp_virtual", "2"], "parallel.pp_virtual"),  # needs interleaved
    ([*PP2, "--parallel.pp_schedule", "interleaved", "--parallel.pp_virtual", "2", "--train.global_batch", "12"],
     "parallel.pp_schedule=interleaved"),  # 3 micro-batches on 2 ranks
    ([*PP2, "--parallel.pp_schedule", "zb1"], "parallel.pp_schedule"),
    (["--data.eod_mask_loss", "sometimes"], "data.eod_mask_loss"),
])
def test_bad_values_exit_2_without_a_traceback(args, key):
    proc = run_cli("fit", "--config", str(TINY), *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert key in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


def test_root_cli_py_and_console_script_run_the_same_main():
    proc = subprocess.run([sys.executable, "cli.py", "fit", "--config", str(TINY), "--print_config"],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and yaml.safe_load(proc.stdout)["run_dir"] == "runs/tiny", proc.stderr
    script = Path(sys.executable).parent / "meshtrain"
    if not script.exists():
        pytest.skip("console script not installed (pip install -e .)")
    proc = subprocess.run([str(script), "fit", "--config", str(TINY), "--parallel.pp", "8"], cwd=ROOT,
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "parallel.pp" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_two_ranks_under_torchrun_match_one_process(single_run, tmp_path):
    _, single_dir = single_run
    run_dir = tmp_path / "fsdp2"
    proc = run_cli("fit", "--config", str(TINY), *SMALL, "--parallel.fsdp", "2", "--run_dir", str(run_dir),
                   launcher=["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
                   timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert step_rows(proc.stdout) == [1, 2, 3]  # rank 0 logs, rank 1 does not
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world"] == 2 and plan["mesh"] == {"fsdp": 2}
    single = [r["loss"] for r in read_metrics(single_dir)]
    sharded = [r["loss"] for r in read_metrics(run_dir)]
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(single), rtol=1e-5, atol=0)


# --- training in this process ------------------------------------------------------------

def test_loss_falls_on_the_builtin_corpus(tmp_path, one_thread):
    cfg = small_cfg(tmp_path, steps=30, warmup_steps=3, lr=3e-3, min_lr=3e-4)
    history = fit(cfg)
    losses = [r["loss"] for r in history]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(264)) < 0.3  # starts near uniform over the vocabulary
    assert sum(losses[-3:]) / 3 < losses[0] - 2.0, losses  # and learns the corpus
    assert read_metrics(Path(cfg.run_dir)) == history


def test_gpt2_fits(tmp_path, one_thread):
    cfg = small_cfg(tmp_path, steps=2, warmup_steps=1, log_every=2)
    cfg.model = dataclasses.replace(cfg.model, arch="gpt2", n_kv_heads=None, rope_theta=None)
    history = fit(cfg)
    assert [r["step"] for r in history] == [2] and math.isfinite(history[0]["loss"])


# --- data ---------------------------------------------------------------------------------

# What data/ may import from the rest of meshtrain: the two bottom modules, pure Python
# (its config section's ConfigError, the package's load on first use).
DATA_MAY_IMPORT = {"errors", "lazy", "pools"}


def test_data_imports_nothing_from_the_rest_of_meshtrain():
    """So loaders run anywhere (worker processes, tools) without the model or the runtime."""
    for path in (ROOT / "meshtrain" / "data").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                outside = node.level == 2 and (node.module or "").split(".")[0] not in DATA_MAY_IMPORT
                assert node.level <= 2 and not outside and not (node.module or "").startswith("meshtrain"), path
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("meshtrain") for a in node.names), path
    modules = [f"meshtrain.data.{p.stem}" for p in (ROOT / "meshtrain" / "data").glob("*.py") if p.stem != "__init__"]
    code = (f"import sys; [__import__(m) for m in {modules!r}]; "
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('meshtrain.')}))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert ast.literal_eval(loaded.stdout) == sorted({"data"} | DATA_MAY_IMPORT), loaded.stdout
