"""meshtrain.data: Megatron-LM file compatibility, preprocess, packing, shuffling, blending,
splits, and the errors bad data raises. Every expected byte layout here is built with
struct from the format description, independently of meshtrain.data.indexed."""

import json
import os
import struct

import numpy as np
import pytest
import torch

from meshtrain.data import (BlendSchedule, ByteTokenizer, DataError, EpochShuffle, IndexedDataset, IndexedWriter,
                            PackedDataset, build_data, load_tokenizer, preprocess)

MAGIC = b"MMIDIDX\x00\x00"
TEXTS = ["Hello, world.", "naïve café — 日本語 🙂", "", "line with \"quotes\" and \\ backslash\nnewline"]


def megatron_idx(code: int, sizes, doc_indices, itemsize: int) -> bytes:
    pointers, at = [], 0
    for s in sizes:
        pointers.append(at)
        at += s * itemsize
    return (MAGIC + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<Q", len(sizes))
            + struct.pack("<Q", len(doc_indices)) + struct.pack(f"<{len(sizes)}i", *sizes)
            + struct.pack(f"<{len(sizes)}q", *pointers) + struct.pack(f"<{len(doc_indices)}q", *doc_indices))


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({key: t, "id": i}, ensure_ascii=i % 2 == 0) + "\n")
            if i == 1:
                f.write("   \n")  # blank lines are skipped
    return path


def write_dataset(prefix, docs, dtype=np.uint16):
    with IndexedWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


def assert_data_error(excinfo, *names):
    msg = str(excinfo.value)
    assert "\n" not in msg
    for name in names:
        assert str(name) in msg, (name, msg)
    return msg


# --- file format -------------------------------------------------------------------------------

def test_preprocess_writes_megatron_layout_byte_for_byte(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    stats = preprocess(src, tmp_path / "out", tokenizer="bytes", append_eod=True)
    docs = [[256, *t.encode("utf-8"), 257] for t in TEXTS]
    sizes = [len(d) for d in docs]
    assert (tmp_path / "out.idx").read_bytes() == megatron_idx(8, sizes, list(range(len(docs) + 1)), 2)
    assert (tmp_path / "out.bin").read_bytes() == struct.pack(f"<{sum(sizes)}H", *[t for d in docs for t in d])
    assert stats["documents"] == 4 and stats["tokens"] == sum(sizes) and stats["dtype"] == "uint16"
    ds = IndexedDataset(tmp_path / "out")
    assert ByteTokenizer().decode(ds[1]) == TEXTS[1] and ds.num_documents == 4


def test_reads_megatron_files_with_several_sequences_per_document(tmp_path):
    seqs = [[5, 6, 7], [70000, -1], [1, 2, 3, 4], [9]]  # document 1 holds sequences 1 and 2
    sizes = [len(s) for s in seqs]
    (tmp_path / "m.idx").write_bytes(megatron_idx(4, sizes, [0, 1, 3, 4], 4))
    (tmp_path / "m.bin").write_bytes(struct.pack(f"<{sum(sizes)}i", *[t for s in seqs for t in s]))
    ds = IndexedDataset(tmp_path / "m")
    assert len(ds) == 4 and ds.num_documents == 3 and ds.dtype == np.int32 and ds.num_tokens == 10
    assert ds.document_indices.tolist() == [0, 1, 3, 4] and ds.sizes.tolist() == sizes
    assert ds.pointers.tolist() == [0, 12, 20, 36]
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
    assert ds.get(2, 1, 2).tolist() == [2, 3] and ds.get(2, 3).tolist() == [4] and ds[-1].tolist() == [9]
    packed = PackedDataset(ds, 2, doc_start=1, doc_end=3)  # documents 1-2: sequences 1, 2, 3
    assert packed.num_tokens == 7 and len(packed) == 3
    assert [packed[k].tolist() for k in range(3)] == [[70000, -1, 1], [1, 2, 3], [3, 4, 9]]
    with pytest.raises(IndexError):
        ds.get(0, 2, 2)


def test_writer_round_trip_and_replaces_atomically(tmp_path):
    prefix = write_dataset(tmp_path / "w", [[1, 2], [], [3]], np.uint8)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(3)] == [[1, 2], [], [3]] and ds.dtype == np.uint8
    assert (tmp_path / "w.idx").read_bytes() == megatron_idx(1, [2, 0, 1], [0, 1, 2, 3], 1)
    assert sorted(os.listdir(tmp_path)) == ["w.bin", "w.idx"]  # no temporaries left
    with pytest.raises(DataError) as e:
        write_dataset(tmp_path / "w", [[1], [300]], np.uint8)  # 300 does not fit: nothing replaced
    assert_data_error(e, "w.bin", "300")
    assert [IndexedDataset(prefix)[i].tolist() for i in range(3)] == [[1, 2], [], [3]]
    assert sorted(os.listdir(tmp_path)) == ["w.bin", "w.idx"]


