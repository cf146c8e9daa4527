"""Hugging Face interop: export to and import from transformers' LlamaForCausalLM and
GPT2LMHeadModel (logits compared in fp32), sharded and bf16 files, export streamed from
DCP checkpoints (one process and 4 ranks) with its peak memory, sharded import where each
rank reads only its own slices, and the errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from meshtrain.config import DataConfig, ModelConfig, RunConfig
from meshtrain.errors import ConfigError
from meshtrain.interop import export as hf_export
from meshtrain.interop.hf_config import _model_fields
from meshtrain.interop.hf import (from_hf_config, load_hf_params, read_hf_config, save_hf,
                                  to_hf_config)
from meshtrain.models import LocalContext, build
from meshtrain.models.gpt2 import GPT2Config
from meshtrain.models.llama import LlamaConfig
from meshtrain.models.spec import init_slice
from meshtrain.run.export import export_checkpoint
from meshtrain import checkpoint as ckpt
from meshtrain.checkpoint import CheckpointError
from meshtrain.train.step import TrainState

SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
LLAMA = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96, max_seq_len=32)
GPT2 = GPT2Config(dim=64, n_layers=2, n_heads=4, ffn_dim=96, vocab_size=96, max_seq_len=32)
# Max |logit difference| against transformers, fp32 (this CPU, transformers 5.x), measured
# per test below: 1.2e-7 to 7.2e-7 (|logits| up to ~2). 3e-6 is 4x the largest; a wrong
# rope_theta exported (doubled: 3.6e-5 at theta 500000, 5e-4 at 10000) is 12x or more.
ATOL = 3e-6


def _params(arch: str, cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random parameters; norms and biases moved off their ones/zeros init so that a
    swapped or dropped one shows in the logits."""
    g = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name, spec in build(arch, cfg).specs.items():
        t = init_slice(spec, name, seed)
        out[name] = t if spec.init == "normal" else t + 0.2 * torch.randn(spec.shape, generator=g)
    return out


def _ours(arch: str, cfg, params, tokens) -> torch.Tensor:
    with torch.no_grad():
        return build(arch, cfg).forward(params, tokens, LocalContext())


def _tokens(vocab: int, seq: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(seed))


def _transformers():
    return pytest.importorskip("transformers")


def _fp32_kwargs(transformers) -> dict:
    major = int(transformers.__version__.split(".")[0])
    return {"dtype": torch.float32} if major >= 5 else {"torch_dtype": torch.float32}


def _hf_logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def _family(fields: dict):
    return RunConfig(model=ModelConfig(**fields)).family_config()


def _files_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out


# --------------------------------------------------------------------------- llama


@pytest.mark.parametrize("case", ["gqa_untied", "tied_mha_rope_scaling"])
def test_llama_export_loads_in_transformers(tmp_path, case):
    transformers = _transformers()
    if case == "gqa_untied":
        cfg = LLAMA
    else:
        cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=96, max_seq_len=32,
                          rope_theta=500000.0, rope_scaling=SCALING, tie_embeddings=True, norm_eps=1e-6)
    params = _params("llama", cfg)
    save_hf(params, "llama", cfg, tmp_path / "out", dtype="fp32")
    names = set(_files_tensors(tmp_path / "out"))
    assert ("lm_head.weight" in names) == (not cfg.tie_embeddings)
    assert len(names) == len(params)

    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", **_fp32_kwargs(transformers)).eval()
    assert model.config.num_key_value_heads == cfg.n_kv_heads
    tokens = _tokens(cfg.vocab_size)
    ours = _ours("llama", cfg, params, tokens)
    diff = (_hf_logits(model, tokens) - ours).abs().max().item()
    assert diff < ATOL, f"{case}: max |logit difference| {diff} (up to {ATOL} allowed)"

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert from_hf_config(config) == _model_fields("llama", cfg)
    if cfg.rope_scaling:
        assert config["rope_scaling"] == {"rope_type": "llama3", **SCALING}
        # The scaling matters at these lengths: without it the logits differ by >> ATOL.
        plain = LlamaConfig(**{**vars(cfg), "rope_scaling": None})
        assert (_ours("llama", plain, params, tokens) - ours).abs().max() > 10 * ATOL
    # The tolerance resolves rope_theta: doubled, the logits move by far more than ATOL.
    doubled = LlamaConfig(**{**vars(cfg), "rope_theta": 2 * cfg.rope_theta})
    assert (_ours("llama", doubled, params, tokens) - ours).abs().max() > 5 * ATOL


