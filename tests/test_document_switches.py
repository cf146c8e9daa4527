"""Every data-side switch alone, against an independent computation (issue 40, item 1).

The property: each document key alone changes the loss exactly as its own definition says.
`data.document_mask`, `data.reset_positions`, `data.eod_mask_loss` and the data's loss mask
(`meshtrain preprocess --loss_mask_key`) are each turned on with the others off, through
`meshtrain fit` in-process (`meshtrain.cli.main`), and step 1's loss and gradient norm
are compared (rtol 1e-5) with a computation written here from the keys' definitions:
documents, positions and masks found by plain Python loops over the tokens (never by
`meshtrain/data/documents.py`, which the run itself uses), the data's mask read from
`<prefix>.loss_mask.bin` with numpy, the per-token cross entropy in float64, averaged over
the global batch's remaining targets. Each test also checks that the switch changed the
run (the same run with the key off differs by far more than the tolerance), so a key
that does nothing alone, or only together with the others (the survivor of issue 40: an
`eod_mask_loss` that masks nothing without `document_mask`), fails here.

The reference forward is the model's plain path (no `Documents`): positions are given to
it by gathering the position table by hand, GPT-2's learned `pos_emb` rows or Llama's
RoPE cos/sin rows at the positions a loop builds, and a document is run alone as its own
sequence. The data: short documents of many lengths, preprocessed here, so each row of 64
tokens holds several. The run starts from weights 5x the usual init (model.init_from), so
the context visibly changes step 1's loss (at std 0.02 a Llama's restarted RoPE positions
move it by 5e-6 only); each switch then moves loss and gradient norm by 150x to 12000x
the tolerance, and fit agrees with the hand computation to 1e-2 x the tolerance or better.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from meshtrain.cli import main
from meshtrain.config import RunConfig
from meshtrain.data.tokenizer import ByteTokenizer
from meshtrain.models.context import LocalContext
from meshtrain.models.spec import init_slice
from meshtrain.run.start import open_data
from support.cli import SMALL, TINY, read_metrics

EOD = ByteTokenizer().eos_id  # the bytes tokenizer's end of document, which --append_eod writes
RTOL = 1e-5  # fp32 forward and backward against the same in a float64 loss
CHANGED = 100 * RTOL  # a switch must move the loss and the gradient norm by more than this (relative)
SCALE = 5  # the initial weights' std: 5 x 0.02 (see `weights`)
# 16 rows of 64 tokens in 4 micro-steps of 4 rows, 2 layers: several documents per row.
ARGS = [*SMALL, "--train.steps", "1", "--model.n_layers", "2", "--train.seq_len", "64",
        "--train.global_batch", "16", "--train.micro_batch", "4"]
ARCHS = {"llama": [], "gpt2": ["--model.arch", "gpt2", "--model.n_kv_heads", "null", "--model.rope_theta", "null"]}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _lines(n: int = 150) -> list[dict]:
    """Short documents of many lengths (empty ones, 2 tokens with BOS and EOD, up to one
    longer than a row), each training on a part of its text: nothing, everything, its
    second half; one holds a character of several UTF-8 bytes."""
    g = np.random.default_rng(0)
    lengths = [0, 2, 5, 9, 14, 20, 27, 35, 50, 90]
    lines = []
    for i in range(n):
        text = "".join(g.choice(list("abcdefgh ij")) for _ in range(lengths[i % len(lengths)]))
        text = text.replace("a", "é", 1) if i == 7 else text
        train = [] if i % 5 == 0 or not text else [[0, len(text)]] if i % 5 == 1 else [[len(text) // 2, len(text)]]
        lines.append({"text": text, "train": train})
    return lines


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """The lines, preprocessed (meshtrain preprocess --append_eod) without and with
    --loss_mask_key: prefixes "plain" and "masked"."""
    root = tmp_path_factory.mktemp("corpus")
    lines = _lines()
    (root / "docs.jsonl").write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    for prefix, flags in (("masked", ["--loss_mask_key", "train"]), ("plain", [])):
        assert main(["preprocess", "--input", str(root / "docs.jsonl"), "--output_prefix", str(root / prefix),
                     "--append_eod", *flags]) == 0
    return {"lines": lines, "plain": root / "plain", "masked": root / "masked"}


def fit_step1(run_dir: Path, data: Path, *flags: str) -> tuple[dict, RunConfig]:
    """Step 1's metrics of `meshtrain fit` (in-process) on dataset `data` and the config
    the run wrote."""
    assert main(["fit", "--config", str(TINY), *ARGS, "--data.paths", str(data), "--data.valid_fraction", "0",
                 *flags, "--run_dir", str(run_dir)]) == 0
    cfg = RunConfig.from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    return read_metrics(run_dir)[0], cfg


@pytest.fixture(scope="module")
def weights(tmp_path_factory, corpus) -> dict:
    """Per architecture: the seed's initial weights with the normal ones scaled by SCALE
    (std 0.1, not 0.02: at 0.02 the logits hardly depend on the context, so positions and
    masks move step 1's loss by ~1e-5 only), as the flags that start a run from them
    (model.init_from, a Hugging Face directory in fp32) and as the parameters the
    reference starts from."""
    from meshtrain.interop.export import save_hf

    root = tmp_path_factory.mktemp("weights")
    out = {}
    for arch, flags in ARCHS.items():
        _, cfg = fit_step1(root / f"{arch}-config", corpus["plain"], *flags)  # the config of these flags
        model = cfg.model_def()
        params = {n: init_slice(s, n, cfg.seed) * (SCALE if s.init == "normal" else 1) for n, s in model.specs.items()}
        save_hf(params, arch, cfg.family_config(), root / arch, dtype="fp32")
        out[arch] = ([*flags, "--model.init_from", str(root / arch)], params)
    return out


@pytest.fixture(scope="module")
def off(tmp_path_factory, corpus, weights):
    """Per architecture: step 1 with every key off, and its config."""
    root = tmp_path_factory.mktemp("off")
    return {arch: fit_step1(root / arch, corpus["plain"], *weights[arch][0]) for arch in ARCHS}


# --- the definitions, by hand --------------------------------------------------------------

def spans(row: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each document of a row: a document ends with its EOD (included)."""
    out, start = [], 0
    for i, t in enumerate(row):
        if t == EOD:
            out.append((start, i + 1))
            start = i + 1
    if start < len(row):
        out.append((start, len(row)))
    return out


def restarted_positions(row: list[int]) -> list[int]:
    """0 at the row's start and after every EOD, counting up in between."""
    out, p = [], 0
    for t in row:
        out.append(p)
        p = 0 if t == EOD else p + 1
    return out


def not_after_eod(row: list[int]) -> list[bool]:
    """Whether the target of each input is kept: not when the input is an EOD (the
    target is the next document's first token)."""
    return [t != EOD for t in row]


@contextmanager
def at_positions(params: dict, positions: list[int]):
    """Parameters (and, for Llama, RoPE tables) under which the model's plain forward of a
    sequence puts its i-th token at positions[i]: GPT-2's learned table gathered by hand
    (gradients flow back to pos_emb), Llama's cos/sin rows gathered by hand."""
    index = torch.tensor(positions)
    if "pos_emb" in params:
        yield {**params, "pos_emb": params["pos_emb"][index]}
        return
    from meshtrain.models import blocks  # rope_tables: the RoPE tables of every RoPE family's stage

    real = blocks.rope_cos_sin

    def gathered(seq_len, head_dim, *args, **kwargs):
        assert seq_len == len(positions)
        return tuple(t[index] for t in real(max(positions) + 1, head_dim, *args, **kwargs))

    with mock.patch.object(blocks, "rope_cos_sin", gathered):
        yield params


def reference(cfg: RunConfig, start: dict, *, keep=None, positions=None, alone: bool = False,
              window: torch.Tensor | None = None) -> tuple[float, float, torch.Tensor]:
    """Step 1's loss and gradient norm by hand, from the initial parameters `start`: each
    row (or, `alone`, each document of a row as its own sequence at the positions it has
    in the row) through the plain forward at `positions(row)` (default 0..S-1), the cross
    entropy in float64 of the targets `keep(row)` (or `keep[r]`) keeps, averaged over the
    global batch's kept targets. Also returns the logits (batch, seq, vocab)."""
    model = cfg.model_def()
    params = {n: t.clone().requires_grad_() for n, t in start.items()}
    if window is None:
        window = open_data(cfg).train.batch(0, cfg.train.global_batch)
    inputs, targets = window[:, :-1], window[:, 1:]
    total, kept, logits = 0.0, 0, []
    for r in range(inputs.shape[0]):
        row = inputs[r].tolist()
        where = positions(row) if positions else list(range(len(row)))
        pieces = spans(row) if alone else [(0, len(row))]
        out = []
        for a, b in pieces:
            with at_positions(params, where[a:b]) as p:
                out.append(model.forward(p, inputs[r:r + 1, a:b], LocalContext())[0])
        row_logits = torch.cat(out)
        mask = torch.tensor(keep[r] if isinstance(keep, list) else keep(row) if keep else [True] * len(row))
        ce = F.cross_entropy(row_logits.double(), targets[r], reduction="none")
        total = total + ce[mask].sum()
        kept += int(mask.sum())
        logits.append(row_logits.detach())
    loss = total / kept
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in params.values()))
    return float(loss.detach()), norm, torch.stack(logits)