class BigVocab:
    """A tokenizer with ids beyond uint16 (module level: worker processes unpickle it)."""

    name, vocab_size, bos_id, eos_id = "big", 70_000, None, 69_999

    def encode(self, text):
        return [65_536 + len(text), *text.encode("utf-8")]


def test_workers_give_identical_files_and_int32_for_large_vocabularies(tmp_path):
    texts = [f"document {i}: " + "é" * (i % 7) for i in range(700)]  # several chunks per worker
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    preprocess(src, tmp_path / "one", append_eod=True, workers=1)
    preprocess(src, tmp_path / "two", append_eod=True, workers=2)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"two{ext}").read_bytes()
    stats = preprocess(src, tmp_path / "big", tokenizer=BigVocab(), append_eod=True, workers=2)
    assert stats["dtype"] == "int32" and (tmp_path / "big.idx").read_bytes()[17] == 4  # dtype code
    ds = IndexedDataset(tmp_path / "big")
    assert ds.dtype == np.int32 and ds[3].tolist() == [65_536 + len(texts[3]), *texts[3].encode(), 69_999]


def test_hugging_face_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the cat sat on the mat", "naïve café", "the dog ran"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))

    hf = load_tokenizer(str(tmp_path))  # a directory holding tokenizer.json
    assert (hf.bos_id, hf.eos_id, hf.vocab_size) == (1, 2, tok.get_vocab_size(with_added_tokens=True))
    texts = ["the cat sat", "naïve dog"]
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    stats = preprocess(src, tmp_path / "hf", tokenizer=str(tmp_path / "tokenizer.json"), append_eod=True)
    ds = IndexedDataset(tmp_path / "hf")
    assert stats["dtype"] == "uint16" and ds.num_documents == 2
    for i, text in enumerate(texts):
        assert ds[i].tolist() == tok.encode(text).ids + [2] and ds[i][0] == 1  # the file's own BOS
        assert hf.decode(ds[i]) == text
    with pytest.raises(DataError) as e:
        build_data(str(tmp_path / "hf"), str(tmp_path / "tokenizer.json"), 4, 0, 256, 0.0)
    assert_data_error(e, "tokenizer.json", "model.vocab_size=256")


def test_tokenizer_specs(tmp_path, monkeypatch):
    tok = load_tokenizer("bytes")
    assert tok.encode("é") == [256, 0xC3, 0xA9] and tok.decode([256, 104, 105, 257]) == "hi"
    assert tok.vocab_size == 258 and tok.eos_id == 257
    with pytest.raises(DataError) as e:
        load_tokenizer("no/such/tokenizer.json")
    assert_data_error(e, "no/such/tokenizer.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError) as e:  # unreadable, or the library is missing: either way the file is named
        load_tokenizer(str(tmp_path))
    assert_data_error(e, str(tmp_path / "tokenizer.json"))
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)  # as if not installed
    with pytest.raises(DataError) as e:
        load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert_data_error(e, "tokenizer.json", "pip install tokenizers")


# --- packing, shuffling, blending, splits ------------------------------------------------------

def test_packing_cuts_the_concatenated_stream_with_one_token_overlap(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, n) for n in (5, 1, 0, 17, 3, 9)]
    ds = IndexedDataset(write_dataset(tmp_path / "p", docs))
    stream = np.concatenate(docs)
    for seq_len in (1, 4, 7, 33):
        packed = PackedDataset(ds, seq_len)
        assert len(packed) == (len(stream) - 1) // seq_len
        for k in range(len(packed)):
            assert packed[k].tolist() == stream[k * seq_len: k * seq_len + seq_len + 1].tolist()
    assert PackedDataset(ds, 4, 3, 5)[0].tolist() == np.concatenate(docs[3:5])[:5].tolist()
    with pytest.raises(IndexError):
        PackedDataset(ds, 4)[len(PackedDataset(ds, 4))]