@pytest.mark.parametrize("tied", [False, True])
def test_llama_import_from_transformers(tmp_path, tied):
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=80, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **SCALING})
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path, safe_serialization=True)

    fields = read_hf_config(tmp_path)
    assert fields == {"arch": "llama", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96,
                      "vocab_size": 80, "max_seq_len": 64, "rope_theta": 500000.0, "norm_eps": 1e-6,
                      "tie_embeddings": tied, "rope_scaling": SCALING}
    cfg = _family(fields)
    params = load_hf_params(tmp_path, "llama", cfg)
    assert all(t.dtype == torch.float32 and not t.requires_grad for t in params.values())
    tokens = _tokens(80)
    diff = (_ours("llama", cfg, params, tokens) - _hf_logits(model, tokens)).abs().max().item()
    assert diff < ATOL, f"tied={tied}: max |logit difference| {diff} (up to {ATOL} allowed)"


# --------------------------------------------------------------------------- gpt2


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_export_loads_in_transformers(tmp_path, tied):
    transformers = _transformers()
    cfg = GPT2Config(**{**vars(GPT2), "tie_embeddings": tied})
    params = _params("gpt2", cfg)
    save_hf(params, "gpt2", cfg, tmp_path, dtype="fp32")
    files = _files_tensors(tmp_path)
    assert files["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D: (in, out), q|k|v fused
    assert torch.equal(files["transformer.h.1.attn.c_attn.weight"][:, 64:128], params["layers.1.attn.wk"].T)
    assert ("lm_head.weight" in files) == (not tied)

    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, **_fp32_kwargs(transformers)).eval()
    assert model.config.activation_function == "gelu_new" and model.config.n_inner == 96
    assert model.config.attn_pdrop == model.config.resid_pdrop == model.config.embd_pdrop == 0.0
    tokens = _tokens(96)
    diff = (_hf_logits(model, tokens) - _ours("gpt2", cfg, params, tokens)).abs().max().item()
    assert diff < ATOL, f"tied={tied}: max |logit difference| {diff} (up to {ATOL} allowed)"


@pytest.mark.parametrize("arch, cfg", [("llama", LLAMA), ("gpt2", GPT2)])
def test_import_of_one_pipeline_stages_parameters(tmp_path, arch, cfg):
    """`names`: a pipeline rank reads only its stages' tensors (GPT-2's fused c_attn split
    included), with the values of a full import."""
    params = _params(arch, cfg)
    save_hf(params, arch, cfg, tmp_path, dtype="fp32")
    names = ["layers.1.attn.wk", "layers.1.mlp.w_down", "norm", "tok_emb"]
    got = load_hf_params(tmp_path, arch, cfg, names=names)
    assert sorted(got) == sorted(names)
    for n in names:
        assert torch.equal(got[n], params[n]), n


