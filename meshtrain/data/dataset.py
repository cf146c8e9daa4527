"""Training samples from token datasets: packing, shuffling, train/validation splits
(blending is blend.py's; `build_data`, the trainer's entry point, build.py's).

Every sample is a pure function of its global index (and the seed): the only data state
a checkpoint needs is the number of samples consumed, and a run resumed under another
data-parallel size reads the same samples.

    global index i --blend--> (dataset d, d's own draw k) --shuffle--> sample s of d
                   --pack---> tokens [s * seq_len, s * seq_len + seq_len + 1) of d's stream
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from .blend import BlendSchedule
from .errors import DataError


class PackedDataset:
    """Documents [doc_start, doc_end) of a dataset, concatenated in document order and cut
    into samples of seq_len + 1 tokens; consecutive samples share one token (sample k is
    tokens [k * seq_len, k * seq_len + seq_len + 1)), so no token falls between samples.

    This is Megatron-LM's GPT packing without its document shuffle: documents stay in file
    order and the sample order is shuffled instead (EpochShuffle). Random access finds the
    first sequence with a binary search over cumulative lengths and reads only the tokens
    the sample needs.
    """

    def __init__(self, source, seq_len: int, doc_start: int = 0, doc_end: int | None = None,
                 name: str | None = None, fix: str = "lower train.seq_len or add data"):
        docs = source.document_indices
        doc_end = len(docs) - 1 if doc_end is None else doc_end
        if not 0 <= doc_start <= doc_end <= len(docs) - 1:
            raise IndexError(f"documents [{doc_start}, {doc_end}) out of range: {source.name} has {len(docs) - 1}")
        self.source, self.seq_len = source, seq_len
        self.name = name or f"{source.name} documents [{doc_start}, {doc_end})"
        self.seq_start, seq_end = int(docs[doc_start]), int(docs[doc_end])
        self._ends = np.cumsum(np.asarray(source.sizes[self.seq_start:seq_end], dtype=np.int64))
        self.num_tokens = int(self._ends[-1]) if len(self._ends) else 0
        if self.num_tokens < seq_len + 1:
            raise DataError(f"{self.name}: {self.num_tokens} tokens, fewer than one sample needs (seq_len + 1 = "
                            f"{seq_len + 1}); {fix}")

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def __getitem__(self, k: int) -> np.ndarray:
        return self._read(k, self.source.get, np.int64)

    @property
    def has_loss_mask(self) -> bool:
        return self.source.has_loss_mask

    def loss_mask(self, k: int) -> np.ndarray:
        """Sample k's loss mask (True: the token is a training target), all True when the
        dataset has none."""
        return self._read(k, self.source.get_loss_mask, bool)

    def _read(self, k: int, get, dtype) -> np.ndarray:
        n = len(self)
        if not 0 <= k < n:
            raise IndexError(f"sample {k} out of range: {self.name} has {n}")
        start, need = k * self.seq_len, self.seq_len + 1
        out = np.empty(need, dtype=dtype)
        i = int(np.searchsorted(self._ends, start, side="right"))  # the sequence holding token `start`
        pos, filled = start, 0
        while filled < need:
            begin = int(self._ends[i - 1]) if i else 0
            take = min(int(self._ends[i]) - pos, need - filled)
            out[filled:filled + take] = get(self.seq_start + i, pos - begin, take)
            filled, pos, i = filled + take, pos + take, i + 1
        return out

    vocab_limit: int | None = None  # set when token ids are checked as they are read

    def samples(self, indices, loss_mask: bool = False) -> np.ndarray:
        """(len(indices), seq_len + 1) int64 array of the given samples (with loss_mask:
        their bool loss masks instead)."""
        if loss_mask:
            out = np.empty((len(indices), self.seq_len + 1), dtype=bool)
            for row, k in enumerate(indices):
                out[row] = self.loss_mask(int(k))
            return out
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, k in enumerate(indices):
            out[row] = self[int(k)]
        if self.vocab_limit is not None and out.size and out.max() >= self.vocab_limit:
            where = getattr(self.source, "bin_path", None) or self.name
            raise DataError(f"{where}: token id {int(out.max())} >= model.vocab_size={self.vocab_limit}; raise "
                            "model.vocab_size, or re-tokenize the data (meshtrain preprocess) with the model's "
                            "tokenizer")
        return out


def stream_seed(*parts) -> int:
    """A 64-bit seed from a tuple of ints: different tuples give unrelated streams."""
    text = "/".join(str(int(p)) for p in parts)
    return int.from_bytes(hashlib.blake2b(f"meshtrain.data/{text}".encode(), digest_size=8).digest(), "little")


class EpochShuffle:
    """Global index i -> sample: epoch i // n, position i % n of a permutation of range(n)
    drawn from a numpy Generator seeded by (seed, stream, epoch). Stateless (the permutation
    of the current epoch is cached), so any index is served without replaying the others."""

    def __init__(self, n: int, seed: int, stream: int = 0):
        if n < 1:
            raise ValueError("nothing to shuffle: n must be at least 1")
        self.n, self.seed, self.stream = n, seed, stream
        self._cache: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) >= 2:  # the current epoch and the one a batch may straddle into
                self._cache.pop(min(self._cache))
            rng = np.random.default_rng(stream_seed(self.seed, self.stream, epoch))
            perm = np.arange(self.n, dtype=np.int32 if self.n < 2**31 else np.int64)
            rng.shuffle(perm)
            self._cache[epoch] = perm
        return self._cache[epoch]

    def __call__(self, indices) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        epochs, positions = np.divmod(indices, self.n)
        out = np.empty_like(indices)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self.permutation(int(epoch))[positions[mask]]
        return out


class TrainSplit:
    """The training stream: global samples 0, 1, 2, ... forever, blended across datasets,
    each dataset's samples shuffled anew every epoch of that dataset."""

    def __init__(self, parts: list[PackedDataset], weights: list[float], seed: int):
        self.parts, self.seq_len = parts, parts[0].seq_len
        self.blend = BlendSchedule(weights) if len(parts) > 1 else None
        self.shuffles = [EpochShuffle(len(p), seed, stream=d) for d, p in enumerate(parts)]
        self.num_samples = sum(len(p) for p in parts)  # one epoch: every sample of every dataset once

    def batch(self, start: int, count: int) -> torch.Tensor:
        """Global samples start..start+count-1 as a (count, seq_len + 1) LongTensor."""
        return _gather(self.parts, self._locate(start, count), False)

    def loss_mask(self, start: int, count: int) -> torch.Tensor | None:
        """The same samples' loss masks, a (count, seq_len + 1) BoolTensor (all True for a
        dataset without one); None when no dataset has one."""
        return _gather(self.parts, self._locate(start, count), True) if _masked(self.parts) else None

    def _locate(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, sample within it) of each global sample."""
        _check_range(start, count)
        if self.blend is None:
            datasets, draws = np.zeros(count, dtype=np.int64), np.arange(start, start + count, dtype=np.int64)
        else:
            datasets, draws = self.blend.assign(start, count)
        samples = np.empty(count, dtype=np.int64)
        for d in np.unique(datasets):
            rows = datasets == d
            samples[rows] = self.shuffles[d](draws[rows])
        return datasets, samples


class ValidSplit:
    """The validation samples: every dataset's held-out samples in order, dataset after
    dataset; global index i reads sample i mod num_samples, unshuffled."""

    def __init__(self, parts: list[PackedDataset]):
        self.parts, self.seq_len = parts, parts[0].seq_len
        self._starts = np.cumsum([0] + [len(p) for p in parts])
        self.num_samples = int(self._starts[-1])

    def batch(self, start: int, count: int) -> torch.Tensor:
        return _gather(self.parts, self._locate(start, count), False)

    def loss_mask(self, start: int, count: int) -> torch.Tensor | None:
        return _gather(self.parts, self._locate(start, count), True) if _masked(self.parts) else None

    def _locate(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        _check_range(start, count)
        index = (start + np.arange(count, dtype=np.int64)) % self.num_samples
        datasets = np.searchsorted(self._starts, index, side="right") - 1
        return datasets, index - self._starts[datasets]


def _masked(parts: list[PackedDataset]) -> bool:
    return any(p.has_loss_mask for p in parts)


def _gather(parts: list[PackedDataset], located: tuple[np.ndarray, np.ndarray], loss_mask: bool) -> torch.Tensor:
    """The located samples' tokens (or loss masks), row by row, read per dataset."""
    datasets, samples = located
    out = np.empty((len(datasets), parts[0].seq_len + 1), dtype=bool if loss_mask else np.int64)
    for d in np.unique(datasets):
        rows = datasets == d
        out[rows] = parts[d].samples(samples[rows], loss_mask)
    return torch.from_numpy(out)


