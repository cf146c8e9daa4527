"""Training samples from token datasets: packing, shuffling, blending, train/validation splits.

`build_data` is the trainer's entry point. Every sample is a pure function of its global
index (and the seed): the only data state a checkpoint needs is the number of samples
consumed, and a run resumed under another data-parallel size reads the same samples.

    global index i --blend--> (dataset d, d's own draw k) --shuffle--> sample s of d
                   --pack---> tokens [s * seq_len, s * seq_len + seq_len + 1) of d's stream
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch

from .builtin import builtin_dataset
from .errors import DataError
from .indexed import IndexedDataset, record_path
from .tokenizer import ByteTokenizer, describe_record, load_tokenizer, same_tokenizer, tokenizer_record

# --- packing ---------------------------------------------------------------------------


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
        n = len(self)
        if not 0 <= k < n:
            raise IndexError(f"sample {k} out of range: {self.name} has {n}")
        start, need = k * self.seq_len, self.seq_len + 1
        out = np.empty(need, dtype=np.int64)
        i = int(np.searchsorted(self._ends, start, side="right"))  # the sequence holding token `start`
        pos, filled = start, 0
        while filled < need:
            begin = int(self._ends[i - 1]) if i else 0
            take = min(int(self._ends[i]) - pos, need - filled)
            out[filled:filled + take] = self.source.get(self.seq_start + i, pos - begin, take)
            filled, pos, i = filled + take, pos + take, i + 1
        return out

    vocab_limit: int | None = None  # set when token ids are checked as they are read

    def samples(self, indices) -> np.ndarray:
        """(len(indices), seq_len + 1) int64 array of the given samples."""
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, k in enumerate(indices):
            out[row] = self[int(k)]
        if self.vocab_limit is not None and out.size and out.max() >= self.vocab_limit:
            where = getattr(self.source, "bin_path", None) or self.name
            raise DataError(f"{where}: token id {int(out.max())} >= model.vocab_size={self.vocab_limit}; raise "
                            "model.vocab_size, or re-tokenize the data (meshtrain preprocess) with the model's "
                            "tokenizer")
        return out


# --- shuffling -------------------------------------------------------------------------


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


# --- blending --------------------------------------------------------------------------

_MAX_WEIGHT_TOTAL = 2**30  # integer weights up to this total keep the arithmetic in int64
_MAX_WEIGHT_RATIO = 10**6  # random access costs time and memory in proportion to this
_WALK_LIMIT = 512  # reach a start this far past the last one by drawing, not recomputing


class BlendSchedule:
    """Global sample i -> (dataset d, d's own draw count k), with every dataset's share
    within one sample of its weight at every prefix: after n draws dataset d has drawn
    c_d(n) times and |c_d(n) - w_d * n| < 1.

    The rule is the quota method, earliest deadline first: d's draw k may not come before
    slot floor(k / w_d) (d would be a sample or more ahead) and must come before slot
    (k + 1) / w_d (d would be a sample or more behind). Each slot draws, among the datasets
    whose next draw is allowed, the one whose deadline is earliest (ties: lower index). A
    schedule meeting every such window exists for any weights (Tijdeman, "The chairman
    assignment problem", 1980) and EDF finds one. Megatron-LM's greedy rule (the d
    maximising w_d * (i + 1) - c_d) is not used: with five or more datasets it can fall
    more than one sample behind.

    Random access: `counts_at(n)` gives the counts after n draws directly, then the
    requested slots are drawn one by one (cheap: a batch). The direct form holds because
    EDF's first n draws are the greedy basis of a matroid: every draw below the lower quota
    floor(w_d * n) is made, and the n - sum(floor(w_d * n)) extra draws are the next draws
    of some datasets, chosen in deadline order and kept when the first n slots can still
    hold every kept draw at or after its release slot (Hall's condition, checked slot by
    slot over the window where it can fail).

    Weights are exact fractions (decimal floats as written: 0.3 is 3/10).
    """

    def __init__(self, weights):
        self.a, self.total = _integer_weights(weights)
        self.weights = [x / self.total for x in self.a]
        self._cursor = (0, [0] * len(self.a))  # (n, counts after n draws) of the last call

    def __len__(self) -> int:
        return len(self.a)

    def counts_at(self, n: int) -> list[int]:
        """How many times each dataset has drawn among global samples [0, n)."""
        a, total = self.a, self.total
        floor = [x * n // total for x in a]
        extra = n - sum(floor)
        if extra == 0:
            return floor
        # Datasets a fraction of a sample behind their share; their next draw k = floor
        # was released at slot k * total // a and is due at slot (k + 1) / w.
        cand = [d for d in range(len(a)) if a[d] * n % total]
        release = {d: floor[d] * total // a[d] for d in cand}
        cand.sort(key=lambda d: (Fraction(floor[d] + 1, a[d]), d))
        # Hall's condition can only fail for slots t in (lo, n]: below lo every extra draw
        # counts against t, and the slack there is at least the number of extra draws.
        cuts = sorted(set(release.values()))
        slack = self._segment_slack(n, floor, cuts)
        counts, used = list(floor), [0] * len(slack)
        for d in cand:
            last = cuts.index(release[d])  # segments 0..last-1 lie at or before d's release slot
            if all(slack[j] - used[j] >= 1 for j in range(last)):
                for j in range(last):
                    used[j] += 1
                counts[d] += 1
                extra -= 1
                if extra == 0:
                    return counts
        raise AssertionError(f"blend schedule: no feasible counts at n={n} for weights {self.a}")  # cannot happen

    def _segment_slack(self, n: int, floor: list[int], cuts: list[int]) -> list[int]:
        """For each segment (cuts[j], cuts[j+1]]: the least, over its slots t, of the slots
        [t, n) left after the lower-quota draws released at t or later."""
        a, total = self.a, self.total
        dtype = np.int64 if max(a) * n < 2**62 else object  # exact either way
        out = []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            best = None
            for start in range(lo + 1, hi + 1, 1 << 20):  # bounded memory on long segments
                t = np.arange(start, min(hi, start + (1 << 20) - 1) + 1).astype(dtype)
                slack = n - t
                for d, f in enumerate(floor):
                    if f:
                        released_before = -((-a[d] * t) // total)  # ceil(w_d * t): d's draws released before t
                        slack = slack - np.maximum(f - released_before, 0)
                low = int(slack.min())
                best = low if best is None else min(best, low)
            out.append(best)
        return out

    def assign(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(datasets, draws): for global samples start..start+count-1 the dataset and that
        dataset's own draw index."""
        n, counts = self._cursor
        if not n <= start <= n + _WALK_LIMIT:
            n, counts = start, self.counts_at(start)
        counts = list(counts)
        if start > n:
            self._draw(n, counts, start - n)
        datasets, draws = self._draw(start, counts, count)
        self._cursor = (start + count, counts)
        return datasets, draws

    def _draw(self, n: int, counts: list[int], count: int) -> tuple[np.ndarray, np.ndarray]:
        """EDF for slots n..n+count-1 from `counts` (updated in place)."""
        a, total, K = self.a, self.total, len(self.a)
        release = [counts[d] * total // a[d] for d in range(K)]  # slot of each dataset's next draw
        datasets, draws = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
        for j in range(count):
            slot, best, due_num, due_den = n + j, -1, 0, 1
            for d in range(K):
                # deadline of d's next draw is (counts[d] + 1) / a[d], in units of total slots
                if release[d] <= slot and (best < 0 or (counts[d] + 1) * due_den < due_num * a[d]):
                    best, due_num, due_den = d, counts[d] + 1, a[d]
            datasets[j], draws[j] = best, counts[best]
            counts[best] += 1
            release[best] = counts[best] * total // a[best]
        return datasets, draws


def _integer_weights(weights) -> tuple[list[int], int]:
    """Positive weights as coprime integers and their total."""
    exact = [Fraction(w) if isinstance(w, int) else Fraction(repr(float(w))) for w in weights]
    den = math.lcm(*(f.denominator for f in exact))
    ints = [int(f * den) for f in exact]
    g = math.gcd(*ints)
    a = [x // g for x in ints]
    if sum(a) > _MAX_WEIGHT_TOTAL:  # more digits than any blend needs: round to 2**-30
        a = [round(x * _MAX_WEIGHT_TOTAL / sum(a)) for x in a]
    if min(a) == 0 or max(a) > _MAX_WEIGHT_RATIO * min(a):
        raise DataError(f"blend weights {list(weights)}: the smallest is less than 1e-6 of the largest; drop the "
                        "dataset with the tiny weight or raise its weight")
    return a, sum(a)


# --- splits and the trainer's interface ------------------------------------------------


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
        _check_range(start, count)
        if self.blend is None:
            datasets, draws = np.zeros(count, dtype=np.int64), np.arange(start, start + count, dtype=np.int64)
        else:
            datasets, draws = self.blend.assign(start, count)
        out = np.empty((count, self.seq_len + 1), dtype=np.int64)
        for d in np.unique(datasets):
            rows = datasets == d
            out[rows] = self.parts[d].samples(self.shuffles[d](draws[rows]))
        return torch.from_numpy(out)


class ValidSplit:
    """The validation samples: every dataset's held-out samples in order, dataset after
    dataset; global index i reads sample i mod num_samples, unshuffled."""

    def __init__(self, parts: list[PackedDataset]):
        self.parts, self.seq_len = parts, parts[0].seq_len
        self._starts = np.cumsum([0] + [len(p) for p in parts])
        self.num_samples = int(self._starts[-1])

    def batch(self, start: int, count: int) -> torch.Tensor:
        _check_range(start, count)
        index = (start + np.arange(count, dtype=np.int64)) % self.num_samples
        datasets = np.searchsorted(self._starts, index, side="right") - 1
        out = np.empty((count, self.seq_len + 1), dtype=np.int64)
        for d in np.unique(datasets):
            rows = datasets == d
            out[rows] = self.parts[d].samples(index[rows] - self._starts[d])
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

    def describe(self) -> str:
        blend = ", ".join(f"{w:.3g} {n}" for w, n in zip(self.weights, self.names))
        valid = f"{self.valid.num_samples:,} validation samples" if self.valid else "no validation split"
        return f"{blend}: {self.train.num_samples:,} training samples of {self.seq_len + 1} tokens, {valid}"


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
                     notes)


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


__all__ = ["BlendSchedule", "EpochShuffle", "PackedDataset", "TokenData", "TrainSplit",
           "ValidSplit", "build_data", "parse_paths", "stream_seed"]
