"""The Hugging Face files that make a bytes run's export encode and decode as the bytes
tokenizer does. References are independent of the code under test: Python's own UTF-8
bytes, the tokenizers library and transformers."""

from __future__ import annotations

import random

import pytest

from meshtrain.data import ByteTokenizer, load_tokenizer

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
