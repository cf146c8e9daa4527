"""build_data: the trainer's TokenData from data.paths (the builtin corpus or weighted
Megatron-LM indexed datasets), with the tokenizer record, token ids and splits checked."""

from __future__ import annotations

import json
import math
import os

import numpy as np

from .builtin import builtin_dataset
from .config import parse_paths
from .dataset import PackedDataset, TokenData, TrainSplit, ValidSplit
from .errors import DataError
from .indexed import IndexedDataset, record_path
from .tokenizer import (
    ByteTokenizer,
    describe_record,
    load_tokenizer,
    same_tokenizer,
    tokenizer_record,
)


def build_data(paths, tokenizer: str, seq_len: int, seed: int, vocab_size: int,
               valid_fraction: float) -> TokenData:
    """Open, check and split the datasets `paths` names: "builtin", a prefix, a list of
    prefixes (equal weights) or a list of [weight, prefix] pairs (weights normalised)."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"seq_len={seq_len!r}: give a positive whole number of tokens")
    if not 0 <= valid_fraction < 1:
        raise DataError(f"data.valid_fraction={valid_fraction!r}: give a fraction in [0, 1), e.g. 0.01")
    entries = parse_paths(paths)
    tok = _check_tokenizer(tokenizer, vocab_size, builtin=any(p == "builtin" for _, p in entries))
    train, valid, names, unrecorded = [], [], [], []
    for _, prefix in entries:
        source = builtin_dataset() if prefix == "builtin" else IndexedDataset(prefix)
        if prefix != "builtin" and not _check_record(prefix, tok, vocab_size):
            unrecorded.append(prefix)
        if source.num_tokens == 0:
            raise DataError(f"{source.idx_path or source.name}: the dataset is empty ({source.num_documents} "
                            "documents, 0 tokens); re-run meshtrain preprocess on an input with text, or drop it "
                            "from data.paths")
        checked = _check_tokens(source, vocab_size)
        t, v = _split(source, seq_len, valid_fraction)
        if not checked:
            for part in (t, v):
                if part is not None:
                    part.vocab_limit = vocab_size
        train.append(t)
        valid += [v] if v is not None else []
        names.append(source.name)
    if valid_fraction > 0 and not valid:
        raise DataError(f"data.valid_fraction={valid_fraction}: no dataset has a document to hold out "
                        f"({', '.join(names)}); set data.valid_fraction 0 or use datasets with more documents")
    weights = [1.0 if w is None else w for w, _ in entries]
    weights = [w / sum(weights) for w in weights]
    notes = [_unrecorded_note(unrecorded, tok.name)] if unrecorded else []
    return TokenData(TrainSplit(train, weights, seed), ValidSplit(valid) if valid else None, seq_len, names, weights,
                     notes, tok.eos_id, tokenizer_record(tok))


def _check_tokenizer(spec: str, vocab_size: int, builtin: bool):
    if builtin and spec != "bytes":
        raise DataError(f"data.paths builtin is bytes-tokenized, but data.tokenizer={spec!r}: set data.tokenizer "
                        "to bytes, or give a dataset written with that tokenizer")
    tok = ByteTokenizer() if spec == "bytes" else load_tokenizer(spec)
    if tok.vocab_size > vocab_size:
        raise DataError(f"tokenizer {tok.name}: {tok.vocab_size} token ids, more than model.vocab_size={vocab_size}; "
                        f"raise model.vocab_size to at least {tok.vocab_size}")
    return tok


def _check_record(prefix: str, tok, vocab_size: int) -> bool:
    """The dataset's tokenizer record must name data.tokenizer's tokenizer. False when there
    is no record (Megatron-LM writes none): the data is taken as it is."""
    path = record_path(prefix)
    if not os.path.exists(path):
        return False
    record = _read_record(path)
    if same_tokenizer(record, tok):
        return True
    fix = f"set data.tokenizer to {record['name']}"
    if record["vocab_size"] > vocab_size:
        fix += f" and model.vocab_size to at least {record['vocab_size']}"
    raise DataError(f"dataset {prefix} was tokenized with {describe_record(record)}, says {path}, but "
                    f"data.tokenizer is {describe_record(tokenizer_record(tok))}: {fix}, or re-run meshtrain "
                    f"preprocess with --tokenizer {tok.name}")


def _read_record(path: str) -> dict:
    fix = "re-run meshtrain preprocess, or delete the file to train without the tokenizer check"
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable tokenizer record ({e}); {fix}") from None
    valid = (isinstance(record, dict) and record.get("kind") in ("bytes", "tokenizer.json")
             and isinstance(record.get("name"), str) and type(record.get("vocab_size")) is int
             and (record["kind"] == "bytes" or isinstance(record.get("sha256"), str)))
    if not valid:
        raise DataError(f"{path}: not a tokenizer record (a JSON object with kind bytes or tokenizer.json, name, "
                        f"vocab_size and, for a tokenizer.json, sha256); {fix}")
    return record


def _unrecorded_note(prefixes: list[str], tokenizer: str) -> str:
    prefixes = list(dict.fromkeys(prefixes))
    if len(prefixes) == 1:
        which = f"dataset {prefixes[0]} has no tokenizer record ({record_path(prefixes[0])}"
    else:
        shown = ", ".join(prefixes[:3]) + (f" and {len(prefixes) - 3} more" if len(prefixes) > 3 else "")
        which = f"{len(prefixes)} datasets ({shown}) have no tokenizer record (<prefix>.tokenizer.json"
    return (f"note: {which}; Megatron-LM writes none), so the tokens are assumed to come from data.tokenizer "
            f"({tokenizer}) and are checked only against model.vocab_size")


# Scan a .bin for out-of-vocabulary ids at open only up to this size (about a second of
# reading); larger datasets are checked batch by batch as they are read, so that every
# rank of a large job does not read the whole corpus before its first step.
SCAN_LIMIT_BYTES = 1 << 30


def _check_tokens(source: IndexedDataset, vocab_size: int) -> bool:
    """Every token id must be a row of the embedding: scan for the largest, unless the
    dtype cannot hold an id >= vocab_size anyway. False: too large to scan, check as read."""
    where = source.bin_path or source.name
    if source.dtype.kind not in "iu":
        raise DataError(f"{where}: tokens are stored as {source.dtype.name}, not integers; re-run meshtrain "
                        "preprocess")
    info = np.iinfo(source.dtype)
    if info.min >= 0 and info.max < vocab_size:
        return True
    if source.num_tokens * source.dtype.itemsize > SCAN_LIMIT_BYTES:
        return False
    found = source.token_range()
    if found is None:
        return True
    low, high = found
    if low < 0:
        raise DataError(f"{where}: negative token id {low}; the file is damaged or not token ids, re-run "
                        "meshtrain preprocess")
    if high >= vocab_size:
        raise DataError(f"{where}: token id {high} >= model.vocab_size={vocab_size}; raise model.vocab_size to at "
                        f"least {high + 1}, or re-tokenize the data (meshtrain preprocess) with the model's tokenizer")
    return True


def _split(source: IndexedDataset, seq_len: int, valid_fraction: float):
    """(train, valid or None): the last round(valid_fraction * documents) documents are
    held out, at least one when valid_fraction > 0 and there are two or more."""
    n = source.num_documents
    n_valid = math.floor(valid_fraction * n + 0.5) if valid_fraction > 0 else 0
    if valid_fraction > 0 and n >= 2:
        n_valid = max(1, n_valid)
    train = PackedDataset(source, seq_len, 0, n - n_valid,
                          name=f"{source.name} (training split: documents [0, {n - n_valid}) of {n})",
                          fix="lower train.seq_len or data.valid_fraction, or add data")
    if n_valid == 0:
        return train, None
    valid = PackedDataset(source, seq_len, n - n_valid, n,
                          name=f"{source.name} (validation split: documents [{n - n_valid}, {n}))",
                          fix="raise data.valid_fraction or lower train.seq_len")
    return train, valid