def test_shuffle_is_a_seeded_permutation_per_epoch():
    n = 97
    order = EpochShuffle(n, seed=3)
    first = order(np.arange(3 * n))
    for e in range(3):
        assert sorted(first[e * n:(e + 1) * n].tolist()) == list(range(n))  # every sample once per epoch
    assert not np.array_equal(first[:n], first[n:2 * n])  # a new order each epoch
    assert np.array_equal(EpochShuffle(n, seed=3)(np.arange(3 * n)[::-1]), first[::-1])  # any access order
    assert not np.array_equal(EpochShuffle(n, seed=4)(np.arange(n)), first[:n])
    assert not np.array_equal(EpochShuffle(n, seed=3, stream=1)(np.arange(n)), first[:n])


def greedy_max_error(weights, n):
    """Megatron-LM's blending rule, for comparison: pick argmax w * (i + 1) - count."""
    w = np.asarray(weights, dtype=float) / sum(weights)
    counts, worst = np.zeros(len(w)), 0.0
    for i in range(n):
        counts[np.argmax(w * (i + 1) - counts)] += 1
        worst = max(worst, np.abs(counts - w * (i + 1)).max())
    return worst


BLENDS = [[0.7, 0.3], [1, 1, 1], [0.5, 0.3, 0.2], [9, 9, 6, 1, 1, 1],
          [0.003, 0.386, 0.012, 0.001, 0.164, 0.003, 0.001, 0.43], [1e-3, 1]]


@pytest.mark.parametrize("weights", BLENDS)
def test_blend_shares_stay_within_one_sample_of_the_weights(weights):
    n = 6000
    sched = BlendSchedule(weights)
    datasets, draws = sched.assign(0, n)
    onehot = np.zeros((n, len(weights)), dtype=np.int64)
    onehot[np.arange(n), datasets] = 1
    counts = np.cumsum(onehot, axis=0)
    w = np.asarray(weights, dtype=float) / sum(weights)
    assert np.abs(counts - w * np.arange(1, n + 1)[:, None]).max() < 1  # at every prefix
    assert np.array_equal(draws, counts[np.arange(n), datasets] - 1)  # each dataset's own draws 0, 1, 2, ...
    for start in (0, 1, 17, 999, 4321, 5999):  # random access agrees with drawing from 0
        fresh = BlendSchedule(weights)
        assert fresh.counts_at(start + 1) == counts[start].tolist()
        got_d, got_k = fresh.assign(start, min(500, n - start))
        assert np.array_equal(got_d, datasets[start:start + 500]) and np.array_equal(got_k, draws[start:start + 500])


def test_megatron_greedy_rule_would_fail_the_share_test():
    assert greedy_max_error(BLENDS[4], 1500) > 1


def test_blend_random_access_far_out_is_fast_and_consistent():
    sched = BlendSchedule([0.45, 0.25, 0.1, 0.1, 0.05, 0.03, 0.02])
    start = 10**7 + 12_345
    d1, k1 = sched.assign(start, 1000)
    d2, k2 = BlendSchedule(sched.weights).assign(start + 500, 500)
    assert np.array_equal(d1[500:], d2) and np.array_equal(k1[500:], k2)
    counts = sched.counts_at(start)
    assert all(abs(c - w * start) < 1 for c, w in zip(counts, sched.weights))


def tagged_dataset(path, n_docs, doc_len, base):
    """Document j is doc_len copies of base + j: every token says where it came from."""
    return write_dataset(path, [np.full(doc_len, base + j) for j in range(n_docs)])


def test_training_batches_are_deterministic_and_reshardable(tmp_path):
    a = tagged_dataset(tmp_path / "a", 30, 11, 0)
    b = tagged_dataset(tmp_path / "b", 20, 7, 1000)
    for paths in (a, [[0.7, a], [0.3, b]], [a, b]):
        data = build_data(paths, "bytes", 8, seed=5, vocab_size=2048, valid_fraction=0.1)
        whole = data.train.batch(40, 48)
        assert whole.dtype == torch.long and whole.shape == (48, 9)
        for dp in (2, 4):  # each data-parallel rank reads its slice, last rank first
            fresh = build_data(paths, "bytes", 8, seed=5, vocab_size=2048, valid_fraction=0.1)
            per = 48 // dp
            pieces = {r: fresh.train.batch(40 + r * per, per) for r in reversed(range(dp))}
            assert torch.equal(torch.cat([pieces[r] for r in range(dp)]), whole)
        assert torch.equal(data.train.batch(40, 48), whole)  # the same again, after other reads
        other = build_data(paths, "bytes", 8, seed=6, vocab_size=2048, valid_fraction=0.1)
        assert not torch.equal(other.train.batch(40, 48), whole)


