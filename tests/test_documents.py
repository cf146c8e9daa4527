"""Packed documents trained as documents (issue 24): a row of several documents, with
document masking and restarting positions, gives each document the logits and the
gradients it gets alone as its own sequence; the loss after an EOD can be masked.
One process here; the layouts in tests/test_documents_layouts.py."""

from __future__ import annotations


import dataclasses
from pathlib import Path

import pytest
import torch

from meshtrain import build
from meshtrain.data.documents import document_positions, document_segments, mask_after_eod
from meshtrain.models.attention import document_window
from meshtrain.models.context import Documents, LocalContext
from meshtrain.models.gpt2 import GPT2Config
from meshtrain.models.llama import LlamaConfig
from meshtrain.models.spec import init_slice

EOD = 1
LLAMA = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=37, max_seq_len=32)
GPT2 = GPT2Config(dim=32, n_layers=2, n_heads=4, ffn_dim=64, vocab_size=37, max_seq_len=32)
# Rows of 16 tokens: documents of several lengths, one of a single token (its EOD), one cut
# by the row's end, and a row that is one document.
LENGTHS = [[5, 1, 7, 3], [16], [2, 9, 5]]


def packed_rows(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in LENGTHS:
        docs = [torch.cat([torch.randint(2, LLAMA.vocab_size, (n - 1,), generator=g), torch.tensor([EOD])])
                for n in lengths]
        rows.append(torch.cat(docs)[:16])
    return torch.stack(rows)


def test_segments_positions_and_the_eod_mask_by_hand():
    tokens = torch.tensor([[7, 1, 1, 5, 6, 1, 9], [4, 4, 4, 4, 4, 4, 4]])
    assert document_segments(tokens, 1).tolist() == [[0, 0, 1, 2, 2, 2, 3], [0] * 7]
    assert document_positions(tokens, 1).tolist() == [[0, 1, 0, 0, 1, 2, 0], list(range(7))]
    targets = torch.arange(14).view(2, 7)
    assert mask_after_eod(tokens, targets, 1).tolist() == [[0, -1, -1, 3, 4, -1, 6], list(range(7, 14))]


@pytest.mark.parametrize("arch, cfg", [("llama", LLAMA), ("gpt2", GPT2)])
def test_a_packed_row_equals_its_documents_alone(arch, cfg):
    model = build(arch, cfg)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    tokens = packed_rows()
    docs = Documents(document_segments(tokens, EOD), document_positions(tokens, EOD))
    packed = model.forward(params, tokens, LocalContext(), docs)
    packed.square().sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in params.items()}
    alone = torch.empty_like(packed)
    for p in params.values():
        p.grad = None
    total = 0
    for r in range(tokens.shape[0]):
        for s in docs.segments[r].unique():
            cols = (docs.segments[r] == s).nonzero().flatten()
            out = model.forward(params, tokens[r:r + 1, cols], LocalContext())
            alone[r, cols] = out[0].detach()
            total = total + out.square().sum()
    total.backward()
    torch.testing.assert_close(packed.detach(), alone, rtol=1e-5, atol=1e-6)
    # atol: sums over every token in another order (GPT-2's biases: 2e-6 where the largest
    # gradient is 0.2; its key bias's gradient is 0 but for rounding)
    atol = 1e-5 * max(float(p.grad.abs().max()) for p in params.values())
    for n, p in params.items():
        torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-5, atol=atol, msg=lambda m: f"{n}: {m}")
    # Without the documents, the row is one sequence: the later documents differ.
    whole = model.forward(params, tokens, LocalContext())
    assert (whole[0, 5:] - alone[0, 5:]).abs().max() > 1e-3


