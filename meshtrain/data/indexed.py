"""Megatron-LM indexed datasets: a prefix names two files, read and written byte for byte as
Megatron-LM (megatron/core/datasets/indexed_dataset.py) does, so datasets move both ways.

    <prefix>.bin   the tokens of every sequence, back to back, in the dataset's dtype
    <prefix>.idx   all little-endian:
        9 bytes   magic b"MMIDIDX\\x00\\x00"
        u64       version, 1
        u8        dtype code (DTYPES)
        u64       sequence count S
        u64       document-index count D: len(document_indices), i.e. documents + 1
        i32[S]    sequence lengths in tokens
        i64[S]    sequence pointers: byte offset of each sequence in .bin
        i64[D]    document indices: document j is sequences [doc[j], doc[j+1]); 0 first, S last

meshtrain writes one sequence per document; it reads any number of sequences per document.
`meshtrain preprocess` also writes <prefix>.tokenizer.json, the record of the tokenizer the
tokens came from (tokenizer.tokenizer_record), and with --loss_mask_key
<prefix>.loss_mask.bin, one uint8 per token of .bin (1: the token is a training target);
Megatron-LM neither writes nor reads them.
"""

from __future__ import annotations

import json
import os
import struct
from array import array

import numpy as np

from .errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
CODES = {np.dtype(t): code for code, t in DTYPES.items()}
_CHUNK = 1 << 22  # elements per step when scanning big arrays: bounded memory on any dataset


def bin_path(prefix) -> str:
    return f"{os.fspath(prefix)}.bin"


def idx_path(prefix) -> str:
    return f"{os.fspath(prefix)}.idx"


def record_path(prefix) -> str:
    return f"{os.fspath(prefix)}.tokenizer.json"


def loss_mask_path(prefix) -> str:
    return f"{os.fspath(prefix)}.loss_mask.bin"


def encode_index(dtype, sizes, document_indices) -> bytes:
    """The .idx bytes for sequences of `sizes` tokens stored contiguously in .bin."""
    dtype = np.dtype(dtype)
    if dtype.newbyteorder("=") not in CODES:
        raise ValueError(f"dtype {dtype} has no Megatron-LM code; use one of "
                         f"{sorted(str(np.dtype(t)) for t in DTYPES.values())}")
    sizes = np.asarray(sizes, dtype=np.int64)
    docs = np.asarray(document_indices, dtype=np.int64)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1] * dtype.itemsize, out=pointers[1:])
    head = HEADER.pack(MAGIC, VERSION, CODES[dtype.newbyteorder("=")], len(sizes), len(docs))
    return head + sizes.astype("<i4").tobytes() + pointers.astype("<i8").tobytes() + docs.astype("<i8").tobytes()