def check(got: dict, want: tuple, was: dict) -> None:
    """fit's step 1 equals the reference (rtol 1e-5), and differs from the run with the
    key off by far more than that."""
    wrong, still = [], []
    for key, value in zip(("loss", "grad_norm"), want[:2]):
        off_by = abs(got[key] - value) / (RTOL * abs(value))
        moved = abs(got[key] - was[key]) / (RTOL * abs(was[key]))
        print(f"{key}: fit - by hand {off_by:.3g} x the tolerance; fit - key off {moved:.3g} x the tolerance")
        if off_by > 1:
            wrong.append(f"{key}: fit {got[key]}, by hand {value}: {off_by:.3g} x the tolerance")
        if moved <= CHANGED / RTOL:
            still.append(f"{key}: {got[key]}, with the key off {was[key]}: {moved:.3g} x the tolerance")
    assert not wrong, "; ".join(wrong)
    assert not still, "; ".join(still)


# --- the tests -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_the_reference_is_the_run_with_every_key_off(weights, off, arch):
    """The by-hand computation with no key equals fit with none: the reference itself
    (initial parameters, batch, loss, gradient norm) is right before any key is judged;
    and the batch has what the keys act on (rows of several documents)."""
    got, cfg = off[arch]
    loss, norm, _ = reference(cfg, weights[arch][1])
    assert got["loss"] == pytest.approx(loss, rel=RTOL) and got["grad_norm"] == pytest.approx(norm, rel=RTOL)
    window = open_data(cfg).train.batch(0, cfg.train.global_batch)
    inner = [len(spans(row)) for row in window[:, :-1].tolist()]
    assert sum(n > 1 for n in inner) >= 12 and sum(inner) >= 40, inner