def test_gpt2_import_from_transformers_incl_base_model_names(tmp_path):
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_inner=80, vocab_size=72, n_positions=40,
                                     layer_norm_epsilon=1e-6, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "lm", safe_serialization=True)
    fields = read_hf_config(tmp_path / "lm")
    assert fields == {"arch": "gpt2", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": None, "ffn_dim": 80,
                      "vocab_size": 72, "max_seq_len": 40, "rope_theta": None, "norm_eps": 1e-6,
                      "tie_embeddings": True, "rope_scaling": None}
    cfg = _family(fields)
    tokens = _tokens(72)
    expected = _hf_logits(model, tokens)
    params = load_hf_params(tmp_path / "lm", "gpt2", cfg)
    diff = (_ours("gpt2", cfg, params, tokens) - expected).abs().max().item()
    assert diff < ATOL, f"max |logit difference| {diff} (up to {ATOL} allowed)"

    # The original GPT-2 release names tensors without "transformer." and keeps the
    # causal-mask buffers: both are understood.
    base = tmp_path / "base"
    base.mkdir()
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(tmp_path / "lm" / "model.safetensors").items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 40, 40)
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    (base / "config.json").write_text((tmp_path / "lm" / "config.json").read_text())
    again = load_hf_params(base, "gpt2", cfg)
    assert all(torch.equal(again[n], params[n]) for n in params)


# --------------------------------------------------------------------------- sharded, bf16


def test_sharded_bf16_export_loads_in_transformers(tmp_path):
    transformers = _transformers()
    params = _params("llama", LLAMA)
    max_shard = 40_000  # bytes: the 96 x 64 bf16 embedding (12 KiB) and a few layers per file
    summary = save_hf(params, "llama", LLAMA, tmp_path, dtype="bf16", max_shard_bytes=max_shard)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    n = len(files)
    assert n >= 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert summary["files"] == files and not (tmp_path / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == files
    bf16 = {n: t.to(torch.bfloat16) for n, t in params.items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in bf16.values())
    for name in files:
        with safe_open(tmp_path / name, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert sum(math.prod(f.get_slice(k).get_shape()) * 2 for k in f.keys()) <= max_shard
            assert all(index["weight_map"][k] == name for k in f.keys())
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"

    # Our import reads the bf16 values back exactly (as fp32).
    back = load_hf_params(tmp_path, "llama", LLAMA)
    assert all(back[n].dtype == torch.float32 and torch.equal(back[n], bf16[n].float()) for n in params)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, **_fp32_kwargs(transformers)).eval()
    tokens = _tokens(96)
    rounded = {n: t.float() for n, t in bf16.items()}
    diff = (_hf_logits(model, tokens) - _ours("llama", LLAMA, rounded, tokens)).abs().max().item()
    assert diff < ATOL, f"max |logit difference| {diff} (up to {ATOL} allowed)"


# --------------------------------------------------------------------------- DCP checkpoints


def _write_tokenizer(directory: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(40)}}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return directory / "tokenizer.json"


def _run_config(arch: str, cfg, tokenizer: str = "bytes") -> RunConfig:
    return RunConfig(model=ModelConfig(**_model_fields(arch, cfg)), data=DataConfig(tokenizer=tokenizer))


def test_export_checkpoint_equals_in_memory_export(tmp_path):
    tokenizer = _write_tokenizer(tmp_path / "tok")
    params = _params("gpt2", GPT2)
    run_dir = tmp_path / "run"
    extra = {"config": _run_config("gpt2", GPT2, str(tokenizer)).to_dict()}
    ckpt.save(run_dir / "checkpoints", 5, TrainState.create(params), extra, keep_last=2)
    summary = export_checkpoint(run_dir, tmp_path / "exported", dtype="bf16")  # a run dir: its latest checkpoint
    assert summary["step"] == 5 and summary["checkpoint"] == str(run_dir / "checkpoints" / "step_00000005")
    save_hf(params, "gpt2", GPT2, tmp_path / "memory", tokenizer=str(tokenizer))

    out, memory = tmp_path / "exported", tmp_path / "memory"
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json"]
    assert (out / "model.safetensors").read_bytes() == (memory / "model.safetensors").read_bytes()
    assert (out / "config.json").read_text() == (memory / "config.json").read_text()
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["torch_dtype"]) == (1, 2, "bfloat16")
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    exported = load_file(out / "model.safetensors")
    assert torch.equal(exported["transformer.h.0.mlp.c_fc.weight"], params["layers.0.mlp.w_up"].T.to(torch.bfloat16))

    with pytest.raises(ConfigError, match="already exists and is not an empty directory"):
        export_checkpoint(run_dir, out)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        export_checkpoint(tmp_path / "tok", tmp_path / "x")
    with pytest.raises(CheckpointError, match="does not exist"):
        export_checkpoint(tmp_path / "missing", tmp_path / "x")