@pytest.mark.parametrize("arch, cfg", [("llama", LLAMA), ("gpt2", GPT2)])
def test_masking_and_positions_each_matter(arch, cfg):
    """Neither half is a no-op: each changes the logits on its own. With the mask on, RoPE
    sees only distances within a document, so restarting its positions changes nothing
    (rounding aside); GPT-2's learned positions are absolute, so there it does."""
    model = build(arch, cfg)
    params = {n: init_slice(s, n, seed=0) for n, s in model.specs.items()}
    tokens = packed_rows()
    seg, pos = document_segments(tokens, EOD), document_positions(tokens, EOD)
    off, mask, positions, both = (model.forward(params, tokens, LocalContext(), d)
                                  for d in (None, Documents(seg, None), Documents(None, pos), Documents(seg, pos)))
    differ = lambda a, b: (a - b).abs().max() > 1e-5  # noqa: E731  (fp32 rounding: ~1e-7)
    assert differ(off, mask) and differ(off, positions) and differ(positions, both)
    assert differ(mask, both) == (arch == "gpt2")


def test_the_eod_masked_loss_is_the_mean_over_the_targets_left():
    """A step's loss, by hand: cross entropy over the targets not after an EOD, averaged
    over those alone, across two micro-steps of unequal counts."""
    from meshtrain import TrainState, make_train_step
    from meshtrain.train.optim import AdamW

    model = build("llama", LLAMA)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    tokens = packed_rows()
    targets = mask_after_eod(tokens, torch.roll(tokens, -1, 1), EOD)
    docs = Documents(document_segments(tokens, EOD), document_positions(tokens, EOD))
    logits = model.forward(params, tokens, LocalContext(), docs)
    by_hand = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
    assert 0 < (targets < 0).sum() < targets.numel() - 1  # something is masked, not all
    halves = {"tokens": [tokens[:1], tokens[1:]], "targets": [targets[:1], targets[1:]],
              "segments": [docs.segments[:1], docs.segments[1:]], "positions": [docs.positions[:1], docs.positions[1:]]}
    step = make_train_step(model, optimizer=AdamW(lr=1e-3))
    assert step(TrainState.create(params), halves)["loss"] == pytest.approx(float(by_hand), rel=1e-6)


def test_fit_trains_documents_and_resumes_exactly(tmp_path, one_thread):
    """Through fit on the embedded corpus (its documents end with EOS): the three keys
    change the run, and a run stopped and resumed equals the uninterrupted one bitwise
    (the documents are found from the tokens themselves)."""
    from support.cli import losses
    from support.configs import small_cfg
    from meshtrain.run.fit import fit

    base = small_cfg(tmp_path, steps=4, warmup_steps=1)
    on = dataclasses.replace(base.data, document_mask=True, reset_positions=True, eod_mask_loss=True)
    plain = fit(dataclasses.replace(base, run_dir=str(tmp_path / "plain")))
    whole = fit(dataclasses.replace(base, data=on, run_dir=str(tmp_path / "whole")))
    assert abs(plain[0]["loss"] - whole[0]["loss"]) > 1e-4
    pieces = dataclasses.replace(base, data=on, run_dir=str(tmp_path / "pieces"))
    fit(dataclasses.replace(pieces, train=dataclasses.replace(base.train, stop_at=2)))
    fit(pieces)
    assert losses(Path(pieces.run_dir)).tolist() == [r["loss"] for r in whole]


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_tiled_document_attention_equals_one_mask(heads, kv_heads):
    """The eager tiles (each over its documents' span) against one dense mask: outputs and
    q/k/v gradients, with documents longer and shorter than a tile, one of length 1, and
    a tile that starts inside a document."""
    from meshtrain.models.attention import dense_document_attention, tiled_document_attention

    g = torch.Generator().manual_seed(0)
    seq = 37  # tiles of 8: the last one short
    segments = torch.tensor([[0] * 3 + [1] + [2] * 20 + [3] * 13, [0] * 37])
    q = torch.randn(2, heads, seq, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, seq, 16, generator=g, requires_grad=True) for _ in range(2))
    outs = []
    for fn in (lambda *a: tiled_document_attention(*a, tile=8), dense_document_attention):
        out = fn(q, k, v, segments)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        outs.append((out, *grads))
    for a, b in zip(*outs):  # k/v gradients sum over queries tile by tile: rounding of the largest
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


def _rows(lengths: list[list[int]], seq: int) -> torch.Tensor:
    """Segment ids of rows packed with documents of these lengths, repeated to fill `seq`."""
    rows = []
    for row in lengths:
        ids = [d for d, n in enumerate(row * seq) for _ in range(n)]
        rows.append(ids[:seq])
    return torch.tensor(rows)