def test_eod_mask_loss_alone_is_the_mean_over_targets_not_after_an_eod(corpus, weights, off, tmp_path):
    """eod_mask_loss alone (no document_mask, no reset_positions): step 1's loss is the
    mean of the float64 cross entropy over the global batch's targets whose input is not
    an EOD (excluded by a loop over the tokens), from the plain forward at positions
    0..S-1; the gradient norm is that loss's."""
    flags, start = weights["llama"]
    got, cfg = fit_step1(tmp_path / "run", corpus["plain"], *flags, "--data.eod_mask_loss", "true")
    assert (cfg.data.eod_mask_loss, cfg.data.document_mask, cfg.data.reset_positions) == (True, False, False)
    check(got, reference(cfg, start, keep=not_after_eod), off["llama"][0])


@pytest.mark.parametrize("arch", ARCHS)
def test_document_mask_alone_is_each_document_run_alone(corpus, weights, off, tmp_path, arch):
    """document_mask alone: each packed row's logits are each of its documents run alone
    as its own sequence at the positions it has in the row (reset_positions off: GPT-2's
    learned positions continue; for Llama's RoPE only distances matter), compared
    document by document; step 1's loss is the mean over every target of those
    documents-alone losses (the target after an EOD still counts), and the gradient norm
    is that loss's."""
    flags, start = weights[arch]
    got, cfg = fit_step1(tmp_path / "run", corpus["plain"], *flags, "--data.document_mask", "true")
    assert (cfg.data.document_mask, cfg.data.reset_positions, cfg.data.eod_mask_loss) == (True, False, False)
    want = reference(cfg, start, alone=True)
    check(got, want, off[arch][0])
    # The logits of the rows the run reads, as the run builds them (its documents, the
    # model's document attention), document by document against the documents alone.
    from meshtrain.models.context import Documents
    from meshtrain.run.rows import RowSlice

    data = open_data(cfg)
    rows = RowSlice(None, None, cfg.train.global_batch, cfg.train.seq_len).read(data.train, 0, data.eod, ("segments",))
    assert set(rows) == {"tokens", "targets", "segments"}
    with torch.no_grad():
        packed = cfg.model_def().forward(start, rows["tokens"], LocalContext(), Documents(rows["segments"], None))
    atol = RTOL * float(want[2].abs().max())  # logits near 0: sums of terms of the largest's size, in another order
    for r, row in enumerate(rows["tokens"].tolist()):
        for a, b in spans(row):
            torch.testing.assert_close(packed[r, a:b], want[2][r, a:b], rtol=RTOL, atol=atol,
                                       msg=lambda m: f"row {r}, document [{a}, {b}): {m}")


