"""Tokenizers: text -> token ids for preprocess, and the vocabulary size to check against
the model. `bytes` needs nothing; anything else is a Hugging Face tokenizer.json read with
the `tokenizers` library (imported only when used)."""

from __future__ import annotations

import json
import os
from typing import Protocol

from .errors import DataError


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """Token = UTF-8 byte (0..255), BOS 256, EOS 257: vocabulary 258. encode puts BOS first
    and no EOS (preprocess --append-eod adds it); decode drops the special tokens."""

    name = "bytes"
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return [self.bos_id, *text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(int(t) for t in ids if 0 <= int(t) < 256).decode("utf-8", errors="replace")


# Spellings of the document-boundary tokens across common tokenizers, most specific first.
# GPT-2-style vocabularies have only <|endoftext|>, which serves as both.
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]", "<|endoftext|>")
EOS_TOKENS = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[EOS]", "<|im_end|>")


class HFTokenizer:
    """A Hugging Face tokenizer.json. encode applies the file's own post-processor (for
    example Llama's BOS), as the model's tokenizer would at inference."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise DataError(f"tokenizer {self.path}: reading a tokenizer.json needs the tokenizers library; "
                            "pip install tokenizers") from None
        try:
            self._tok = _Tokenizer.from_file(self.path)
        except Exception as e:  # the library raises a bare Exception on a bad file
            raise DataError(f"tokenizer {self.path}: not a readable Hugging Face tokenizer.json ({e}); "
                            "give the tokenizer.json that came with the model") from None
        self.name = self.path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        named = _config_special_tokens(os.path.dirname(self.path))
        self.bos_id = _find(vocab, named.get("bos_token"), BOS_TOKENS)
        self.eos_id = _find(vocab, named.get("eos_token"), EOS_TOKENS)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(t) for t in ids], skip_special_tokens=True)

    # Worker processes get the path and read the file themselves.
    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])


def _config_special_tokens(directory: str) -> dict:
    """bos_token/eos_token from a tokenizer_config.json beside the tokenizer, if any: the
    model's own choice beats guessing from the vocabulary."""
    try:
        with open(os.path.join(directory or ".", "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    out = {}
    for key in ("bos_token", "eos_token"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _find(vocab: dict, preferred: str | None, candidates: tuple[str, ...]) -> int | None:
    for token in ((preferred,) if preferred else ()) + candidates:
        if token in vocab:
            return vocab[token]
    return None


def load_tokenizer(spec) -> Tokenizer:
    """`bytes`, or the path of a tokenizer.json (or of a directory holding one)."""
    if not isinstance(spec, (str, os.PathLike)):
        return spec  # already a tokenizer object
    spec = os.fspath(spec)
    if spec == "bytes":
        return ByteTokenizer()
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise DataError(f"tokenizer {spec!r}: {path} not found; give bytes or the path of a Hugging Face "
                        "tokenizer.json (or of the directory holding it; nothing is downloaded)")
    return HFTokenizer(path)
