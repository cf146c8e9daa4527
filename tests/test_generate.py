"""`meshtrain generate`: the KV-cache decode path against the full forward, sampling,
loading from meshtrain checkpoints and Hugging Face directories, greedy decoding
against transformers' generate, and the one-line errors."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from meshtrain.config import DataConfig, ModelConfig, RunConfig
from meshtrain.errors import ConfigError
from meshtrain.generate import generate, load_for_generate, main_generate
from meshtrain.models import FAMILIES, LocalContext, gpt2, llama
from meshtrain.models.spec import init_slice
from meshtrain import checkpoint
from meshtrain.train.step import TrainState
from support.deepseek import CFG as DEEPSEEK

pytestmark = pytest.mark.usefixtures("one_thread")

# The tiny llama of the brief: GQA (4 query heads, 2 kv heads), untied output.
LLAMA = llama.LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96,
                          max_seq_len=64)
GPT2 = gpt2.GPT2Config(dim=64, n_layers=2, n_heads=4, vocab_size=96, max_seq_len=64)

DECODE_CASES = {
    "llama-gqa": ("llama", LLAMA),
    "llama-mha-tied": ("llama", dataclasses.replace(LLAMA, n_kv_heads=4, tie_embeddings=True)),
    "llama-rope-scaling": ("llama", dataclasses.replace(LLAMA, rope_theta=500000.0, rope_scaling={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "gpt2-tied": ("gpt2", GPT2),
    "gpt2-untied": ("gpt2", dataclasses.replace(GPT2, tie_embeddings=False)),
    # MLA's compressed cache (the latent and the rotary key), YaRN, experts in groups
    "deepseek-v3": ("deepseek_v3", DEEPSEEK),
    "deepseek-v3-no-q-lora": ("deepseek_v3", dataclasses.replace(DEEPSEEK, mla=dataclasses.replace(
        DEEPSEEK.mla, q_lora_rank=None, rope_interleave=False))),
}


def init_params(arch, cfg, seed=0):
    # A larger init std than training's 0.02 spreads the logits, so greedy choices are
    # far from ties and two correct implementations cannot disagree by rounding.
    cfg = dataclasses.replace(cfg, init_std=0.1)
    return {n: init_slice(spec, n, seed) for n, spec in FAMILIES[arch].param_specs(cfg).items()}


def full_logits(arch, cfg, params, ids):
    return FAMILIES[arch].forward(cfg, params, torch.tensor([ids]), LocalContext())[0]


def prompt(n=7, seed=1, vocab=96):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_step_by_step_equals_forward(case):
    arch, cfg = DECODE_CASES[case]
    family = FAMILIES[arch]
    params = init_params(arch, cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = family.forward(cfg, params, tokens, LocalContext())
        cache = family.init_cache(cfg, batch=2, max_len=24)
        # Prefill 6, then a chunk of 3 after cached positions (masked path), then one at a time.
        pieces = [family.decode(cfg, params, tokens[:, :6], cache, 0),
                  family.decode(cfg, params, tokens[:, 6:9], cache, 6)]
        pieces += [family.decode(cfg, params, tokens[:, i:i + 1], cache, i) for i in range(9, 24)]
        last = family.decode(cfg, params, tokens[:, 23:], family.init_cache(cfg, 2, 24), 0, last_only=True)
    got = torch.cat(pieces, dim=1)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert last.shape == (2, 1, cfg.vocab_size)


def test_decode_refuses_positions_beyond_the_cache():
    params = init_params("llama", LLAMA)
    cache = llama.init_cache(LLAMA, 1, 4)
    with pytest.raises(ConfigError, match="KV cache"):
        llama.decode(LLAMA, params, torch.zeros(1, 5, dtype=torch.long), cache, 0)


# --------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("arch,cfg", [("llama", LLAMA), ("gpt2", dataclasses.replace(GPT2, tie_embeddings=False))])
def test_greedy_equals_argmax_of_forward(arch, cfg):
    params = init_params(arch, cfg)
    ids = prompt()
    new = generate(params, arch, cfg, ids, 12, temperature=0)
    seq = list(ids)
    for _ in range(12):
        seq.append(int(full_logits(arch, cfg, params, seq)[-1].argmax()))
    assert new == seq[len(ids):]


def test_sampling_is_reproducible_and_seeded():
    params = init_params("llama", LLAMA)
    ids = prompt()
    runs = {seed: generate(params, "llama", LLAMA, ids, 20, temperature=1.0, seed=seed) for seed in (0, 1, 2)}
    assert generate(params, "llama", LLAMA, ids, 20, temperature=1.0, seed=1) == runs[1]
    assert len({tuple(r) for r in runs.values()}) == 3
    assert all(len(r) == 20 and all(0 <= t < LLAMA.vocab_size for t in r) for r in runs.values())


def test_top_k_one_and_tiny_top_p_equal_greedy():
    params = init_params("llama", LLAMA)
    ids = prompt()
    greedy = generate(params, "llama", LLAMA, ids, 16, temperature=0)
    assert generate(params, "llama", LLAMA, ids, 16, temperature=1.5, top_k=1, seed=3) == greedy
    assert generate(params, "llama", LLAMA, ids, 16, temperature=1.5, top_p=1e-6, seed=3) == greedy


def test_top_k_and_top_p_keep_only_likely_tokens():
    params = init_params("llama", LLAMA)
    ids = prompt()
    for kwargs in ({"top_k": 3}, {"top_p": 0.3}):
        new = generate(params, "llama", LLAMA, ids, 16, temperature=1.0, seed=5, **kwargs)
        seq = list(ids)
        for token in new:
            probs = torch.softmax(full_logits("llama", LLAMA, params, seq)[-1], -1)
            order = probs.argsort(descending=True).tolist()
            if "top_k" in kwargs:
                assert token in order[:3]
            else:  # the token's rank is within the smallest set reaching mass 0.3
                rank = order.index(token)
                assert probs[order[:rank]].sum() < 0.3
            seq.append(token)


def test_generation_stops_at_eos():
    params = init_params("llama", LLAMA)
    ids = prompt()
    greedy = generate(params, "llama", LLAMA, ids, 16, temperature=0)
    eos = greedy[3]
    new = generate(params, "llama", LLAMA, ids, 16, temperature=0, eos_id=eos)
    assert new == greedy[:greedy.index(eos) + 1]
    assert generate(params, "llama", LLAMA, ids, 16, temperature=0, eos_id=[999, eos]) == new


def test_too_many_tokens_is_a_one_line_config_error():
    params = init_params("gpt2", GPT2)
    with pytest.raises(ConfigError, match="--max_new_tokens") as err:
        generate(params, "gpt2", GPT2, prompt(10), 60, temperature=0)
    assert "\n" not in str(err.value) and "54" in str(err.value)
    for bad in ({"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}):
        with pytest.raises(ConfigError):
            generate(params, "gpt2", GPT2, prompt(), 4, **bad)
    with pytest.raises(ConfigError, match="vocabulary"):
        generate(params, "gpt2", GPT2, [1, 96], 4)


# --------------------------------------------------------------------------- meshtrain checkpoints


def _save_run(tmp_path, tokenizer="bytes", step=3):
    model = ModelConfig(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=258,
                        max_seq_len=64)
    run = RunConfig(run_dir=str(tmp_path / "run"), model=model, data=DataConfig(tokenizer=tokenizer))
    cfg = run.family_config()
    params = init_params("llama", cfg)
    root = tmp_path / "run" / "checkpoints"
    path = checkpoint.save(root, step, TrainState.create({n: t.clone() for n, t in params.items()}),
                           extra={"config": run.to_dict(), "consumed_samples": 0}, keep_last=2)
    return cfg, params, path


def test_load_from_checkpoint_and_run_directory(tmp_path, capsys):
    cfg, params, path = _save_run(tmp_path)
    rng = torch.get_rng_state()
    for source in (path, tmp_path / "run"):
        arch, got_cfg, got, tokenizer = load_for_generate(str(source), "cpu")
        assert arch == "llama" and got_cfg == cfg and tokenizer.name == "bytes"
        assert got.keys() == params.keys() and all(torch.equal(got[n], params[n]) for n in params)
    assert torch.equal(torch.get_rng_state(), rng)  # the training RNG state is not restored

    record = main_generate(str(tmp_path / "run"), prompt="ab", max_new_tokens=8, temperature=0.8, seed=4,
                           output_format="json", device="cpu")
    line = capsys.readouterr().out.strip()
    assert json.loads(line) == record
    ids = [256, ord("a"), ord("b")]
    expected = generate(params, "llama", cfg, ids, 8, temperature=0.8, seed=4, eos_id=257)
    assert record["prompt_ids"] == ids and record["generated_ids"] == expected
    assert isinstance(record["text"], str)

    main_generate(str(path), prompt_ids="256, 97,98", max_new_tokens=8, temperature=0.8, seed=4,
                  output_format="json", device="cpu")
    assert json.loads(capsys.readouterr().out)["generated_ids"] == expected


def test_source_errors_are_one_line_config_errors(tmp_path):
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    cases = [(str(tmp_path / "empty_run"), "no complete meshtrain checkpoint"),
             (str(tmp_path / "missing"), "no such file")]
    for source, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            main_generate(source, prompt_ids="1,2", device="cpu")
        assert "\n" not in str(err.value)

    _save_run(tmp_path, tokenizer=str(tmp_path / "gone" / "tokenizer.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match="--prompt_ids") as err:
            main_generate(str(tmp_path / "run"), prompt="hello", device="cpu")
        assert "\n" not in str(err.value)
        with pytest.raises(ConfigError, match="--max_new_tokens") as err:
            main_generate(str(tmp_path / "run"), prompt_ids="1,2,3", max_new_tokens=62, device="cpu")
        assert "\n" not in str(err.value)
        with pytest.raises(ConfigError, match="exactly one"):
            main_generate(str(tmp_path / "run"), prompt="a", prompt_ids="1", device="cpu")
        with pytest.raises(ConfigError, match="comma-separated"):
            main_generate(str(tmp_path / "run"), prompt_ids="1,x", device="cpu")


# --------------------------------------------------------------------------- Hugging Face


def _hf_generate(model, ids, n):
    # No eos: transformers would stop (and pad) where the model happens to emit one.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=n)
    return out[0, len(ids):].tolist()


# Untied GPT-2: at this init, tied GPT-2 greedily repeats one token, a weak comparison
# (tied embeddings are covered by the decode test).
@pytest.mark.parametrize("arch,cfg", [("llama", LLAMA), ("gpt2", dataclasses.replace(GPT2, tie_embeddings=False))])
def test_greedy_matches_transformers(tmp_path, capsys, arch, cfg):
    transformers = pytest.importorskip("transformers")
    from meshtrain.interop.hf import save_hf

    params = init_params(arch, cfg)
    hf_dir = tmp_path / "hf"
    save_hf(params, arch, cfg, str(hf_dir), dtype="fp32")
    got_arch, got_cfg, got, tokenizer = load_for_generate(str(hf_dir), "cpu")
    assert got_arch == arch and got_cfg == cfg and tokenizer is None
    assert all(torch.equal(got[n], params[n]) for n in params)

    model_cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.GPT2LMHeadModel
    model = model_cls.from_pretrained(str(hf_dir), torch_dtype=torch.float32).eval()
    ids = prompt(9)
    expected = _hf_generate(model, ids, 20)
    assert generate(params, arch, cfg, ids, 20, temperature=0) == expected

    record = main_generate(str(hf_dir), prompt_ids=",".join(map(str, ids)), max_new_tokens=20, temperature=0,
                           output_format="json", device="cpu")
    capsys.readouterr()
    eos = model.config.eos_token_id
    n = expected.index(eos) + 1 if eos in expected else 20
    assert record["generated_ids"] == expected[:n] and record["text"] is None
    with pytest.raises(ConfigError, match="--prompt_ids") as err:
        main_generate(str(hf_dir), prompt="hello", device="cpu")
    assert "\n" not in str(err.value)


def test_hf_directory_with_tokenizer(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    from meshtrain.interop.hf import save_hf

    vocab = {f"w{i}": i for i in range(94)} | {"<s>": 94, "</s>": 95}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    params = init_params("llama", LLAMA)
    hf_dir = tmp_path / "hf"
    save_hf(params, "llama", LLAMA, str(hf_dir), dtype="fp32", tokenizer=str(tmp_path / "tokenizer.json"))

    record = main_generate(str(hf_dir), prompt="w1 w2 w3", max_new_tokens=30, temperature=1.0, seed=7,
                           output_format="json", device="cpu")
    assert json.loads(capsys.readouterr().out) == record
    assert record["prompt_ids"] == [1, 2, 3]
    assert record["generated_ids"] == generate(params, "llama", LLAMA, [1, 2, 3], 30, temperature=1.0, seed=7,
                                               eos_id=95)
    assert record["text"] == tok.decode(record["generated_ids"], skip_special_tokens=True)
    main_generate(str(hf_dir), prompt="w1 w2 w3", max_new_tokens=30, temperature=1.0, seed=7, device="cpu")
    assert capsys.readouterr().out == tok.decode([1, 2, 3] + record["generated_ids"], skip_special_tokens=True) + "\n"
