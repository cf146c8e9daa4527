"""`model.init_from` alone is enough (config/init_from.py): for a Hugging Face directory of
each importable architecture (llama, qwen3, gpt2, mixtral, qwen3_moe), a run whose YAML
gives only model.init_from trains, and its first loss is transformers' on the same batch
and the loss of the same run with every model key written out. A given key that
config.json contradicts exits 2 naming the key and both values; training-only keys and
keys the checkpoint check lets differ are kept; plan fills the same way; a resume fills
the same config again.

Runs are in-process (cli.main) and tiny: 2 blocks of width 32, 2 x 16 tokens, 1 step."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
import yaml

from meshtrain.cli import main
from meshtrain.config import RunConfig
from meshtrain.config.init_from import TRAINING_ONLY, fill_from_init, given_keys
from meshtrain.data import build_data
from meshtrain.errors import ConfigError
from meshtrain.interop.hf import read_hf_config
from support.cli import read_metrics

transformers = pytest.importorskip("transformers")

KINDS = ["llama", "qwen3", "gpt2", "mixtral", "qwen3_moe"]
# Everything but the model: the embedded corpus, one step of 2 x 16 tokens, no checkpoint.
BASE = {"data": {"paths": "builtin", "tokenizer": "bytes"},
        "train": {"steps": 1, "global_batch": 2, "micro_batch": 2, "seq_len": 16, "warmup_steps": 0},
        "checkpoint": {"every": 0}}


def _hf_config(kind: str):
    """A tiny transformers config of `kind`; the vocabulary covers the bytes tokenizer."""
    attn = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=264,
                max_position_embeddings=64)
    if kind == "llama":
        return transformers.LlamaConfig(**attn, intermediate_size=48, rms_norm_eps=1e-6)
    if kind == "qwen3":  # q/k norms and a head dim of its own (16, not 32 / 4)
        return transformers.Qwen3Config(**attn, intermediate_size=48, head_dim=16)
    if kind == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=264, n_positions=64)
    if kind == "mixtral":  # router_aux_loss_coef is transformers' loss: not read into model.moe.aux_coef
        return transformers.MixtralConfig(**attn, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                          router_aux_loss_coef=0.5)
    # qwen3_moe: block 0 dense, renormalised top-2 gates
    return transformers.Qwen3MoeConfig(**attn, intermediate_size=48, moe_intermediate_size=24, head_dim=16,
                                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """kind -> (its save_pretrained directory, the transformers model)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, kind in enumerate(KINDS):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind)).eval()
        with torch.no_grad():  # norms off their ones, routers decisive: a wrong key shows in the loss
            for name, p in model.named_parameters():
                p.add_(0.05 * torch.randn_like(p))
                if name.endswith("gate.weight") and "proj" not in name:
                    p.mul_(20)
        model.save_pretrained(root / kind)
        out[kind] = (root / kind, model)
    return out


def _yaml(tmp_path, name: str, model: dict, **sections) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / name), **BASE, **sections, "model": model}))
    return str(path)


def _fit(tmp_path, name: str, model: dict, *flags: str) -> dict:
    """Fit the one-step run `name`: its first metrics row and its saved config."""
    code = main(["fit", "--config", _yaml(tmp_path, name, model), *flags])
    assert code == 0
    return {"loss": read_metrics(tmp_path / name)[0]["loss"],
            "config": yaml.safe_load((tmp_path / name / "config.yaml").read_text())}


def _refused(capsys, *argv: str) -> str:
    code = main(list(argv))
    out = capsys.readouterr()
    assert code == 2, out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err, out.err
    return lines[0]


def _architecture(hf_dir) -> dict:
    """Every model key of the checkpoint written out, as a user restating it would: the
    importer's fields without the training-only ones."""
    fields = read_hf_config(hf_dir)
    if fields.get("moe"):
        fields["moe"] = {k: v for k, v in fields["moe"].items() if f"model.moe.{k}" not in TRAINING_ONLY}
    return {**fields, "init_from": str(hf_dir)}


