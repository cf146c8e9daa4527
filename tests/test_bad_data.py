"""Bad data through the command line (issue 10 item 2): `meshtrain preprocess` and
`meshtrain fit` exit 2 with one line naming the file (and, for preprocess input, the line),
without a traceback, and leave what is already on disk as it was."""

import hashlib
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from meshtrain.cli import main
from meshtrain.data import DataError, IndexedWriter, preprocess

TINY = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")


def data_error(capsys, *args) -> str:
    """Runs the CLI; asserts exit 2 with a one-line data error and returns that line."""
    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshtrain: data error: "), err
    return lines[0]


def write_dataset(prefix, docs, dtype=np.uint16) -> str:
    with IndexedWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(np.asarray(d))
    return str(prefix)


def snapshot(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# --- preprocess input ------------------------------------------------------------------

BAD_LINE = 600  # past the first chunks a worker gets (CHUNK_LINES = 256), after a blank line


def jsonl(path: Path, bad: bytes) -> Path:
    lines = [b'{"text": "fine"}'] * 700
    lines[9] = b"   "  # blank lines are skipped but still counted
    lines[BAD_LINE - 1] = bad
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def preprocess_fails(capsys, tmp_path: Path, src: Path, *words) -> None:
    """The error names src (and words) with 1 and 2 workers; a new prefix gets no files,
    an existing dataset at the prefix stays byte for byte (the 599 documents encoded
    before the bad line went to temporary files only). One worker runs through the API:
    a CLI call costs a second of parser building."""
    out = tmp_path / "out"
    out.mkdir()
    existing = write_dataset(out / "old", [[1, 2, 3], [4, 5]])
    before = snapshot(out)
    for prefix in (out / "new", existing):
        with pytest.raises(DataError) as e:
            preprocess(src, prefix, workers=1)
        assert "\n" not in str(e.value)
        for word in (str(src), *words):
            assert word in str(e.value), (word, str(e.value))
        assert snapshot(out) == before, prefix
    line = data_error(capsys, "preprocess", "--input", str(src), "--output_prefix", existing, "--workers", "2")
    for word in (str(src), *words):
        assert word in line, (word, line)
    assert snapshot(out) == before


def test_line_that_is_not_json(capsys, tmp_path):
    src = jsonl(tmp_path / "in.jsonl", b'{"text": "ok",}')
    preprocess_fails(capsys, tmp_path, src, f"{src}:{BAD_LINE}: not valid JSON", "column 15")


def test_line_that_is_not_utf8(capsys, tmp_path):
    src = jsonl(tmp_path / "in.jsonl", b'{"text": "caf\xe9"}')
    preprocess_fails(capsys, tmp_path, src, f"{src}:{BAD_LINE}: not valid UTF-8", r"b'\xe9'", "re-encode")


def test_line_that_is_not_an_object(capsys, tmp_path):
    src = jsonl(tmp_path / "in.jsonl", b'["text", "fine"]')
    preprocess_fails(capsys, tmp_path, src, f"{src}:{BAD_LINE}: a JSON list, not an object")


def test_line_without_the_text_key(capsys, tmp_path):
    src = jsonl(tmp_path / "in.jsonl", b'{"body": "fine"}')
    preprocess_fails(capsys, tmp_path, src, f"{src}:{BAD_LINE}: no 'text' key (keys: 'body')", "--text_key")


@pytest.mark.parametrize("content", [b"", b"\n  \n\n"], ids=["empty", "blank-lines"])
def test_input_without_documents(capsys, tmp_path, content):
    src = tmp_path / "in.jsonl"
    src.write_bytes(content)
    preprocess_fails(capsys, tmp_path, src, "no documents")


# --- opening a dataset for fit ---------------------------------------------------------

DOCS = [np.arange(300) % 250 for _ in range(4)]  # 1200 uint16 tokens, enough for tiny.yaml's seq_len


def fit_fails(capsys, tmp_path: Path, paths: str, *words) -> str:
    """meshtrain fit on `paths`: a one-line data error holding words; the run directory,
    which already exists, is left as it was (the data is opened before anything is written)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "sentinel").write_text("kept")
    line = data_error(capsys, "fit", "--config", TINY, "--data.paths", paths, "--train.steps", "2",
                      "--train.warmup_steps", "0", "--run_dir", str(run_dir))
    for word in words:
        assert word in line, (word, line)
    assert snapshot(run_dir) == {"sentinel": b"kept"}
    return line


def test_truncated_bin(capsys, tmp_path):
    prefix = write_dataset(tmp_path / "d", DOCS)
    os.truncate(prefix + ".bin", 1000)
    fit_fails(capsys, tmp_path, prefix, f"{prefix}.bin: truncated", "1200 tokens of uint16 (2400 bytes)",
              "1000 bytes", "re-run meshtrain preprocess")


HEADER = 34  # magic 9, version 8, dtype 1, sequence count 8, document-index count 8
POINTERS, DOC_INDICES = HEADER + 4 * 4, HEADER + 12 * 4  # offsets for 4 sequences


@pytest.mark.parametrize("offset, value, words", [
    (18, struct.pack("<Q", 3), ["d.idx: longer than its header says", "3 sequences and 5 document indices"]),
    (DOC_INDICES + 32, struct.pack("<q", 3), ["d.idx: document indices must start at 0 and end at the sequence "
                                              "count 4, they run from 0 to 3"]),
    (POINTERS + 8, struct.pack("<q", 10**12), ["d.idx: sequence 1 starts at byte 1000000000000 of the .bin, but "
                                               "the lengths before it put it at 600"]),
], ids=["sequence-count", "document-indices", "pointer-past-end"])
def test_index_that_disagrees_with_itself_or_the_bin(capsys, tmp_path, offset, value, words):
    prefix = write_dataset(tmp_path / "d", DOCS)
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(value)
    fit_fails(capsys, tmp_path, prefix, *words, "re-run meshtrain preprocess")


@pytest.mark.parametrize("missing", [".bin", ".idx"])
def test_pair_missing_one_file(capsys, tmp_path, missing):
    prefix = write_dataset(tmp_path / "d", DOCS)
    os.remove(prefix + missing)
    fit_fails(capsys, tmp_path, prefix, f"{prefix}{missing} not found", "<prefix>.bin and <prefix>.idx")


def test_token_ids_beyond_the_vocabulary(capsys, tmp_path):
    prefix = write_dataset(tmp_path / "d", [*DOCS, [1, 700, 2], [3, 600, 4]])  # tiny.yaml: vocab_size 512
    fit_fails(capsys, tmp_path, prefix, f"{prefix}.bin: token id 700 >= model.vocab_size=512",
              "raise model.vocab_size to at least 701", "re-tokenize")


def test_dataset_tokenized_with_another_tokenizer(capsys, tmp_path):
    """Data written with a 602-token tokenizer, trained with tiny.yaml's bytes tokenizer and
    vocabulary of 512: refused by the dataset's tokenizer record, naming both tokenizers;
    without the record, by the scan of its token ids."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(600)} | {"<s>": 600, "</s>": 601}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok_path = tmp_path / "tok" / "tokenizer.json"
    tok_path.parent.mkdir()
    tok.save(str(tok_path))
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"text": "{" ".join(f"w{j}" for j in range(i, 600, 4))}"}}\n' for i in range(4)))
    prefix = str(tmp_path / "d")
    preprocess(src, prefix, tokenizer=str(tok_path), append_eod=True)
    sha = hashlib.sha256(tok_path.read_bytes()).hexdigest()[:12]
    fit_fails(capsys, tmp_path, prefix, f"dataset {prefix} was tokenized with {tok_path} (sha256 {sha}, 602 token "
              f"ids), says {prefix}.tokenizer.json, but data.tokenizer is bytes (258 token ids): set data.tokenizer "
              f"to {tok_path} and model.vocab_size to at least 602, or re-run meshtrain preprocess with --tokenizer "
              "bytes")
    os.remove(prefix + ".tokenizer.json")  # as Megatron-LM writes it: the token ids still give it away
    shutil.rmtree(tmp_path / "run")
    fit_fails(capsys, tmp_path, prefix, f"{prefix}.bin: token id 601 >= model.vocab_size=512")


@pytest.mark.parametrize("docs, words", [([], "(0 documents, 0 tokens)"), ([[], []], "(2 documents, 0 tokens)")],
                         ids=["no-documents", "empty-documents"])
def test_empty_dataset(capsys, tmp_path, docs, words):
    prefix = write_dataset(tmp_path / "d", docs)
    fit_fails(capsys, tmp_path, prefix, f"{prefix}.idx: the dataset is empty {words}", "re-run meshtrain preprocess")