class IndexedWriter:
    """Writes <prefix>.bin and <prefix>.idx, one sequence per document.

    Everything goes to temporary names first; `finalize` renames them, .idx last (after
    removing an old one), so a crash or an error never leaves a .bin/.idx pair that looks
    valid and is not. With a tokenizer `record` it writes <prefix>.tokenizer.json the same
    way; without one it removes a record an earlier dataset at the prefix left. The same
    for the loss mask (`loss_mask`: every document comes with one). As a context manager it
    finalizes on success and cleans up on error.
    """

    def __init__(self, prefix, dtype, record: dict | None = None, loss_mask: bool = False):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"dtype {self.dtype} has no Megatron-LM code")
        self.bin_path, self.idx_path, self.record_path = bin_path(prefix), idx_path(prefix), record_path(prefix)
        self.mask_path = loss_mask_path(prefix)
        self.record = record
        tag = f".tmp-{os.getpid()}"  # two writers of one prefix do not share temporaries
        self._tmp_bin, self._tmp_idx, self._tmp_record, self._tmp_mask = (
            self.bin_path + tag, self.idx_path + tag, self.record_path + tag, self.mask_path + tag)
        self._sizes = array("q")
        self.tokens = 0
        self._done = False
        self._mask = None
        try:
            self._file = open(self._tmp_bin, "wb")
            if loss_mask:
                self._mask = open(self._tmp_mask, "wb")
        except OSError as e:
            raise DataError(f"{self.bin_path}: cannot write ({e.strerror}); check that the output directory "
                            "exists and is writable") from None

    @property
    def documents(self) -> int:
        return len(self._sizes)

    def add_document(self, tokens, loss_mask=None) -> None:
        """One document's tokens and, for a writer with loss masks, which of them are
        training targets (one bool per token)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"a document is a 1-D sequence of token ids, got shape {tokens.shape}")
        if (loss_mask is None) != (self._mask is None):
            raise ValueError("a writer opened with loss_mask=True takes one mask per document, and only then")
        if loss_mask is not None and np.shape(loss_mask) != tokens.shape:
            raise ValueError(f"a loss mask of shape {np.shape(loss_mask)} for {tokens.size} tokens")
        if tokens.size:
            info = np.iinfo(self.dtype)
            low, high = int(tokens.min()), int(tokens.max())
            if low < info.min or high > info.max:  # astype would wrap silently
                bad = high if high > info.max else low
                raise DataError(f"{self.bin_path}: token id {bad} does not fit the dataset dtype {self.dtype}; "
                                "the tokenizer's vocab_size is wrong or a larger dtype is needed")
        if tokens.size >= 2**31:
            raise DataError(f"{self.bin_path}: a document of {tokens.size} tokens is longer than the .idx format "
                            "allows (2**31 - 1); split it")
        self._file.write(tokens.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        if self._mask is not None:
            self._mask.write(np.asarray(loss_mask, dtype=bool).astype(np.uint8).tobytes())
        self._sizes.append(tokens.size)
        self.tokens += tokens.size

    def finalize(self) -> None:
        if self._done:
            return
        self._file.close()
        if self._mask is not None:
            self._mask.close()
        sizes = np.frombuffer(self._sizes, dtype=np.int64) if self._sizes else np.zeros(0, np.int64)
        with open(self._tmp_idx, "wb") as f:
            f.write(encode_index(self.dtype, sizes, np.arange(len(sizes) + 1)))
        if self.record is not None:
            with open(self._tmp_record, "w", encoding="utf-8") as f:
                json.dump(self.record, f, indent=2)
                f.write("\n")
        # Old .idx out first: between the renames the prefix has no .idx (an error that
        # says so), never a new .bin or record beside an old index.
        if os.path.exists(self.idx_path):
            os.remove(self.idx_path)
        os.replace(self._tmp_bin, self.bin_path)
        for tmp, path, written in ((self._tmp_record, self.record_path, self.record is not None),
                                   (self._tmp_mask, self.mask_path, self._mask is not None)):
            if written:
                os.replace(tmp, path)
            elif os.path.exists(path):  # an earlier dataset's at this prefix
                os.remove(path)
        os.replace(self._tmp_idx, self.idx_path)
        self._done = True

    def abort(self) -> None:
        """Drop what was written; files under the final names are left untouched."""
        self._file.close()
        if self._mask is not None:
            self._mask.close()
        for path in (self._tmp_bin, self._tmp_idx, self._tmp_record, self._tmp_mask):
            if os.path.exists(path):
                os.remove(path)
        self._done = True

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """A Megatron-LM indexed dataset, memory-mapped: `ds[i]` is sequence i as a read-only
    numpy array and `ds.get(i, offset, length)` a slice of it, touching only those bytes.

    The whole .idx is checked on open (magic, version, dtype, counts against the file
    sizes, pointers, document indices), so a bad or truncated file fails here, naming it,
    rather than as wrong tokens mid-run. `IndexedDataset.in_memory` builds the same
    interface from token arrays (the builtin corpus).
    """

    def __init__(self, prefix):
        self.prefix = self.name = os.fspath(prefix)
        self.bin_path, self.idx_path = bin_path(prefix), idx_path(prefix)
        _check_exists(self.prefix)
        idx_size, bin_size = os.path.getsize(self.idx_path), os.path.getsize(self.bin_path)
        with open(self.idx_path, "rb") as f:
            head = f.read(HEADER.size)
        if head[:len(MAGIC)] != MAGIC:
            raise DataError(f"{self.idx_path}: not a Megatron-LM index (starts with {head[:len(MAGIC)]!r}, expected "
                            f"{MAGIC!r}); give the prefix of a dataset written by meshtrain preprocess or Megatron-LM")
        if len(head) < HEADER.size:
            raise DataError(f"{self.idx_path}: truncated ({idx_size} bytes, the header alone is {HEADER.size}); "
                            "copy the file again or re-run meshtrain preprocess")
        _, version, code, n_seq, n_doc = HEADER.unpack(head)
        if version != VERSION:
            raise DataError(f"{self.idx_path}: index version {version} is not supported (only {VERSION}); "
                            "re-run meshtrain preprocess")
        if code not in DTYPES:
            raise DataError(f"{self.idx_path}: unknown dtype code {code} (known: {sorted(DTYPES)}); the file is "
                            "damaged or not a Megatron-LM index")
        self.dtype = np.dtype(DTYPES[code]).newbyteorder("<")
        expected = HEADER.size + 12 * n_seq + 8 * n_doc
        # Megatron's multimodal datasets add one int8 mode per sequence; those are ignored.
        if idx_size not in (expected, expected + n_seq):
            what = "truncated" if idx_size < expected else "longer than its header says"
            raise DataError(f"{self.idx_path}: {what}: {n_seq} sequences and {n_doc} document indices need "
                            f"{expected} bytes, the file has {idx_size}; copy it again or re-run meshtrain preprocess")
        index = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        self.sizes = np.frombuffer(index, dtype="<i4", count=n_seq, offset=HEADER.size)
        self.pointers = np.frombuffer(index, dtype="<i8", count=n_seq, offset=HEADER.size + 4 * n_seq)
        self.document_indices = np.frombuffer(index, dtype="<i8", count=n_doc, offset=HEADER.size + 12 * n_seq)
        self.num_tokens = self._check_index(bin_size)
        # The tokens as one flat array: sequence i is [pointer_i / itemsize, + size_i).
        flat = np.memmap(self.bin_path, dtype=np.uint8, mode="r") if bin_size else np.zeros(0, np.uint8)
        self._tokens = np.frombuffer(flat, dtype=self.dtype, count=self.num_tokens)
        self.loss_mask_path, self._loss_mask = None, None
        if os.path.isfile(loss_mask_path(prefix)):
            self.loss_mask_path = loss_mask_path(prefix)
            mask_size = os.path.getsize(self.loss_mask_path)
            if mask_size != self.num_tokens:
                raise DataError(f"{self.loss_mask_path}: {mask_size} bytes, but {self.idx_path} describes "
                                f"{self.num_tokens} tokens (one byte each); the loss mask does not belong to this "
                                "dataset: re-run meshtrain preprocess, or delete the file to train on every token")
            self._loss_mask = (np.memmap(self.loss_mask_path, dtype=np.uint8, mode="r") if mask_size
                               else np.zeros(0, np.uint8))

    @classmethod
    def in_memory(cls, documents, dtype, name: str) -> "IndexedDataset":
        """The dataset interface over token arrays held in memory, one sequence per document."""
        self = cls.__new__(cls)
        self.prefix = self.bin_path = self.idx_path = self.loss_mask_path = self._loss_mask = None
        self.name = name
        self.dtype = np.dtype(dtype)
        arrays = [np.asarray(d, dtype=self.dtype) for d in documents]
        self.sizes = np.array([len(a) for a in arrays], dtype=np.int32)
        self.pointers = np.concatenate([[0], np.cumsum(self.sizes[:-1], dtype=np.int64)]) * self.dtype.itemsize
        self.document_indices = np.arange(len(arrays) + 1, dtype=np.int64)
        self._tokens = np.concatenate(arrays) if arrays else np.zeros(0, self.dtype)
        self.num_tokens = len(self._tokens)
        return self

    def _check_index(self, bin_size: int) -> int:
        """Checks the index against itself and the .bin; returns the token count."""
        n_seq, docs, item = len(self.sizes), self.document_indices, self.dtype.itemsize
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != n_seq:
            first, last = (int(docs[0]), int(docs[-1])) if len(docs) else ("none", "none")
            raise DataError(f"{self.idx_path}: document indices must start at 0 and end at the sequence count "
                            f"{n_seq}, they run from {first} to {last}; the index is damaged, re-run meshtrain "
                            "preprocess")
        # Chunked: a billion-sequence index is checked in bounded memory.
        total = 0
        for lo in range(0, n_seq, _CHUNK):
            sizes = self.sizes[lo:lo + _CHUNK].astype(np.int64)
            if sizes.min() < 0:
                raise DataError(f"{self.idx_path}: negative sequence length at sequence {lo + int(sizes.argmin())}; "
                                "the index is damaged, re-run meshtrain preprocess")
            starts = (total + np.concatenate([[0], np.cumsum(sizes[:-1])])) * item
            wrong = np.flatnonzero(self.pointers[lo:lo + _CHUNK] != starts)
            if len(wrong):
                i = int(wrong[0])
                raise DataError(f"{self.idx_path}: sequence {lo + i} starts at byte {int(self.pointers[lo + i])} of "
                                f"the .bin, but the lengths before it put it at {int(starts[i])}; the index is "
                                "damaged, re-run meshtrain preprocess")
            total += int(sizes.sum())
        for lo in range(0, len(docs) - 1, _CHUNK):
            step = np.diff(docs[lo:lo + _CHUNK + 1])
            if len(step) and step.min() < 0:
                raise DataError(f"{self.idx_path}: document indices decrease at document {lo + int(step.argmin())}; "
                                "the index is damaged, re-run meshtrain preprocess")
        if bin_size != total * item:
            what = "truncated" if bin_size < total * item else "longer than the index says"
            raise DataError(f"{self.bin_path}: {what}: {self.idx_path} describes {total} tokens of {self.dtype.name} "
                            f"({total * item} bytes), the file has {bin_size} bytes; the .bin and .idx do not belong "
                            "together, copy them again or re-run meshtrain preprocess")
        return total

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (to its end when length is None)."""
        start, length = self._span(i, offset, length)
        return self._tokens[start:start + length]

    @property
    def has_loss_mask(self) -> bool:
        return self._loss_mask is not None

    def get_loss_mask(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """get's tokens' loss mask (True: a training target); all True without a mask file."""
        start, length = self._span(i, offset, length)
        if self._loss_mask is None:
            return np.ones(length, dtype=bool)
        return self._loss_mask[start:start + length].astype(bool)

    def _span(self, i: int, offset: int, length: int | None) -> tuple[int, int]:
        """(first token in the flat array, count) of get's slice."""
        n = len(self.sizes)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range: {self.name} has {n} sequences")
        i %= n
        size = int(self.sizes[i])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range: sequence {i} of {self.name} "
                             f"has {size}")
        return int(self.pointers[i]) // self.dtype.itemsize + offset, length

    def documents_end_with(self, token: int, checked: int = 256) -> bool:
        """Whether documents end with `token` (preprocess --append-eod), judged on up to
        `checked` documents spread over the dataset: one token read each, and a dataset
        written without it has (nearly) no document that does."""
        ends = self.document_indices[1:]
        nonempty = ends[self.sizes[ends - 1] > 0] if len(ends) else ends
        picked = nonempty[np.linspace(0, len(nonempty) - 1, min(checked, len(nonempty))).astype(np.int64)]
        last = [self._tokens[int(self.pointers[s - 1]) // self.dtype.itemsize + int(self.sizes[s - 1]) - 1]
                for s in picked]
        return all(int(t) == token for t in last)

    def token_range(self) -> tuple[int, int] | None:
        """(smallest, largest) token id, scanning the tokens in chunks; None when empty."""
        if self.num_tokens == 0:
            return None
        low, high = None, None
        for lo in range(0, self.num_tokens, _CHUNK * 4):
            part = self._tokens[lo:lo + _CHUNK * 4]
            a, b = part.min(), part.max()
            low = a if low is None else min(low, a)
            high = b if high is None else max(high, b)
        return low.item(), high.item()

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.name!r}: {len(self)} sequences, {self.num_documents} documents, "
                f"{self.num_tokens} tokens of {self.dtype.name})")


def _check_exists(prefix: str) -> None:
    idx, bin_ = idx_path(prefix), bin_path(prefix)
    if os.path.isfile(idx) and os.path.isfile(bin_):
        return
    missing = " and ".join(p for p in (idx, bin_) if not os.path.isfile(p))
    hint = "a dataset prefix names <prefix>.bin and <prefix>.idx"
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            hint = (f"the prefix is given without extension: use {prefix[:-len(ext)]!r} "
                    f"for {prefix[:-len(ext)]}.bin and {prefix[:-len(ext)]}.idx")
    raise DataError(f"dataset {prefix!r}: {missing} not found ({hint}); check the path or run meshtrain preprocess")
