"""The tokenizer beside an export: the Hugging Face files that make a bytes run's export
encode and decode as the bytes tokenizer does, export modes and dtype. References are
independent of the code under test: Python's own UTF-8 bytes, the tokenizers library and
transformers."""

from __future__ import annotations

import json
import os
import random
import struct

import pytest
import torch

from meshtrain.cli import main
from meshtrain.config.schema import DataConfig, ModelConfig, RunConfig, TrainConfig
from meshtrain.data import ByteTokenizer, load_tokenizer
from meshtrain.models import FAMILIES
from meshtrain.train import checkpoint
from meshtrain.train.step import TrainState

# Text the byte-level machinery could get wrong: empty, leading and doubled spaces, newlines
# and control bytes, multi-byte UTF-8 (accents, CJK, emoji, a ZWJ sequence), the names of
# the special tokens and of other tokenizers' specials, and GPT-2's stand-in characters
# for bytes (which must be encoded as their own UTF-8 bytes, not as the bytes they stand for).
TEXTS = ["", "Four score and", " leading space", "  two  spaces ", "line\nbreak\r\nand\ttab\x00\x7f",
         "naïve café — 日本語 🙂", "👩‍👩‍👧 family", "<bos> spelled out <eos>",
         "<|endoftext|><s></s>", "Ġ Ċ ĉ Ā", "\u00ad soft hyphen \ufeff", "x" * 3000]


def reference_ids(text: str) -> list[int]:
    return [256, *text.encode("utf-8")]


@pytest.fixture(scope="module")
def byte_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("bytes_tokenizer")
    for name, text in ByteTokenizer().hf_files().items():
        (out / name).write_text(text, encoding="utf-8")
    return out


# --- the Hugging Face files of the bytes tokenizer ---------------------------------------------

def test_transformers_autotokenizer_encodes_and_decodes_as_bytes(byte_files, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = transformers.AutoTokenizer.from_pretrained(str(byte_files))
    assert (len(tok), tok.bos_token_id, tok.eos_token_id) == (258, 256, 257)
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == reference_ids(text), text[:40]
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode([256, 104, 105, 257]) == "<bos>hi<eos>"  # the special tokens keep their names


def test_tokenizers_library_and_our_loader_agree_with_bytes(byte_files):
    tokenizers = pytest.importorskip("tokenizers")
    raw = tokenizers.Tokenizer.from_file(str(byte_files / "tokenizer.json"))
    loaded = load_tokenizer(str(byte_files))  # how generate reads an export: honours split_special_tokens
    assert (loaded.vocab_size, loaded.bos_id, loaded.eos_id) == (258, 256, 257)
    for text in TEXTS:
        assert loaded.encode(text) == reference_ids(text), text[:40]
        if "<bos>" not in text and "<eos>" not in text:  # the bare library matches special tokens in text
            assert raw.encode(text).ids == reference_ids(text), text[:40]
    # Any ids, valid UTF-8 or not: decoded as Python decodes the bytes, specials dropped.
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(258) for _ in range(rng.randrange(10))]
        expected = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        assert raw.decode(ids, skip_special_tokens=True) == expected, ids
        assert loaded.decode(ids) == expected, ids


# --- export: modes, default dtype, the bytes tokenizer -----------------------------------------

def safetensors_dtypes(path) -> set[str]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def save_run(root, precision: str):
    model = ModelConfig(arch="llama", dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=258,
                        max_seq_len=32)
    run = RunConfig(run_dir=str(root), model=model, train=TrainConfig(precision=precision),
                    data=DataConfig(tokenizer="bytes"))
    specs = FAMILIES["llama"].param_specs(run.family_config())
    params = {name: torch.randn(spec.shape, generator=torch.Generator().manual_seed(i))
              for i, (name, spec) in enumerate(sorted(specs.items()))}
    checkpoint.save(root / "checkpoints", 1, TrainState.create(params), extra={"config": run.to_dict(),
                                                                              "consumed_samples": 0}, keep_last=1)
    return root


def test_export_modes_default_dtype_and_bytes_tokenizer(tmp_path, capsys):
    umask = os.umask(0o022)
    try:
        bf16, fp32 = save_run(tmp_path / "bf16", "bf16"), save_run(tmp_path / "fp32", "fp32")
        cases = [(bf16, [], "BF16"), (fp32, [], "F32"), (bf16, ["--dtype", "fp32"], "F32"),
                 (fp32, ["--dtype", "bf16"], "BF16")]
        for i, (run, args, expected) in enumerate(cases):
            out = tmp_path / "out" / str(i)
            assert main(["export", "--checkpoint", str(run), "--out", str(out), *args]) == 0
            assert f"({'bf16' if expected == 'BF16' else 'fp32'}," in capsys.readouterr().out
            assert safetensors_dtypes(out / "model.safetensors") == {expected}
            assert os.stat(out).st_mode & 0o7777 == 0o755
            assert {p.name: os.stat(p).st_mode & 0o7777 for p in out.iterdir()} == {
                name: 0o644 for name in ("config.json", "generation_config.json", "model.safetensors",
                                         "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")}
    finally:
        os.umask(umask)

    # A text prompt on the export of a bytes run: encoded as bytes, the text decoded.
    assert main(["generate", "--checkpoint", str(tmp_path / "out" / "1"), "--prompt", "Four €", "--max-new-tokens",
                 "6", "--temperature", "0", "--output-format", "json", "--device", "cpu"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["prompt_ids"] == reference_ids("Four €")
    assert record["text"] == bytes(i for i in record["generated_ids"] if i < 256).decode("utf-8", errors="replace")
