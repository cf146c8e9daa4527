"""The data.* section of a run config and the shape of its data.paths, checked here; the
files and tokens are checked when the data is opened (data/build.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, check_bool, check_float, check_int
from .errors import DataError

BYTES_VOCAB = 258  # the bytes tokenizer: 256 byte values, BOS and EOS


@dataclass
class DataConfig:
    """Training data."""

    paths: Any = "builtin"
    """Token source: builtin (a small embedded English corpus, no download); a Megatron-LM indexed dataset prefix (path without .bin/.idx, as written by meshtrain preprocess); a list of prefixes (equal weights); or a blend [[0.7, prefixA], [0.3, prefixB]]."""
    tokenizer: str = "bytes"
    """Tokenizer the data was written with: bytes (UTF-8 bytes + BOS 256 + EOS 257, vocabulary 258) or a path to a Hugging Face tokenizer.json. Used to check the vocabulary against model.vocab_size."""
    valid_fraction: float = 0.01
    """Share of each dataset's documents (its last ones) held out for validation; at least one document when > 0; 0: no validation split."""
    document_mask: bool = False
    """Attention stays inside each document packed into a sample (Megatron's --reset-attention-mask): a document ends with the tokenizer's end-of-document token (EOS; preprocess --append_eod writes it)."""
    reset_positions: bool = False
    """Positions restart at 0 at each document's start (Megatron's --reset-position-ids): RoPE angles and GPT-2's learned positions. With document_mask on, RoPE sees only distances within a document, so this changes only GPT-2."""
    eod_mask_loss: bool = False
    """No loss on the token after an end-of-document token (Megatron's --eod-mask-loss): the next document's first token is not predicted from the last one's end. The loss is the mean over the global batch's remaining targets."""
    mean_doc_len: int = 0
    """For meshtrain plan with document_mask on: the mean document length in tokens, which sets the step's attention FLOPs and the eager attention's mask memory; 0: documents as long as train.seq_len. Training finds the documents in the data and ignores this."""

    def check(self) -> "DataConfig":
        """Raise ConfigError naming the data.* key and the fix for a value that cannot work."""
        # The shape of data.paths only; files and tokens are checked when the data is opened.
        try:
            parse_paths(self.paths)
        except DataError as e:
            raise ConfigError(str(e)) from None
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ConfigError(f"data.tokenizer={self.tokenizer!r}: give bytes or the path of a tokenizer.json")
        check_float(self.valid_fraction, "data.valid_fraction", minimum=0.0)
        if self.valid_fraction >= 1:
            raise ConfigError(f"data.valid_fraction={self.valid_fraction} leaves no training data: choose a value "
                              "below 1 (e.g. 0.01)")
        for key in ("document_mask", "reset_positions", "eod_mask_loss"):
            check_bool(getattr(self, key), f"data.{key}")
        check_int(self.mean_doc_len, "data.mean_doc_len", 0, 2**31 - 1)
        return self


def parse_paths(paths) -> list[tuple[float | None, str]]:
    """data.paths as (weight or None, prefix) pairs, with a DataError for any other shape."""
    fix = "give builtin, a dataset prefix, a list of prefixes, or [[weight, prefix], ...]"
    if isinstance(paths, str):
        if not paths:
            raise DataError(f"data.paths is empty: {fix}")
        return [(None, paths)]
    if not isinstance(paths, (list, tuple)) or not paths:
        raise DataError(f"data.paths={paths!r}: {fix}")
    entries = []
    for i, entry in enumerate(paths):
        if isinstance(entry, str) and entry:
            entries.append((None, entry))
        elif isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], str) and entry[1]:
            weight, prefix = entry
            if (isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight)
                    or weight <= 0):
                raise DataError(f"data.paths[{i}]: the weight of {prefix!r} is {weight!r}; blend weights must be "
                                "positive numbers (they are normalised to sum to 1)")
            entries.append((weight, prefix))
        else:
            raise DataError(f"data.paths[{i}]={entry!r} is neither a prefix nor a [weight, prefix] pair: {fix}")
    if len({w is None for w, _ in entries}) > 1:
        raise DataError("data.paths mixes prefixes with and without weights: give [weight, prefix] pairs for all "
                        "of them, or plain prefixes (equal weights)")
    return entries