@pytest.mark.parametrize("arch", ARCHS)
def test_reset_positions_alone_is_the_row_at_positions_restarting_at_each_document(corpus, weights, off, tmp_path,
                                                                                   arch):
    """reset_positions alone (no document_mask: attention still crosses documents): step
    1's loss and gradient norm are the plain forward of each whole row with the position
    table gathered by hand at positions that restart at 0 after every EOD (a loop): GPT-2's
    learned rows, Llama's RoPE rows (which change the distances between documents)."""
    flags, start = weights[arch]
    got, cfg = fit_step1(tmp_path / "run", corpus["plain"], *flags, "--data.reset_positions", "true")
    assert (cfg.data.reset_positions, cfg.data.document_mask, cfg.data.eod_mask_loss) == (True, False, False)
    check(got, reference(cfg, start, positions=restarted_positions), off[arch][0])


def test_the_datas_loss_mask_alone_is_the_mean_over_the_targets_the_file_keeps(corpus, weights, off, tmp_path):
    """The data's loss mask alone (the three document keys off): `meshtrain preprocess
    --loss_mask_key` wrote <prefix>.loss_mask.bin; step 1's loss is the mean of the
    float64 cross entropy over the global batch's targets whose byte in that file is 1
    (the file read with numpy, each row found in the .bin's tokens read with numpy). The
    same text preprocessed without the key (the run with every key off) trains on every
    target: a different loss."""
    flags, start = weights["llama"]
    got, cfg = fit_step1(tmp_path / "run", corpus["masked"], *flags)
    assert not (cfg.data.document_mask or cfg.data.reset_positions or cfg.data.eod_mask_loss)
    # The run with every key off read the same tokens without a mask.
    assert Path(f"{corpus['plain']}.bin").read_bytes() == Path(f"{corpus['masked']}.bin").read_bytes()
    assert not Path(f"{corpus['plain']}.loss_mask.bin").exists()
    # The files by hand: BOS, the text's UTF-8 bytes, EOD per line; one byte of mask per token.
    n_tokens = sum(len(line["text"].encode()) + 2 for line in corpus["lines"])
    raw = Path(f"{corpus['masked']}.bin").read_bytes()
    assert len(raw) % n_tokens == 0
    stream = np.frombuffer(raw, dtype=np.dtype(f"<u{len(raw) // n_tokens}")).astype(np.int64)
    mask = np.fromfile(f"{corpus['masked']}.loss_mask.bin", dtype=np.uint8)
    assert mask.shape == (n_tokens,) and set(np.unique(mask).tolist()) == {0, 1}
    seq = cfg.train.seq_len
    window = open_data(cfg).train.batch(0, cfg.train.global_batch)
    keeps = []
    for r, sample in enumerate(window.numpy()):
        at = [k for k in range(0, n_tokens - seq, seq) if np.array_equal(stream[k:k + seq + 1], sample)]
        assert len(at) == 1, (r, at)
        keeps.append([bool(m) for m in mask[at[0] + 1:at[0] + seq + 1]])  # the targets' bytes
    want = reference(cfg, start, keep=keeps, window=window)
    kept = sum(map(sum, keeps))
    assert 0.2 < kept / window[:, 1:].numel() < 0.8, kept
    check(got, want, off["llama"][0])