def test_one_epoch_of_one_dataset_reads_every_sample_once(tmp_path):
    prefix = write_dataset(tmp_path / "e", [np.arange(i * 10, i * 10 + 10) for i in range(12)])
    data = build_data(prefix, "bytes", 6, seed=0, vocab_size=512, valid_fraction=0)
    n = data.train.num_samples
    packed = PackedDataset(IndexedDataset(prefix), 6)
    expected = sorted(tuple(packed[k]) for k in range(n))
    assert sorted(tuple(r) for r in data.train.batch(0, n).tolist()) == expected
    assert sorted(tuple(r) for r in data.train.batch(n, n).tolist()) == expected
    assert data.valid is None


def test_blended_samples_come_from_their_dataset_in_the_weighted_share(tmp_path):
    a = tagged_dataset(tmp_path / "a", 10, 50, 0)
    b = tagged_dataset(tmp_path / "b", 10, 50, 1000)
    data = build_data([[3, a], [1, b]], "bytes", 16, seed=0, vocab_size=2048, valid_fraction=0)
    rows = data.train.batch(0, 400)
    from_b = (rows >= 1000).all(dim=1)
    assert ((rows < 1000).all(dim=1) | from_b).all()  # never mixed within a sample
    assert abs(int(from_b.sum()) - 100) < 1 and abs(int(from_b[:37].sum()) - 37 / 4) < 1
    blend = data.train.blend
    datasets, _ = blend.assign(0, 400)
    assert torch.equal(from_b, torch.from_numpy(datasets == 1))


def test_validation_split_holds_out_the_last_documents_in_order(tmp_path):
    a = tagged_dataset(tmp_path / "a", 20, 9, 0)
    b = tagged_dataset(tmp_path / "b", 10, 9, 100)
    data = build_data([a, b], "bytes", 4, seed=1, vocab_size=512, valid_fraction=0.2)
    train = data.train.batch(0, 3 * data.train.num_samples)
    assert set(train.unique().tolist()) == set(range(16)) | set(range(100, 108))  # docs 16-19, 8-9 held out
    valid = data.valid.batch(0, data.valid.num_samples)
    stream_a, stream_b = np.repeat(np.arange(16, 20), 9), np.repeat(np.arange(108, 110), 9)
    n_a, n_b = (len(stream_a) - 1) // 4, (len(stream_b) - 1) // 4
    expected = [stream_a[k * 4: k * 4 + 5].tolist() for k in range(n_a)]
    expected += [stream_b[k * 4: k * 4 + 5].tolist() for k in range(n_b)]
    assert valid.tolist() == expected and data.valid.num_samples == n_a + n_b
    assert torch.equal(data.valid.batch(data.valid.num_samples - 1, 2), valid[[-1, 0]])  # wraps around
    one_doc = build_data(tagged_dataset(tmp_path / "c", 2, 30, 0), "bytes", 4, 0, 512, 0.01)
    assert set(one_doc.valid.batch(0, 4).unique().tolist()) == {1}  # at least one document held out


def test_builtin_corpus():
    data = build_data("builtin", "bytes", 64, seed=0, vocab_size=258, valid_fraction=0.1)
    rows = data.train.batch(0, 8)
    assert rows.shape == (8, 65) and rows.max() <= 257
    assert torch.equal(rows, build_data("builtin", "bytes", 64, 0, 258, 0.1).train.batch(0, 8))
    text = ByteTokenizer().decode(data.valid.batch(0, 1)[0])
    assert text and text in ByteTokenizer().decode(data.valid.batch(0, data.valid.num_samples).flatten())
    with pytest.raises(DataError) as e:
        build_data("builtin", "bytes", 64, 0, 256, 0.0)
    assert_data_error(e, "258")
    with pytest.raises(DataError):
        build_data("builtin", "some/tokenizer.json", 64, 0, 512, 0.0)


# --- errors ------------------------------------------------------------------------------------

@pytest.fixture
def good(tmp_path):
    return write_dataset(tmp_path / "good", [np.arange(10) for _ in range(5)], np.int32)


def test_missing_files_name_both_paths(tmp_path, good):
    with pytest.raises(DataError) as e:
        IndexedDataset(tmp_path / "none")
    assert_data_error(e, "none.idx", "none.bin")
    with pytest.raises(DataError) as e:
        build_data(good + ".bin", "bytes", 4, 0, 512, 0.0)
    assert_data_error(e, "good.bin.idx", "without extension", repr(good))
    os.remove(good + ".bin")
    with pytest.raises(DataError) as e:
        IndexedDataset(good)
    assert_data_error(e, "good.bin")