def test_failed_export_leaves_nothing(tmp_path, monkeypatch):
    params = _params("llama", LLAMA)
    real, calls = hf_export._assemble, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("disk full")
        return real(*args)

    monkeypatch.setattr(hf_export, "_assemble", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        save_hf(params, "llama", LLAMA, tmp_path / "out", max_shard_bytes=20_000)
    assert os.listdir(tmp_path) == []


_MEASURE = textwrap.dedent("""
    import json, sys
    from meshtrain.run.export import export_checkpoint

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    export_checkpoint(sys.argv[1], sys.argv[3], dtype="fp32")  # warm-up: imports, first allocations
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = status("VmRSS")
    export_checkpoint(sys.argv[2], sys.argv[4], dtype="fp32")
    print(json.dumps({"before": before, "peak": status("VmHWM")}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to reset the peak RSS")
def test_export_streams_one_parameter_at_a_time(tmp_path):
    """Peak RSS of exporting a 100 MiB checkpoint grows by a few copies of its largest
    (4 MiB) parameter (about 20 MiB), not by the model: measured in a fresh process with
    the peak (VmHWM) reset just before."""
    big = LlamaConfig(dim=512, n_layers=6, n_heads=8, n_kv_heads=8, ffn_dim=2048, vocab_size=1024, max_seq_len=64)
    small = LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
    for name, cfg in (("small", small), ("big", big)):
        params = {n: init_slice(s, n, 0) for n, s in build("llama", cfg).specs.items()}
        state = TrainState(params, {})
        ckpt.save(tmp_path / name, 1, state, {"config": _run_config("llama", cfg).to_dict()}, keep_last=1)
    model_bytes = sum(t.numel() * 4 for t in params.values())
    largest = max(t.numel() * 4 for t in params.values())
    del params, state
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "small"), str(tmp_path / "big"),
                             str(tmp_path / "out_small"), str(tmp_path / "out_big")],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    grown = measured["peak"] - measured["before"]
    assert (tmp_path / "out_big" / "model.safetensors").stat().st_size > model_bytes
    print(f"export peak RSS growth {grown / 2**20:.1f} MiB; model {model_bytes / 2**20:.1f} MiB, largest "
          f"parameter {largest / 2**20:.1f} MiB")
    assert grown < 8 * largest, (grown, largest, model_bytes)
    assert grown < model_bytes / 4


# --------------------------------------------------------------------------- errors


def test_import_errors_name_the_tensor(tmp_path):
    params = _params("llama", LLAMA)
    save_hf(params, "llama", LLAMA, tmp_path / "good", dtype="fp32")
    tensors = load_file(tmp_path / "good" / "model.safetensors")
    config = (tmp_path / "good" / "config.json").read_text()

    def variant(name: str, change) -> Path:
        d = tmp_path / name
        d.mkdir()
        t = dict(tensors)
        change(t)
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(config)
        return d

    missing = variant("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConfigError, match=r"tensor model.layers.1.mlp.up_proj.weight \(shape \(128, 64\)\) is "
                                          r"missing from model.safetensors"):
        load_hf_params(missing, "llama", LLAMA)
    wrong = variant("wrong", lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(ConfigError, match=r"tensor model.norm.weight has shape \(65,\) in model.safetensors but "
                                          r"the model config expects \(64,\)"):
        load_hf_params(wrong, "llama", LLAMA)
    extra = variant("extra", lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(ConfigError, match="tensor model.layers.0.self_attn.q_proj.bias in model.safetensors is "
                                          "not part of the llama model"):
        load_hf_params(extra, "llama", LLAMA)
    wide = LlamaConfig(**{**vars(LLAMA), "rope_theta": 500000.0})
    with pytest.raises(ConfigError, match=r"gives model.rope_theta=10000.0 but the model config has "
                                          r"model.rope_theta=500000.0"):
        load_hf_params(tmp_path / "good", "llama", wide)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save(tensors, pickled / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="no \\*.safetensors weights \\(found pytorch_model.bin: pickle files"):
        load_hf_params(pickled, "llama", LLAMA)
    with pytest.raises(ConfigError, match="no config.json"):
        read_hf_config(pickled)
    # All messages are one line.
    for d in (missing, wrong, extra):
        with pytest.raises(ConfigError) as e:
            load_hf_params(d, "llama", LLAMA)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("change, key", [
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act=\"gelu\" is not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic' is not supported"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
     "rope_parameters.rope_type='yarn' is not supported"),
    ({"head_dim": 32}, "head_dim=32 differs from hidden_size / num_attention_heads"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "model_type='mistral'"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification is not supported"),
    ({"num_key_value_heads": 3}, "model.n_heads=4 is not divisible by model.n_kv_heads=3"),
    ({"hidden_size": None}, "hidden_size is missing"),
])
def test_unsupported_llama_configs(change, key):
    config = {**to_hf_config("llama", LLAMA), **change}
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace("[", r"\[")) as e:
        from_hf_config(config)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("change, key", [
    ({"activation_function": "gelu"}, "activation_function=\"gelu\" is not supported"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=true is not supported"),
    ({"scale_attn_weights": False}, "scale_attn_weights=false is not supported"),
    ({"add_cross_attention": True}, "add_cross_attention=true is not supported"),
])
def test_unsupported_gpt2_configs(change, key):
    base = to_hf_config("gpt2", GPT2)
    assert from_hf_config({**base, "activation_function": "gelu_pytorch_tanh"})["arch"] == "gpt2"
    config = {**base, **change}
    with pytest.raises(ConfigError, match=key):
        from_hf_config(config)


def test_config_roundtrip_and_transformers5_rope_parameters():
    cfg = LlamaConfig(**{**vars(LLAMA), "rope_scaling": SCALING, "rope_theta": 500000.0})
    config = to_hf_config("llama", cfg, bos_token_id=256, eos_token_id=257)
    assert (config["bos_token_id"], config["eos_token_id"], config["head_dim"]) == (256, 257, 16)
    assert from_hf_config(config) == _model_fields("llama", cfg)
    # transformers 5 writes RoPE as rope_parameters.
    v5 = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, **SCALING}
    assert from_hf_config(v5) == from_hf_config(config)
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.0}
    assert from_hf_config(v5)["rope_theta"] == 1234.0 and from_hf_config(v5)["rope_scaling"] is None
    assert from_hf_config(to_hf_config("gpt2", GPT2)) == _model_fields("gpt2", GPT2)


# --------------------------------------------------------------------------- 4 ranks


def _strided_rules():
    from meshtrain.layout.rules import Rules

    base = Rules.default()
    return Rules(base.mapping, {"layers.*.mlp.*": {"mlp": ("tp", "fsdp"), "embed": ()}})


def _sharded_ranks(llama_dir: str, gpt2_dir: str, root: str):
    """On each of 4 ranks (fsdp 2 x tp 2): load both models by plan while counting the
    bytes read from the files, compare every local shard with the slice of the full
    tensor, write the llama DTensors with save_hf and as a DCP checkpoint."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from meshtrain.layout.mesh import MeshSpec
    from meshtrain.layout.plan import make_plan
    from meshtrain.layout.rules import Rules

    from meshtrain.interop import load as hf_load

    read = {"bytes": 0}
    real_open = hf_load.safe_open  # where the importer looks it up

    class Slice:
        def __init__(self, inner):
            self.inner = inner

        def __getitem__(self, index):
            t = self.inner[index]
            read["bytes"] += t.numel() * t.element_size()
            return t

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class Handle:
        def __init__(self, inner):
            self.inner = inner

        def get_slice(self, name):
            return Slice(self.inner.get_slice(name))

        def get_tensor(self, name):
            t = self.inner.get_tensor(name)
            read["bytes"] += t.numel() * t.element_size()
            return t

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class CountingOpen:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            return Handle(self.inner.__enter__())

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    out = {}
    for arch, d, rules in (("llama", llama_dir, _strided_rules()), ("gpt2", gpt2_dir, Rules.default())):
        cfg = _family(read_hf_config(d))
        full = load_hf_params(d, arch, cfg)
        plan = make_plan(build(arch, cfg).specs, rules, MeshSpec(fsdp=2, tp=2), world=dist.get_world_size())
        mesh = plan.mesh.build()
        read["bytes"] = 0
        hf_load.safe_open = CountingOpen
        try:
            params = load_hf_params(d, arch, cfg, plan, mesh)
        finally:
            hf_load.safe_open = real_open
        shard_bytes = sum(params[n].to_local().numel() * 4 for n in params)
        mismatched = [n for n, p in plan.params.items()
                      if not torch.equal(params[n].to_local(),
                                         distribute_tensor(full[n], mesh, p.placements, src_data_rank=None).to_local())]
        strided = [n for n, p in plan.params.items() if any(isinstance(x, _StridedShard) for x in p.placements)]
        gathered_ok = all(torch.equal(params[n].full_tensor(), full[n]) for n in sorted(params))
        out[arch] = {"read": read["bytes"], "shard_bytes": shard_bytes, "mismatched": mismatched,
                     "strided": strided, "gathered_ok": gathered_ok,
                     "requires_grad": all(p.requires_grad for p in params.values())}
        if arch == "llama":
            save_hf(params, arch, cfg, Path(root) / "from_dtensors", dtype="fp32")
            extra = {"config": _run_config(arch, cfg).to_dict()}
            ckpt.save(Path(root) / "ckpt", 3, TrainState(params, {}), extra, keep_last=1)
    return out


@pytest.mark.slow
def test_sharded_import_reads_only_local_slices(tmp_path):
    from meshtrain.testing import run_ranks

    llama_params = _params("llama", LLAMA, seed=3)
    save_hf(llama_params, "llama", LLAMA, tmp_path / "llama", dtype="fp32")
    gpt2_params = _params("gpt2", GPT2, seed=4)
    save_hf(gpt2_params, "gpt2", GPT2, tmp_path / "gpt2", dtype="fp32")

    results = run_ranks(_sharded_ranks, 4, str(tmp_path / "llama"), str(tmp_path / "gpt2"), str(tmp_path),
                        timeout=240)
    for rank, r in enumerate(results):
        for arch, total in (("llama", llama_params), ("gpt2", gpt2_params)):
            x = r[arch]
            assert x["mismatched"] == [], f"rank {rank} {arch}: local shards differ from the full tensors"
            assert x["gathered_ok"] and x["requires_grad"]
            # Every rank read exactly its shards' bytes: a quarter of the sharded tensors.
            assert x["read"] == x["shard_bytes"], f"rank {rank} {arch}: read {x['read']} B for {x['shard_bytes']} B"
            assert x["read"] < sum(t.numel() * 4 for t in total.values()) / 2
    assert len(results[0]["llama"]["strided"]) == 3 * LLAMA.n_layers  # the _StridedShard path was taken
    # DTensors written by save_hf (rank 0) and a 4-rank DCP checkpoint exported in one
    # process both give back the original files.
    original = _files_tensors(tmp_path / "llama")
    for directory in (tmp_path / "from_dtensors", None):
        if directory is None:
            export_checkpoint(tmp_path / "ckpt", tmp_path / "from_ckpt", dtype="fp32")
            directory = tmp_path / "from_ckpt"
        written = _files_tensors(directory)
        assert written.keys() == original.keys()
        assert all(torch.equal(written[k], original[k]) for k in original), directory