def test_the_window_covers_each_tiles_documents():
    """From each tile's last query back to its first query's document's start, rounded up
    to 128 x a power of two; None when that is the whole row or the row is not whole tiles,
    0 when no row has a boundary."""
    assert document_window(_rows([[128]], 1024)) == 128  # every tile a document
    assert document_window(_rows([[1], [100, 37]], 1024)) == 256  # a document starting at 99 reaches tile 2's end
    assert document_window(_rows([[300, 5]], 1024)) == 512
    assert document_window(_rows([[600]], 1024)) is None  # 600 + a tile: the whole row
    assert document_window(_rows([[1]], 1000)) is None  # not whole tiles
    assert document_window(_rows([[1024], [2000]], 1024)) == 0  # no boundary: plain causal


@pytest.mark.parametrize("lengths", [[[100, 37], [1, 128]], [[300, 5], [64, 64]], [[1], [255, 1]]],
                         ids=["short", "long", "single-token"])
def test_the_windowed_attention_equals_one_mask(lengths):
    """The compiled path's static-shape windows against one dense mask, fp64: outputs and
    q/k/v gradients, GQA, documents that cross tiles and of length 1."""
    from meshtrain.models.attention import dense_document_attention, windowed_document_attention

    g = torch.Generator().manual_seed(0)
    segments = _rows(lengths, 1024)
    window = document_window(segments)
    assert window is not None and window < 1024
    q = torch.randn(2, 4, 1024, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 1024, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    outs = []
    for fn in (lambda *a: windowed_document_attention(*a, window), dense_document_attention):
        out = fn(q, k, v, segments)
        outs.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_compiled_forward_takes_the_window_and_equals_eager():
    """A compiled Llama forward and backward over packed documents runs the windowed
    attention (its attention sees `window` keys per 128-query tile, not the row) and
    equals the eager tiles; another window is another graph, the same window none."""
    from torch.profiler import ProfilerActivity, profile

    cfg = dataclasses.replace(LLAMA, max_seq_len=512)
    model = build("llama", cfg)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, cfg.vocab_size, (2, 512), generator=g)
    tokens[:, 99::100] = EOD  # documents of 100 tokens: a window of 256

    def run(fn, docs):
        loss = fn(params, tokens, docs).square().mean()
        grads = torch.autograd.grad(loss, list(params.values()))
        return loss, grads

    docs = Documents(document_segments(tokens, EOD), document_positions(tokens, EOD))
    docs = docs._replace(window=document_window(docs.segments))
    assert docs.window == 256
    forward = lambda p, t, d: model.forward(p, t, LocalContext(), d)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(forward, backend="aot_eager", fullgraph=True, dynamic=False)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        got = run(compiled, docs)
    want = run(forward, docs)
    for a, b in zip((got[0], *got[1]), (want[0], *want[1])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    keys = {e.input_shapes[1][2] for e in prof.events() if "scaled_dot_product" in e.name
            and "backward" not in e.name and e.input_shapes and len(e.input_shapes[1]) == 4}
    assert keys == {256}, keys  # every layer's keys: the window, not the 512-token row
    traced = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    run(compiled, docs)
    run(compiled, docs._replace(window=None))  # one dense mask: a graph of its own
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == traced + 1


def test_the_tile_masks_are_built_once_per_micro_batch(monkeypatch):
    """Every layer of one forward shares the first layer's masks; the next micro-batch (a
    new segments tensor) builds its own, and the forward is the same as without sharing."""
    from meshtrain.models import attention

    built = []
    real = attention.tile_masks
    monkeypatch.setattr(attention, "tile_masks", lambda *a, **k: built.append(1) or real(*a, **k))
    model = build("llama", LLAMA)
    params = {n: init_slice(s, n, seed=0) for n, s in model.specs.items()}
    tokens = packed_rows()
    outs = []
    for _ in range(2):
        docs = Documents(document_segments(tokens, EOD), document_positions(tokens, EOD))
        outs.append(model.forward(params, tokens, LocalContext(), docs))
    assert len(built) == 2 and LLAMA.n_layers > 1
    monkeypatch.setattr(attention, "_cached_tile_masks", lambda s, d, t, key: real(s, d, t))  # built per layer
    again = model.forward(params, tokens, LocalContext(), docs)
    assert torch.equal(again, outs[1]) and torch.equal(outs[0], outs[1])


@pytest.mark.slow
def test_context_parallel_fit_with_documents_matches_one_process(tmp_path):
    """Through the CLI: configs/tiny-cp2.yaml (2 self-launched ranks, ring) with the three
    keys equals one process with them (the batch arrives as DTensors of zigzag columns)."""
    from support.cli import SMALL, TINY, losses, run_cli

    on = ["--data.document_mask", "true", "--data.reset_positions", "true", "--data.eod_mask_loss", "true"]
    runs = {}
    for name, config in (("cp2", TINY.parent / "tiny-cp2.yaml"), ("one", TINY)):
        runs[name] = tmp_path / name
        proc = run_cli("fit", "--config", str(config), *SMALL, "--model.n_layers", "2", "--train.seq_len", "64",
                       *on, "--run_dir", str(runs[name]))
        assert proc.returncode == 0, proc.stdout + proc.stderr
    torch.testing.assert_close(losses(runs["cp2"]), losses(runs["one"]), rtol=1e-5, atol=0)


def test_document_keys_with_a_tokenizer_without_eos_are_refused_before_training(tmp_path):
    """Documents are found by their EOS: a tokenizer without one stops fit at once (exit 2,
    one line naming the keys and the fix), before anything is written."""
    import json

    pytest.importorskip("tokenizers")
    from meshtrain.data import preprocess
    from meshtrain.data.tokenizer import ByteTokenizer
    from support.cli import SMALL, TINY, run_cli

    files = ByteTokenizer().hf_files()
    tokenizer = json.loads(files["tokenizer.json"])
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != "<eos>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n"
                                                 for i in range(20)))
    preprocess(tmp_path / "docs.jsonl", tmp_path / "docs", tokenizer=str(tmp_path / "tokenizer.json"))
    run_dir = tmp_path / "run"
    done = run_cli("fit", "--config", str(TINY), *SMALL, "--data.paths", str(tmp_path / "docs"),
                   "--data.tokenizer", str(tmp_path / "tokenizer.json"), "--data.document_mask", "true",
                   "--data.eod_mask_loss", "true", "--run_dir", str(run_dir))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert "data.document_mask finds documents by their end-of-document token" in done.stderr
    assert "set data.document_mask and data.eod_mask_loss to false" in done.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("key", ["document_mask", "reset_positions", "eod_mask_loss"])