def corrupt(prefix, ext, offset=None, data=None, truncate=None):
    path = prefix + ext
    raw = bytearray(open(path, "rb").read())
    if data is not None:
        raw[offset:offset + len(data)] = data
    if truncate is not None:
        raw = raw[:truncate]
    open(path, "wb").write(bytes(raw))
    return path


@pytest.mark.parametrize("damage, words", [
    (dict(ext=".idx", offset=0, data=b"NOTMAGIC!"), "not a Megatron-LM index"),
    (dict(ext=".idx", offset=9, data=struct.pack("<Q", 2)), "version 2"),
    (dict(ext=".idx", offset=17, data=b"\x09"), "unknown dtype code 9"),
    (dict(ext=".idx", offset=18, data=struct.pack("<Q", 6)), "truncated"),  # sequence count disagrees
    (dict(ext=".idx", offset=26, data=struct.pack("<Q", 5)), "longer than its header"),  # document count
    (dict(ext=".idx", truncate=40), "truncated"),
    (dict(ext=".bin", truncate=150), "truncated"),
    (dict(ext=".bin", offset=200, data=b"\x00" * 8), "longer than the index"),
    (dict(ext=".idx", offset=34 + 20 + 40, data=struct.pack("<q", 1)), "start at 0"),  # document indices
    (dict(ext=".idx", offset=34 + 20 + 40 + 40, data=struct.pack("<q", 4)), "end at the sequence count"),
    (dict(ext=".idx", offset=34 + 20 + 16, data=struct.pack("<q", 44)), "sequence 2 starts at byte 44"),
])
def test_damaged_files_are_reported_with_the_file(good, damage, words):
    path = corrupt(good, **damage)
    with pytest.raises(DataError) as e:
        IndexedDataset(good)
    assert_data_error(e, path, words)


def test_token_ids_must_fit_the_vocabulary(tmp_path):
    for dtype, bad, vocab in ((np.int32, 70_000, 50_304), (np.uint16, 300, 258)):
        prefix = write_dataset(tmp_path / f"big{bad}", [[1, 2, 3], [4, bad, 5]], dtype)
        with pytest.raises(DataError) as e:
            build_data(prefix, "bytes", 2, 0, vocab, 0.0)
        assert_data_error(e, f"big{bad}.bin", f"token id {bad}", f"model.vocab_size={vocab}")
    with pytest.raises(DataError) as e:
        build_data(prefix, "bytes", 2, 0, 200, 0.0)  # the tokenizer named in data.tokenizer is too big too
    assert_data_error(e, "tokenizer bytes", "258", "model.vocab_size=200")
    small = write_dataset(tmp_path / "small", [[0, 255, 1]], np.uint8)  # uint8 cannot exceed a 258 vocabulary
    assert build_data(small, "bytes", 2, 0, 258, 0.0).train.batch(0, 1).tolist() == [[0, 255, 1]]


def test_samples_need_enough_tokens(good):
    with pytest.raises(DataError) as e:
        build_data(good, "bytes", 50, 0, 512, 0.0)  # 50 tokens, a sample needs 51
    assert_data_error(e, good, "50 tokens", "51")
    with pytest.raises(DataError) as e:
        build_data(good, "bytes", 12, 0, 512, 0.2)  # the held-out document has 10 tokens
    assert_data_error(e, good, "validation", "10 tokens", "13")


@pytest.mark.parametrize("paths, words", [
    ([[-1, "a"], [1, "b"]], ["data.paths[0]", "/a' is -1", "positive"]),
    ([[1, "b"], [0, "a"]], ["data.paths[1]", "/a' is 0"]),
    ([["0.5", "a"]], ["/a' is '0.5'"]),
    ([[True, "a"]], ["/a' is True"]),
    ([[float("nan"), "a"]], ["/a' is nan"]),
    ([[1, "a"], "b"], ["mixes"]),
    ([[1, "a", 2]], ["data.paths[0]", "/a', 2]", "neither a prefix"]),
    ([], ["data.paths"]),
    ([[1e-9, "a"], [1, "b"]], ["1e-6"]),
])
def test_bad_blends(tmp_path, paths, words):
    for name in ("a", "b"):
        write_dataset(tmp_path / name, [np.arange(20)])
    paths = [[p[0], str(tmp_path / p[1]), *p[2:]] if isinstance(p, list) else str(tmp_path / p) for p in paths]
    with pytest.raises(DataError) as e:
        build_data(paths, "bytes", 4, 0, 512, 0.0)
    assert_data_error(e, *words)


