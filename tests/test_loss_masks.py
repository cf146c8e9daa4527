"""Loss masks from the data (issue 24, item 5): `meshtrain preprocess --loss_mask_key`
writes <prefix>.loss_mask.bin from character spans of each line's text; fit ignores the
targets it leaves out and averages the loss over the global batch's targets that are left,
in every layout (the masked targets travel as the ignored targets eod_mask_loss makes,
which tests/test_documents_layouts.py checks layout by layout)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from meshtrain.data import preprocess
from meshtrain.data.errors import DataError
from meshtrain.data.indexed import IndexedDataset, loss_mask_path
from meshtrain.data.tokenizer import ByteTokenizer
from meshtrain.models.context import LocalContext
from meshtrain.models.spec import init_slice
from support.cli import SMALL, TINY, losses, run_cli
from support.configs import small_cfg


def _sft_lines(n: int = 80) -> list[dict]:
    """Question-answer documents that train on the answers only; one answer holds a
    character of several UTF-8 bytes, one document trains on nothing, one on everything."""
    lines = []
    for i in range(n):
        q, a = f"Q{i}: what is {i} + {2 * i}? ", f"A: {3 * i}{' é' if i == 1 else ''}. Thanks."
        spans = [[len(q), len(q + a)]] if i not in (2, 3) else ([] if i == 2 else [[0, len(q + a)]])
        lines.append({"text": q + a, "train": spans})
    return lines


def _write(path, lines) -> None:
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    _write(root / "sft.jsonl", _sft_lines())
    preprocess(root / "sft.jsonl", root / "sft", append_eod=True, loss_mask_key="train")
    return root / "sft"


def test_the_mask_marks_the_tokens_of_the_spans_and_the_eod_after_a_trained_end(sft, tmp_path):
    data, tok = IndexedDataset(sft), ByteTokenizer()
    # Worker processes write the same bytes.
    preprocess(sft.parent / "sft.jsonl", tmp_path / "two", append_eod=True, loss_mask_key="train", workers=2)
    assert Path(loss_mask_path(tmp_path / "two")).read_bytes() == Path(loss_mask_path(sft)).read_bytes()
    for i, line in enumerate(_sft_lines()):
        text, spans = line["text"], line["train"]
        trained = {c for s, e in spans for c in range(s, e)}
        # bytes: BOS, then each character's UTF-8 bytes, then EOD
        want = [False] + [c in trained for c, ch in enumerate(text) for _ in ch.encode()] + [len(text) - 1 in trained]
        assert data.get(i).tolist() == [tok.bos_id, *text.encode(), tok.eos_id]
        assert data.get_loss_mask(i).tolist() == want, i


def test_a_tokenizer_json_gives_the_same_mask_as_the_byte_tokenizer(sft, tmp_path):
    """The tokenizers library's character offsets (the bytes tokenizer exported as a
    tokenizer.json encodes exactly as the built-in one)."""
    pytest.importorskip("tokenizers")
    for name, text in ByteTokenizer().hf_files().items():
        (tmp_path / name).write_text(text)
    _write(tmp_path / "sft.jsonl", _sft_lines())
    preprocess(tmp_path / "sft.jsonl", tmp_path / "hf", tokenizer=str(tmp_path / "tokenizer.json"),
               append_eod=True, loss_mask_key="train")
    a, b = IndexedDataset(sft), IndexedDataset(tmp_path / "hf")
    for i in range(len(a)):
        assert b.get(i).tolist() == a.get(i).tolist() and b.get_loss_mask(i).tolist() == a.get_loss_mask(i).tolist()


def test_bad_spans_and_stale_or_foreign_masks_are_clear_errors(tmp_path):
    src = tmp_path / "in.jsonl"
    for bad, words in (({"text": "abc"}, "no 'train' key"), ({"text": "abc", "train": [[1, 4]]}, "[1, 4]"),
                       ({"text": "abc", "train": [1, 2]}, "holds 1"), ({"text": "abc", "train": "all"}, "'all'")):
        _write(src, [bad])
        with pytest.raises(DataError, match=r"in\.jsonl:1: .*" + words.replace("[", r"\[").replace("]", r"\]")):
            preprocess(src, tmp_path / "out", loss_mask_key="train")
        assert not list(tmp_path.glob("out*"))  # nothing written
    # Through the CLI: exit 2, one line naming the field and the fix.
    done = run_cli("preprocess", "--input", str(src), "--output_prefix", str(tmp_path / "out"),
                   "--loss_mask_key", "train")
    assert done.returncode == 2 and "Traceback" not in done.stderr and "character spans" in done.stderr, done.stderr
    # Written again without a mask, a prefix loses the old one; a mask of the wrong size fails at open.
    _write(src, [{"text": "abcdef", "train": [[0, 3]]}])
    preprocess(src, tmp_path / "out", loss_mask_key="train")
    assert IndexedDataset(tmp_path / "out").get_loss_mask(0).tolist() == [False, True, True, True, False, False, False]
    preprocess(src, tmp_path / "out")
    assert not IndexedDataset(tmp_path / "out").has_loss_mask
    preprocess(src, tmp_path / "out", loss_mask_key="train")
    with open(loss_mask_path(tmp_path / "out"), "ab") as f:
        f.write(b"\x01")
    with pytest.raises(DataError, match="loss_mask.bin: 8 bytes, but .* describes 7 tokens"):
        IndexedDataset(tmp_path / "out")


def test_fit_loss_is_the_mean_over_the_unmasked_targets_and_resumes_exactly(sft, tmp_path, one_thread):
    """Step 1's loss, by hand from the initial parameters: cross entropy over the global
    batch's targets the mask keeps (2 micro-steps of unequal counts), averaged over them;
    then a run stopped and resumed equals the uninterrupted one bitwise."""
    from meshtrain.run.fit import fit
    from meshtrain.run.start import open_data

    base = small_cfg(tmp_path, steps=4, warmup_steps=1)
    base.data = dataclasses.replace(base.data, paths=str(sft), valid_fraction=0.0)
    data = open_data(base)
    t = base.train
    window, mask = data.train.batch(0, t.global_batch), data.train.loss_mask(0, t.global_batch)
    targets = torch.where(mask[:, 1:], window[:, 1:], -1)
    assert 0 < (targets >= 0).sum() < targets.numel() // 2  # the answers only
    model = base.model_def()
    params = {n: init_slice(s, n, base.seed) for n, s in model.specs.items()}
    with torch.no_grad():
        logits = model.forward(params, window[:, :-1], LocalContext())
    by_hand = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)

    whole = fit(dataclasses.replace(base, run_dir=str(tmp_path / "whole")))
    assert whole[0]["loss"] == pytest.approx(float(by_hand), rel=1e-5)
    pieces = dataclasses.replace(base, run_dir=str(tmp_path / "pieces"))
    fit(dataclasses.replace(pieces, train=dataclasses.replace(base.train, stop_at=2)))
    fit(pieces)
    assert losses(tmp_path / "pieces").tolist() == [r["loss"] for r in whole]


@pytest.mark.slow
def test_context_parallel_fit_with_loss_masks_matches_one_process(sft, tmp_path):
    """Through the CLI: configs/tiny-cp2.yaml (2 self-launched ranks, zigzag columns of
    each row, so the mask is cut with the tokens) with a masked dataset and packed
    documents equals one process: losses and gradient norms."""
    from support.cli import read_metrics

    args = [*SMALL, "--model.n_layers", "2", "--train.seq_len", "64", "--data.paths", str(sft),
            "--data.valid_fraction", "0", "--data.document_mask", "true", "--data.reset_positions", "true"]
    runs = {}
    for name, config in (("cp2", TINY.parent / "tiny-cp2.yaml"), ("one", TINY)):
        runs[name] = tmp_path / name
        proc = run_cli("fit", "--config", str(config), *args, "--run_dir", str(runs[name]))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "loss masks from 1 of 1 dataset(s)" in proc.stdout
    torch.testing.assert_close(losses(runs["cp2"]), losses(runs["one"]), rtol=1e-5, atol=0)
    norms = {name: np.array([r["grad_norm"] for r in read_metrics(run)]) for name, run in runs.items()}
    np.testing.assert_allclose(norms["cp2"], norms["one"], rtol=1e-5)