def _check_range(start: int, count: int) -> None:
    if start < 0 or count < 0:
        raise ValueError(f"samples [{start}, {start + count}): start and count must be non-negative")


@dataclass
class TokenData:
    """What the trainer reads: `train.batch(start, count)` and (when valid_fraction > 0)
    `valid.batch(start, count)`, each (count, seq_len + 1) LongTensors; inputs are
    [:, :-1], targets [:, 1:]. `notes`: one-line remarks for the user (data that opened
    but was not fully checked)."""

    train: TrainSplit
    valid: ValidSplit | None
    seq_len: int
    names: list[str]
    weights: list[float]
    notes: list[str] = field(default_factory=list)
    eod: int | None = None  # the tokenizer's end-of-document (EOS) id, which ends each document
    tokenizer: dict | None = None  # data.tokenizer's record (tokenizer.tokenizer_record): what a checkpoint keeps

    @property
    def loss_mask(self) -> bool:
        """Whether some dataset has a loss mask (meshtrain preprocess --loss_mask_key): the
        targets it masks are ignored, as eod_mask_loss's are."""
        return _masked(self.train.parts)

    def describe(self) -> str:
        blend = ", ".join(f"{w:.3g} {n}" for w, n in zip(self.weights, self.names))
        valid = f"{self.valid.num_samples:,} validation samples" if self.valid else "no validation split"
        return f"{blend}: {self.train.num_samples:,} training samples of {self.seq_len + 1} tokens, {valid}"


__all__ = ["EpochShuffle", "PackedDataset", "TokenData", "TrainSplit", "ValidSplit", "stream_seed"]