def _transformers_loss(model, cfg: dict) -> float:
    """transformers' loss on the first global batch of the run `cfg`."""
    d, t = cfg["data"], cfg["train"]
    data = build_data(d["paths"], d["tokenizer"], t["seq_len"], cfg["seed"], cfg["model"]["vocab_size"],
                      d["valid_fraction"])
    window = data.train.batch(0, t["global_batch"])
    with torch.no_grad():
        logits = model(window[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten()).item()


@pytest.mark.parametrize("kind", KINDS)
def test_init_from_alone_trains_as_the_model_written_out(hf_dirs, tmp_path, kind):
    hf_dir, hf_model = hf_dirs[kind]
    alone = _fit(tmp_path, "alone", {"init_from": str(hf_dir)})
    written = _fit(tmp_path, "written", _architecture(hf_dir))
    assert alone["loss"] == written["loss"]
    assert alone["config"]["model"] == written["config"]["model"]
    assert alone["config"]["model"]["arch"] == ("gpt2" if kind == "gpt2" else "llama")
    assert alone["loss"] == pytest.approx(_transformers_loss(hf_model, alone["config"]), rel=1e-5)
    if kind == "mixtral":  # training-only: meshtrain's default, not config.json's router_aux_loss_coef
        assert alone["config"]["model"]["moe"]["aux_coef"] == 0.01


@pytest.mark.parametrize("kind, yaml_keys, flags, expected", [
    ("llama", {}, ["--model.n_heads", "8"], "model.n_heads=8 given, but {dir}/config.json says 4"),
    ("llama", {"dim": 64}, [], "model.dim=64 given, but {dir}/config.json says 32"),
    ("gpt2", {"arch": "llama"}, [], "model.arch=llama given, but {dir}/config.json says gpt2"),
    ("qwen3", {}, ["--model.qk_norm", "false"], "model.qk_norm=false given, but {dir}/config.json says true"),
    ("mixtral", {}, ["--model.moe.top_k", "3"], "model.moe.top_k=3 given, but {dir}/config.json says 2"),
    ("mixtral", {"moe": {"num_experts": 8}}, [], "model.moe.num_experts=8 given, but {dir}/config.json says 4"),
    ("llama", {}, ["--model.moe.top_k", "2"], "model.moe.top_k=2 given, but {dir}/config.json says model.moe null"),
    ("qwen3_moe", {"moe": None}, [], 'model.moe=null given, but {dir}/config.json says {{"num_experts": 4, '
                                     '"top_k": 2, "expert_ffn_dim": 24,'),
])
def test_a_given_key_that_config_json_contradicts_exits_2(hf_dirs, tmp_path, capsys, kind, yaml_keys, flags,
                                                          expected):
    hf_dir = hf_dirs[kind][0]
    line = _refused(capsys, "fit", "--config", _yaml(tmp_path, "run", {"init_from": str(hf_dir), **yaml_keys}),
                    *flags)
    assert line.startswith("meshtrain: config error: " + expected.format(dir=hf_dir)), line
    assert line.endswith(": drop the key to take the checkpoint's value, or point model.init_from at a matching "
                         "checkpoint")
    assert not (tmp_path / "run").exists()


def test_a_later_config_file_or_flag_gives_a_key_too(hf_dirs, tmp_path, capsys):
    hf_dir = hf_dirs["mixtral"][0]
    first = _yaml(tmp_path, "run", {"init_from": str(hf_dir)})
    second = tmp_path / "second.yaml"
    second.write_text("model: {moe: {top_k: 3}}\n")
    line = _refused(capsys, "plan", "--config", first, "--config", str(second))
    assert "model.moe.top_k=3 given" in line
    # The flag, last, gives the checkpoint's value: nothing disagrees.
    assert main(["plan", "--config", first, "--config", str(second), "--model.moe.top_k", "2"]) == 0


def test_training_only_and_free_keys_given_are_kept(hf_dirs, tmp_path):
    """Training-only keys are never compared; keys the checkpoint check lets differ (llama's
    max_seq_len, model.moe.balance: aux-free's bias starts at 0) keep the value given."""
    hf_dir = hf_dirs["mixtral"][0]
    run = _fit(tmp_path, "run", {"init_from": str(hf_dir), "max_seq_len": 32},
               "--model.moe.aux_coef", "0.25", "--model.moe.z_loss_coef", "0.001", "--model.moe.capacity_factor",
               "2.0", "--model.moe.bias_update_rate", "0.01", "--model.moe.balance", "aux_free")
    model = run["config"]["model"]
    assert model["max_seq_len"] == 32 and model["dim"] == 32 and model["n_layers"] == 2
    assert {k: model["moe"][k] for k in ("aux_coef", "z_loss_coef", "capacity_factor", "bias_update_rate",
                                         "balance", "num_experts", "top_k", "expert_ffn_dim")} == \
        {"aux_coef": 0.25, "z_loss_coef": 0.001, "capacity_factor": 2.0, "bias_update_rate": 0.01,
         "balance": "aux_free", "num_experts": 4, "top_k": 2, "expert_ffn_dim": 24}


def test_plan_fills_from_init_from_alone(hf_dirs, tmp_path, capsys):
    hf_dir = hf_dirs["qwen3_moe"][0]
    assert main(["plan", "--config", _yaml(tmp_path, "run", {"init_from": str(hf_dir)})]) == 0
    out = capsys.readouterr().out
    assert "llama, 2 layers, dim 32, 4 experts top 2" in out
    assert not (tmp_path / "run").exists()


def test_a_resume_fills_the_same_config_again(hf_dirs, tmp_path, capsys):
    hf_dir = hf_dirs["llama"][0]
    config = _yaml(tmp_path, "run", {"init_from": str(hf_dir)}, checkpoint={"every": 1})
    assert main(["fit", "--config", config]) == 0
    assert main(["fit", "--config", config, "--train.steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "config changed since step_00000001: train.steps 1 -> 2\n" in out  # no model.*
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_the_python_api_fills_the_same_way(hf_dirs, tmp_path):
    hf_dir = hf_dirs["qwen3"][0]
    values = {**BASE, "run_dir": str(tmp_path / "run"), "model": {"init_from": str(hf_dir), "max_seq_len": 32,
                                                                  "moe": None}}
    assert given_keys(values["model"], "model.") == {"model.init_from", "model.max_seq_len", "model.moe"}
    cfg = fill_from_init(RunConfig.from_dict(values), given_keys(values)).validate()
    assert (cfg.model.dim, cfg.model.head_dim, cfg.model.qk_norm, cfg.model.max_seq_len, cfg.model.moe) == \
        (32, 16, True, 32, None)
    # Nothing given: every architecture key from config.json, the rest untouched.
    everything = fill_from_init(RunConfig.from_dict(values))
    assert everything.model.max_seq_len == 64 and everything.model.init_from == str(hf_dir)
    assert dataclasses.replace(everything, model=cfg.model) == dataclasses.replace(cfg, model=cfg.model)
    assert fill_from_init(RunConfig()) == RunConfig()  # no init_from: nothing to read
    # Training-only keys are the run's, given or not; the architecture is config.json's.
    mixtral = RunConfig.from_dict({"model": {"init_from": str(hf_dirs["mixtral"][0]),
                                             "moe": {"top_k": 1, "aux_coef": 0.3}}})
    assert (fill_from_init(mixtral).model.moe.top_k, fill_from_init(mixtral).model.moe.aux_coef) == (2, 0.3)
    with pytest.raises(ConfigError, match="model.n_heads=8 given"):
        fill_from_init(RunConfig.from_dict({"model": {"init_from": str(hf_dir), "n_heads": 8}}),
                       {"model.init_from", "model.n_heads"})
    with pytest.raises(ConfigError, match="model.moe.top_k=2 given, but .* says model.moe null"):  # gives model.moe
        fill_from_init(RunConfig.from_dict({"model": {"init_from": str(hf_dir), "moe": {"top_k": 2}}}),
                       {"model.moe.top_k"})


def test_training_only_keys_are_one_named_list():
    assert {"model.init_from", "model.moe.bias_update_rate", "model.moe.aux_coef", "model.moe.z_loss_coef",
            "model.moe.capacity_factor"} <= TRAINING_ONLY
    assert "model.moe.balance" not in TRAINING_ONLY  # what the network computes: architecture
    assert json.dumps(sorted(TRAINING_ONLY))  # plain strings