def test_document_keys_on_data_without_end_of_document_tokens_are_refused(tmp_path, capsys, key):
    """A dataset preprocessed without --append-eod has no boundaries to find: each document
    key alone is refused (exit 2, one line naming --append-eod), never silently nothing."""
    import json

    from meshtrain.cli import main
    from meshtrain.data import preprocess
    from support.cli import SMALL, TINY

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 9}) + "\n" for i in range(30)))
    preprocess(tmp_path / "docs.jsonl", tmp_path / "plain", tokenizer="bytes")
    run_dir = tmp_path / "run"
    code = main(["fit", "--config", str(TINY), *SMALL, "--data.paths", str(tmp_path / "plain"),
                 f"--data.{key}", "true", "--run_dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        f"meshtrain: data error: data.{key} finds documents by their end-of-document token (id 257), but the "
        f"documents of dataset {tmp_path / 'plain'} do not end with it: re-run meshtrain preprocess with "
        f"--append-eod, or set data.{key} to false"]
    assert not run_dir.exists()
    # The same text with --append-eod trains: the check reads the documents' last tokens.
    preprocess(tmp_path / "docs.jsonl", tmp_path / "eod", tokenizer="bytes", append_eod=True)
    assert main(["fit", "--config", str(TINY), *SMALL, "--train.steps", "1", "--data.paths", str(tmp_path / "eod"),
                 f"--data.{key}", "true", "--run_dir", str(run_dir)]) == 0