def bad_jsonl(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("lines, words", [
    ([b'{"text": "ok"}', b"", b'{"text": "ok", }'], ":3: not valid JSON"),
    ([b'{"text": "ok"}', b'{"text": "caf\xe9"}'], ":2: not valid UTF-8"),
    ([b'{"body": "ok"}'], ":1: no 'text' key (keys: 'body')"),
    ([b'{"text": "ok"}', b'["text"]'], ":2: a JSON list, not an object"),
    ([b'{"text": 3}'], ":1: 'text' is a JSON int, not a string"),
    ([b"", b"  "], "no documents"),
])
def test_bad_preprocess_input_leaves_existing_files_alone(tmp_path, lines, words):
    src = bad_jsonl(tmp_path / "in.jsonl", lines)
    prefix = write_dataset(tmp_path / "out", [[1, 2, 3]])
    before = {n: (tmp_path / n).read_bytes() for n in ("out.bin", "out.idx")}
    for workers in (1, 2):
        with pytest.raises(DataError) as e:
            preprocess(src, prefix, workers=workers)
        assert_data_error(e, f"{src}", words)
        assert {n: (tmp_path / n).read_bytes() for n in before} == before
        assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.bin", "out.idx"]


def test_preprocess_arguments(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["a"])
    with pytest.raises(DataError) as e:
        preprocess(tmp_path / "missing.jsonl", tmp_path / "out")
    assert_data_error(e, "missing.jsonl", "not found")
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError) as e:
        preprocess(src, tmp_path / "file" / "dir" / "out")
    assert_data_error(e, str(tmp_path / "file"), "is a file, not a directory")
    (tmp_path / "file").unlink()
    with pytest.raises(DataError) as e:
        preprocess(src, tmp_path / "out.bin")
    assert_data_error(e, "out.bin", "without extension")
    with pytest.raises(DataError) as e:
        preprocess(src, tmp_path / "out", tokenizer=type("NoEos", (BigVocab,), {"eos_id": None})(), append_eod=True)
    assert_data_error(e, "no end-of-document token")
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
    preprocess(src, tmp_path / "out", text_key="text")
    assert IndexedDataset(tmp_path / "out")[0].tolist() == [256, 97]


def test_preprocess_creates_the_output_directory(tmp_path, monkeypatch):
    """`--output_prefix data/corpus` works in a fresh clone: the missing directories above
    the prefix are made once the arguments are good, and removed again when the input is bad."""
    src = write_jsonl(tmp_path / "in.jsonl", ["a"])
    bad = bad_jsonl(tmp_path / "bad.jsonl", [b'{"text": "ok"}', b"{"])
    monkeypatch.chdir(tmp_path)
    for workers in (1, 2):
        with pytest.raises(DataError) as e:
            preprocess(bad, "data/new/corpus", workers=workers)
        assert_data_error(e, "bad.jsonl:2")
        assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "in.jsonl"]
    with pytest.raises(DataError):  # a bad argument makes nothing
        preprocess(src, "data/new/corpus", workers=0)
    assert not (tmp_path / "data").exists()
    stats = preprocess(src, "data/new/corpus")
    assert stats["idx"] == "data/new/corpus.idx"
    assert IndexedDataset(tmp_path / "data" / "new" / "corpus")[0].tolist() == [256, 97]
    preprocess(src, "data/new/again")  # the directory exists now
    assert sorted(os.listdir(tmp_path / "data" / "new")) == sorted(
        f"{p}.{x}" for p in ("corpus", "again") for x in ("bin", "idx", "tokenizer.json"))


def test_token_ids_of_datasets_too_large_to_scan_are_checked_as_read(tmp_path, monkeypatch):
    import meshtrain.data.build as build

    monkeypatch.setattr(build, "SCAN_LIMIT_BYTES", 8)  # every test dataset counts as large
    prefix = write_dataset(tmp_path / "large", [[1, 2, 3, 4], [5, 6, 300, 7]], np.uint16)
    data = build_data(prefix, "bytes", 2, 0, 258, 0.0)  # opening does not scan
    assert data.train.parts[0].samples([0, 1]).tolist() == [[1, 2, 3], [3, 4, 5]]  # clean samples read fine
    with pytest.raises(DataError) as e:
        data.train.batch(0, data.train.num_samples)
    assert_data_error(e, "large.bin", "token id 300", "model.vocab_size=258")
