"""JSON lines -> a Megatron-LM indexed dataset (<prefix>.bin, <prefix>.idx) and the record of
its tokenizer (<prefix>.tokenizer.json), which fit checks against data.tokenizer.

One document per non-blank line, one sequence per document: the tokenizer's encoding of
the line's text, plus EOS with append_eod. Tokens are uint16 when the vocabulary fits, else
int32 (what Megatron-LM's preprocess_data.py picks). With workers > 1 a process pool
encodes chunks of lines and the results are written in input order, so the output is the
same for any worker count. Any error leaves files under the final names as they were.

With `loss_mask_key` each line also names the character spans of its text to train on
(`{"text": "Q: 2+2? A: 4", "train_spans": [[8, 12]]}`): <prefix>.loss_mask.bin marks a
token a training target when its characters overlap a span (special tokens never), and
the EOD token when the text's last character lies in a span. fit ignores the targets
left out, as eod_mask_loss does.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..pools import clean_pool
from .errors import DataError
from .indexed import IndexedWriter, bin_path, idx_path, loss_mask_path, record_path
from .tokenizer import EOS_TOKENS, load_tokenizer, tokenizer_record

CHUNK_LINES = 256  # lines per worker task: large enough to amortise the inter-process hop


def preprocess(input, output_prefix, tokenizer="bytes", append_eod: bool = False, workers: int = 1,
               text_key: str = "text", loss_mask_key: str | None = None) -> dict:
    """Tokenize the JSON-lines file `input` into <output_prefix>.bin/.idx, with the
    tokenizer's record in <output_prefix>.tokenizer.json and, with `loss_mask_key`, the
    loss mask in <output_prefix>.loss_mask.bin. `tokenizer` is a spec for load_tokenizer
    (bytes, a tokenizer.json) or a tokenizer object (one without `kind` and `sha256` gets
    no record). Returns {documents, tokens, dtype, bin, idx, record, loss_mask}."""
    src, prefix = os.fspath(input), os.fspath(output_prefix)
    if not os.path.exists(src):
        raise DataError(f"{src}: input file not found; give a .jsonl file with one JSON object per line")
    if not os.path.isfile(src):
        raise DataError(f"{src}: not a file; give a .jsonl file with one JSON object per line")
    missing = _check_output(prefix)
    if not isinstance(workers, int) or workers < 1:
        raise DataError(f"workers={workers!r}: give a whole number of processes, at least 1")
    tok = load_tokenizer(tokenizer)
    eod = None
    if append_eod:
        eod = tok.eos_id
        if eod is None:
            name = getattr(tok, "name", type(tok).__name__)
            raise DataError(f"tokenizer {name}: no end-of-document token (looked for {', '.join(EOS_TOKENS)}); "
                            "drop --append_eod or use a tokenizer that has one")
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.int32
    record = tokenizer_record(tok)
    if missing:  # the output's parent directories, made now that the arguments are good
        try:
            os.makedirs(missing[0], exist_ok=True)
        except OSError as e:
            raise DataError(f"output prefix {prefix!r}: cannot create directory {missing[0]} ({e.strerror}); "
                            "choose another output prefix") from None
    try:
        with IndexedWriter(prefix, dtype, record, loss_mask=loss_mask_key is not None) as writer:
            encoder = _Encoder(tok, src, text_key, eod, loss_mask_key)
            if workers == 1:
                _write(map(encoder, _chunks(src)), writer)
            else:
                _encode_parallel(_chunks(src), workers, encoder, writer)
            if writer.documents == 0:
                raise DataError(f"{src}: no documents (the file has no non-blank lines); give a .jsonl file with "
                                f'one JSON object per line, such as {{"{text_key}": "..."}}')
    except BaseException:
        for directory in missing:  # a failed run leaves no directory it made either
            try:
                os.rmdir(directory)
            except OSError:
                break
        raise
    return {"documents": writer.documents, "tokens": writer.tokens, "dtype": np.dtype(dtype).name,
            "bin": bin_path(prefix), "idx": idx_path(prefix), "record": record_path(prefix) if record else None,
            "loss_mask": loss_mask_path(prefix) if loss_mask_key is not None else None}


def _check_output(prefix: str) -> list[str]:
    """Refuse an output prefix that cannot be written; return the directories above it
    that do not exist yet (deepest first), which preprocess creates."""
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            raise DataError(f"output prefix {prefix!r}: the prefix is given without extension (it writes "
                            f"<prefix>.bin and <prefix>.idx); use {prefix[:-len(ext)]!r}")
    if not os.path.basename(prefix):
        raise DataError(f"output prefix {prefix!r} names a directory; add a file name, e.g. {prefix}docs")
    directory, missing = os.path.dirname(os.path.abspath(prefix)), []
    while not os.path.exists(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    if not os.path.isdir(directory):
        raise DataError(f"output prefix {prefix!r}: {directory} is a file, not a directory; choose another "
                        "output prefix")
    if not os.access(directory, os.W_OK):
        raise DataError(f"output prefix {prefix!r}: directory {directory} is not writable; choose another "
                        "output prefix or fix its permissions")
    return missing


def _chunks(path: str):
    """Lists of (line number, raw bytes) of the non-blank lines, CHUNK_LINES at a time."""
    chunk = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                chunk.append((number, raw))
                if len(chunk) == CHUNK_LINES:
                    yield chunk
                    chunk = []
    if chunk:
        yield chunk


def _encode_parallel(chunks, workers: int, encoder: "_Encoder", writer: IndexedWriter) -> None:
    with clean_pool(workers, __name__, initializer=_start_worker, initargs=(encoder,)) as pool:
        # A bounded window of chunks in flight keeps memory flat on any input size;
        # imap returns them in order, so the first bad line raises first, as with one worker.
        window = []
        for chunk in chunks:
            window.append(chunk)
            if len(window) == 4 * workers:
                _write(pool.imap(_encode_in_worker, window), writer)
                window = []
        _write(pool.imap(_encode_in_worker, window), writer)


def _write(results, writer: IndexedWriter) -> None:
    for docs in results:
        for tokens, mask in docs:
            writer.add_document(tokens, mask)


# The encoder of a pool worker: sent once when the worker starts, not with every chunk.
_WORKER: dict = {}


def _start_worker(encoder: "_Encoder") -> None:
    _WORKER["encoder"] = encoder


def _encode_in_worker(chunk) -> list:
    return _WORKER["encoder"](chunk)


class _Encoder:
    """Chunk of (line number, raw line) -> (token array, loss mask or None), one per
    document."""

    def __init__(self, tok, src: str, text_key: str, eod: int | None, loss_mask_key: str | None = None):
        self.tok, self.src, self.text_key, self.eod, self.mask_key = tok, src, text_key, eod, loss_mask_key

    def __call__(self, chunk) -> list:
        out = []
        for number, raw in chunk:
            obj = self.line(number, raw)
            text, mask = self.text(number, obj), None
            if self.mask_key is None:
                ids = self.tok.encode(text)
            else:
                ids, offsets = self.tok.encode_offsets(text)
                spans = self.spans(number, obj, len(text))
                # EOD: trained on when the text ends inside a span (learning to stop there).
                mask = [_overlaps(o, spans) for o in [*offsets, (len(text) - 1, len(text))]]
            if self.eod is not None:
                ids = [*ids, self.eod]
            elif mask is not None:
                mask.pop()
            out.append((np.asarray(ids, dtype=np.int64), mask))
        return out

    def spans(self, number: int, obj: dict, length: int) -> list[tuple[int, int]]:
        """The line's training spans: [start, end) characters of its text."""
        where, key = f"{self.src}:{number}", self.mask_key
        if key not in obj:
            keys = ", ".join(repr(k) for k in list(obj)[:8])
            raise DataError(f"{where}: no {key!r} key (keys: {keys}); every line needs the loss-mask spans "
                            f"(--loss_mask_key), e.g. {{{key!r}: [[0, {length}]]}} to train on the whole text")
        value, spans = obj[key], []
        for item in value if isinstance(value, list) else [value]:
            ok = (isinstance(value, list) and isinstance(item, list) and len(item) == 2
                  and all(type(v) is int for v in item) and 0 <= item[0] <= item[1] <= length)
            if not ok:
                raise DataError(f"{where}: {key!r} holds {item!r}; give a list of [start, end] character spans of "
                                f"the text to train on, 0 <= start <= end <= {length} (the text's length)")
            spans.append((item[0], item[1]))
        return spans

    def line(self, number: int, raw: bytes) -> dict:
        where, key = f"{self.src}:{number}", self.text_key
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not valid UTF-8 (byte {e.start} of the line is {raw[e.start:e.start + 1]!r}); "
                            "re-encode the file as UTF-8") from None
        if number == 1:
            line = line.lstrip("\ufeff")  # a byte-order mark some editors write
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON "
                            f'object such as {{"{key}": "..."}}') from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: a JSON {type(obj).__name__}, not an object; each line must be one JSON object "
                            f'such as {{"{key}": "..."}}')
        return obj

    def text(self, number: int, obj: dict) -> str:
        where, key = f"{self.src}:{number}", self.text_key
        if key not in obj:
            keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
            raise DataError(f"{where}: no {key!r} key (keys: {keys}); set the text key (--text_key) to the field "
                            "that holds the text")
        text = obj[key]
        if not isinstance(text, str):
            raise DataError(f"{where}: {key!r} is a JSON {type(text).__name__}, not a string; every line's {key!r} "
                            "must be text")
        return text


def _overlaps(chars, spans: list[tuple[int, int]]) -> bool:
    """Whether the characters [start, end) overlap a span (empty ones, a special token's,
    never do)."""
    start, end = chars
    return start < end and any(start < e and s < end for s, e in spans)
