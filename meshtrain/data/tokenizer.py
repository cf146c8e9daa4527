"""Tokenizers: text -> token ids for preprocess, and the vocabulary size to check against
the model. `bytes` needs nothing; anything else is a Hugging Face tokenizer.json read with
the `tokenizers` library (imported only when used).

A tokenizer's identity is its kind and, for a tokenizer.json, the sha256 of the file's
bytes: preprocess records it beside the dataset (`tokenizer_record`) and fit compares.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from typing import Protocol

from .errors import DataError


class Tokenizer(Protocol):
    name: str
    kind: str  # "bytes" or "tokenizer.json"
    sha256: str | None  # of the tokenizer.json's bytes; None for bytes, which is one fixed tokenizer
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """encode's ids and each token's [start, end) characters of `text` (empty for a
        special token)."""
        ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """Token = UTF-8 byte (0..255), BOS 256, EOS 257: vocabulary 258. encode puts BOS first
    and no EOS (preprocess --append_eod adds it); decode drops the special tokens."""

    name = kind = "bytes"
    sha256 = None
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return [self.bos_id, *text.encode("utf-8")]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        offsets = [(0, 0)]  # BOS
        for i, char in enumerate(text):
            offsets += [(i, i + 1)] * len(char.encode("utf-8"))
        return self.encode(text), offsets

    def decode(self, ids) -> str:
        return bytes(int(t) for t in ids if 0 <= int(t) < 256).decode("utf-8", errors="replace")

    def hf_files(self) -> dict[str, str]:
        """tokenizer.json, tokenizer_config.json and special_tokens_map.json that make
        transformers' AutoTokenizer (and the tokenizers library) encode and decode exactly as
        this class: a byte-level BPE without merges whose vocabulary maps GPT-2's printable
        stand-in for byte b to id b, BOS prepended by the post-processor, no EOS."""
        stand_in = _byte_stand_ins()
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        bos, eos = HF_SPECIAL_TOKENS
        tokenizer = {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True}
                             for i, c in ((self.bos_id, bos), (self.eos_id, eos))],
            "normalizer": None, "pre_tokenizer": byte_level,
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [self.bos_id], "tokens": [bos]}}},
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {stand_in[b]: b for b in range(256)}, "merges": []},
        }
        special = {"bos_token": bos, "eos_token": eos}
        # split_special_tokens: text that happens to spell "<bos>" is bytes, as in encode();
        # without it the tokenizer would turn those five characters into id 256.
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "split_special_tokens": True,
                  "clean_up_tokenization_spaces": False}
        files = {"tokenizer.json": tokenizer, "tokenizer_config.json": config, "special_tokens_map.json": special}
        return {name: json.dumps(value, indent=2, ensure_ascii=False) + "\n" for name, value in files.items()}


HF_SPECIAL_TOKENS = ("<bos>", "<eos>")  # the names of ids 256 and 257 in the Hugging Face files


def _byte_stand_ins() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer and decoder
    use): printable Latin-1 bytes stand for themselves, the others for chr(256 + n) in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    out, n = {}, 0
    for b in range(256):
        out[b] = chr(b) if b in printable else chr(256 + n)
        n += b not in printable
    return out


# Spellings of the document-boundary tokens across common tokenizers, most specific first.
# GPT-2-style vocabularies have only <|endoftext|>, which serves as both.
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]", "<|endoftext|>")
EOS_TOKENS = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[EOS]", "<|im_end|>")


class HFTokenizer:
    """A Hugging Face tokenizer.json. encode applies the file's own post-processor (for
    example Llama's BOS), as the model's tokenizer would at inference."""

    kind = "tokenizer.json"

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise DataError(f"tokenizer {self.path}: reading a tokenizer.json needs the tokenizers library; "
                            "pip install tokenizers") from None
        try:
            with open(self.path, "rb") as f:
                content = f.read()
            self._tok = _Tokenizer.from_str(content.decode("utf-8"))
        except Exception as e:  # the library raises a bare Exception on a bad file
            raise DataError(f"tokenizer {self.path}: not a readable Hugging Face tokenizer.json ({e}); "
                            "give the tokenizer.json that came with the model") from None
        self.sha256 = hashlib.sha256(content).hexdigest()  # of the very bytes parsed: the identity
        self.name = self.path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        config = _tokenizer_config(os.path.dirname(self.path))
        self.bos_id = _find(vocab, config.get("bos_token"), BOS_TOKENS)
        self.eos_id = _find(vocab, config.get("eos_token"), EOS_TOKENS)
        # As transformers does: the model's own choice to read special tokens' text as text.
        self._tok.encode_special_tokens = config.get("split_special_tokens") is True

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self._tok.encode(text, add_special_tokens=True)
        special = encoding.special_tokens_mask
        return encoding.ids, [(0, 0) if special[i] else tuple(o) for i, o in enumerate(encoding.offsets)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(t) for t in ids], skip_special_tokens=True)

    # Worker processes get the path and read the file themselves.
    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])


def _tokenizer_config(directory: str) -> dict:
    """bos_token, eos_token (strings) and split_special_tokens from a tokenizer_config.json
    beside the tokenizer, if any: the model's own choice beats guessing from the vocabulary."""
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
    if isinstance(config, dict) and "split_special_tokens" in config:
        out["split_special_tokens"] = config["split_special_tokens"]
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


RECORD_VERSION = 1


def tokenizer_record(tok: Tokenizer) -> dict | None:
    """What preprocess writes to <prefix>.tokenizer.json: the tokenizer's identity (kind,
    sha256), its name as given, and what fit checks against the model; None for a tokenizer
    object without an identity (one passed to preprocess in Python)."""
    kind = getattr(tok, "kind", None)
    if kind not in ("bytes", "tokenizer.json"):
        return None
    try:
        version = importlib.metadata.version("meshtrain")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        version = None
    return {"record_version": RECORD_VERSION, "kind": kind, "name": tok.name, "sha256": tok.sha256,
            "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id, "meshtrain_version": version}


def same_tokenizer(record: dict, tok: Tokenizer) -> bool:
    """Identity, not name: the same tokenizer.json bytes under another path are the same."""
    return (record["kind"], record.get("sha256")) == (getattr(tok, "kind", None), getattr(tok, "sha256", None))


def describe_record(record: dict) -> str:
    """A tokenizer record in one phrase, for messages: bytes, or its path and hash prefix."""
    size = f"{record['vocab_size']} token ids"
    if record["kind"] == "bytes":
        return f"bytes ({size})"
    return f"{record['name']} (sha256 {record['sha256'][:12]}, {size})"
