"""The tokenizer beside a dataset and beside an export: the record meshtrain preprocess
writes and fit checks, and the Hugging Face files that make a bytes run's export encode
and decode as the bytes tokenizer does. References are independent of the code under
test: Python's own UTF-8 bytes, hashlib, the tokenizers library and transformers."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import random
import shutil
import struct

import pytest
import torch

from meshtrain.cli import main
from meshtrain.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from meshtrain.data import ByteTokenizer, DataError, IndexedWriter, build_data, load_tokenizer, preprocess
from meshtrain.models import FAMILIES
from meshtrain import checkpoint
from meshtrain.train.step import TrainState
from support.cli import SMALL, TINY, run_cli

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
    assert main(["generate", "--checkpoint", str(tmp_path / "out" / "1"), "--prompt", "Four €", "--max_new_tokens",
                 "6", "--temperature", "0", "--output_format", "json", "--device", "cpu"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["prompt_ids"] == reference_ids("Four €")
    assert record["text"] == bytes(i for i in record["generated_ids"] if i < 256).decode("utf-8", errors="replace")


# --- the record --------------------------------------------------------------------------------

def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def word_tokenizer(path, words: int):
    """A tokenizer.json of `words` words w0.. plus <s> and </s> (made with the tokenizers library)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(words)} | {"<s>": words, "</s>": words + 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


WORDS = [" ".join(f"w{(i * 7 + j) % 90}" for j in range(40)) for i in range(8)]


def test_preprocess_writes_the_record_with_the_dataset(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["hello", "naïve"])
    stats = preprocess(src, tmp_path / "b", append_eod=True)
    version = importlib.metadata.version("meshtrain")
    assert stats["record"] == str(tmp_path / "b") + ".tokenizer.json"
    assert json.loads((tmp_path / "b.tokenizer.json").read_text()) == {
        "record_version": 1, "kind": "bytes", "name": "bytes", "sha256": None, "vocab_size": 258, "bos_id": 256,
        "eos_id": 257, "meshtrain_version": version}

    tok_path = word_tokenizer(tmp_path / "tok" / "tokenizer.json", 90)
    preprocess(write_jsonl(tmp_path / "w.jsonl", WORDS), tmp_path / "w", tokenizer=str(tmp_path / "tok"))
    assert json.loads((tmp_path / "w.tokenizer.json").read_text()) == {
        "record_version": 1, "kind": "tokenizer.json", "name": str(tok_path),
        "sha256": hashlib.sha256(tok_path.read_bytes()).hexdigest(), "vocab_size": 92, "bos_id": 90, "eos_id": 91,
        "meshtrain_version": version}

    # A failed preprocess leaves the dataset and its record as they were; a dataset written
    # without a record (a tokenizer object without identity) does not keep an old one.
    before = {p: (tmp_path / p).read_bytes() for p in ("b.bin", "b.idx", "b.tokenizer.json")}
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(DataError):
        preprocess(tmp_path / "bad.jsonl", tmp_path / "b", tokenizer=str(tmp_path / "tok"))
    assert {p: (tmp_path / p).read_bytes() for p in before} == before
    assert sorted(os.listdir(tmp_path)) == ["b.bin", "b.idx", "b.tokenizer.json", "bad.jsonl", "in.jsonl", "tok",
                                            "w.bin", "w.idx", "w.jsonl", "w.tokenizer.json"]
    with IndexedWriter(tmp_path / "b", "uint16") as w:
        w.add_document([1, 2, 3])
    assert not (tmp_path / "b.tokenizer.json").exists()


def test_build_data_checks_each_dataset_against_data_tokenizer(tmp_path):
    tok_path = word_tokenizer(tmp_path / "tok" / "tokenizer.json", 90)
    preprocess(write_jsonl(tmp_path / "w.jsonl", WORDS), tmp_path / "w", tokenizer=str(tok_path))
    preprocess(write_jsonl(tmp_path / "b.jsonl", ["x" * 300]), tmp_path / "b", append_eod=True)
    w, b = str(tmp_path / "w"), str(tmp_path / "b")

    same_file_elsewhere = tmp_path / "copy" / "tokenizer.json"  # identity is the content, not the path
    same_file_elsewhere.parent.mkdir()
    shutil.copyfile(tok_path, same_file_elsewhere)
    assert build_data(w, str(same_file_elsewhere), 16, 0, 300, 0.0).notes == []
    assert build_data([b, b], "bytes", 16, 0, 300, 0.0).notes == []

    with pytest.raises(DataError) as e:  # a blend: each dataset is checked
        build_data([[0.5, w], [0.5, b]], str(tok_path), 16, 0, 300, 0.0)
    message = str(e.value)
    assert "\n" not in message and f"dataset {b} was tokenized with bytes (258 token ids)" in message
    assert f"data.tokenizer is {tok_path} (sha256 {hashlib.sha256(tok_path.read_bytes()).hexdigest()[:12]}" in message
    assert "set data.tokenizer to bytes" in message

    word_tokenizer(tok_path, 91)  # the file changed since preprocess: another tokenizer under the same name
    with pytest.raises(DataError, match=f"dataset {w} was tokenized with {tok_path}"):
        build_data(w, str(tok_path), 16, 0, 300, 0.0)

    os.remove(b + ".tokenizer.json")  # as Megatron-LM writes datasets: accepted, with one note
    notes = build_data([b, b], "bytes", 16, 0, 300, 0.0).notes
    assert len(notes) == 1 and "\n" not in notes[0]
    assert notes[0].startswith(f"note: dataset {b} has no tokenizer record ({b}.tokenizer.json;")
    assert "data.tokenizer (bytes)" in notes[0]

    for damage in ("{not json", '{"kind": "bytes"}', '["bytes"]'):
        (tmp_path / "w.tokenizer.json").write_text(damage)
        with pytest.raises(DataError) as e:
            build_data(w, str(tok_path), 16, 0, 300, 0.0)
        assert str(e.value).startswith(f"{w}.tokenizer.json: ") and "delete the file" in str(e.value)


def test_fit_notes_a_dataset_without_record(tmp_path):
    with IndexedWriter(tmp_path / "megatron", "uint16") as w:  # no record, as Megatron-LM writes
        for _ in range(4):
            w.add_document([256, *b"four score and seven years ago " * 4, 257])
    proc = run_cli("fit", "--config", str(TINY), *SMALL, "--train.steps", "1", "--data.paths",
                   str(tmp_path / "megatron"), "--run_dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    notes = [line for line in proc.stdout.splitlines() if "no tokenizer record" in line]
    assert notes == [f"note: dataset {tmp_path / 'megatron'} has no tokenizer record ({tmp_path / 'megatron'}"
                     ".tokenizer.json; Megatron-LM writes none), so the tokens are assumed to come from "
                     "data.tokenizer (bytes) and are checked only against model.vocab_size"]
