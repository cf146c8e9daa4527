"""Hugging Face interop through the command line: `checkpoint.export`, `meshtrain export`,
and `model.init_from` (one process and tp 2 on two ranks, each reading only its slices).
The conversions themselves are checked against transformers in tests/test_hf.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from meshtrain.config import RunConfig
from meshtrain.data import build_data
from meshtrain.interop.hf import load_hf_params
from meshtrain.models.context import LocalContext
from support.cli import SMALL, TINY, read_metrics, run_cli

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
LOGIT_ATOL = 3e-6


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """3 steps with checkpoint.every and checkpoint.export: the run and its export."""
    run_dir = tmp_path_factory.mktemp("exported")
    proc = run_cli("fit", "--config", str(TINY), *SMALL, "--checkpoint.every", "3", "--checkpoint.export", "true",
                   "--run_dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


def test_fit_exports_and_meshtrain_export_writes_the_same_weights(exported, tmp_path):
    export = exported / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 64
    assert (export / "generation_config.json").is_file()
    out = tmp_path / "hf"
    proc = run_cli("export", "--checkpoint", str(exported), "--out", str(out), "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    assert "exported step 3" in proc.stdout
    assert (out / "model.safetensors").read_bytes() == (export / "model.safetensors").read_bytes()


def test_transformers_loads_the_export_with_our_logits(exported):
    transformers = pytest.importorskip("transformers")
    cfg = RunConfig.from_dict(__import__("yaml").safe_load((exported / "config.yaml").read_text()))
    model = cfg.model_def()
    params = load_hf_params(exported / "export", cfg.model.arch, cfg.family_config())
    hf = transformers.LlamaForCausalLM.from_pretrained(exported / "export", torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.forward(params, tokens, LocalContext())
        theirs = hf(tokens).logits
    # Measured 9e-8 (|logits| <= 0.7); the tolerance of tests/test_hf.py (3e-6), which the
    # same logits with rope_theta doubled exceed by far (checked here, on this model).
    torch.testing.assert_close(theirs, ours, atol=LOGIT_ATOL, rtol=0)
    raw = __import__("yaml").safe_load((exported / "config.yaml").read_text())
    raw["model"]["rope_theta"] *= 2
    with torch.no_grad():
        doubled = RunConfig.from_dict(raw).model_def().forward(params, tokens, LocalContext())
    assert (doubled - ours).abs().max() > 10 * LOGIT_ATOL


def _first_loss(cfg: RunConfig, params: dict) -> float:
    """The loss of step 1's global batch under `params`, computed here from the data."""
    data = build_data(cfg.data.paths, cfg.data.tokenizer, cfg.train.seq_len, cfg.seed, cfg.model.vocab_size,
                      cfg.data.valid_fraction)
    window = data.train.batch(0, cfg.train.global_batch)
    with torch.no_grad():
        logits = cfg.model_def().forward(params, window[:, :-1], LocalContext())
    return F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten()).item()


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_init_from_starts_from_the_exported_weights(exported, tmp_path, nproc):
    run_dir = tmp_path / "from_hf"
    layout = ["--parallel.nproc_per_node", str(nproc), "--parallel.fsdp", "1", "--parallel.tp", str(nproc)]
    proc = run_cli("fit", "--config", str(TINY), *SMALL, "--train.steps", "1", "--model.init_from",
                   str(exported / "export"), *layout, "--run_dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cfg = RunConfig.from_dict(__import__("yaml").safe_load((exported / "config.yaml").read_text()))
    params = load_hf_params(exported / "export", cfg.model.arch, cfg.family_config())
    expected = _first_loss(cfg, params)
    assert read_metrics(run_dir)[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert abs(expected - read_metrics(exported)[0]["loss"]) > 1e-3  # not what random init gives


@pytest.mark.parametrize("args, words", [
    (["export", "--checkpoint", "{tmp}/nothing", "--out", "{tmp}/out"], ["{tmp}/nothing"]),
    (["fit", "--config", str(TINY), *SMALL, "--model.init_from", "{export}", "--model.ffn_dim", "96",
      "--run_dir", "{tmp}/run"], ["model.ffn_dim", "128"]),
    (["fit", "--config", str(TINY), *SMALL, "--model.init_from", "{tmp}", "--run_dir", "{tmp}/run"],
     ["model.init_from", "config.json"]),
])
def test_bad_interop_input_exits_2_with_one_line(exported, tmp_path, args, words):
    fill = {"tmp": str(tmp_path), "export": str(exported / "export")}
    proc = run_cli(*[a.format(**fill) for a in args])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(w.format(**fill) in proc.stderr for w in words), proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


def test_generate_greedy_is_the_same_from_the_checkpoint_the_export_and_transformers(exported):
    outputs = []
    for source in (exported, exported / "checkpoints" / "step_00000003", exported / "export"):
        proc = run_cli("generate", "--checkpoint", str(source), "--prompt_ids", "256,70,111,117,114",
                       "--max_new_tokens", "12", "--temperature", "0", "--output_format", "json")
        assert proc.returncode == 0, proc.stderr
        outputs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    # The export's generated tokenizer.json decodes the text as the bytes tokenizer does.
    assert outputs[0] == outputs[1] == outputs[2] and isinstance(outputs[0]["text"], str)
    assert outputs[0]["prompt_ids"] == [256, 70, 111, 117, 114] and len(outputs[0]["generated_ids"]) <= 12
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(exported / "export", torch_dtype=torch.float32).eval()
    prompt = torch.tensor([outputs[0]["prompt_ids"]])
    ids = hf.generate(prompt, do_sample=False, max_new_tokens=len(outputs[0]["generated_ids"]),
                      eos_token_id=257, pad_token_id=257)[0, prompt.shape[1]:].tolist()
    assert ids == outputs[0]["generated_ids"]
