"""Property tests for the index arithmetic (issue 40, item 2): attention tiles and windows,
zigzag chunks, segment ids / positions / EOD loss masks, packed sample boundaries,
micro-batch rows and pipeline stages, parameter buckets.

Each property is checked over generated layouts -- exhaustive small enumerations and
seeded random draws (deterministic) -- against a dense or naive reference written here,
by hand, never with the helper the code itself uses. The layouts include the adversarial
ones: document spans of k x tile +- 1 (k a power of two and not), documents of one
token (and, packed, of none), documents crossing every kind of boundary (tile, window,
zigzag chunk, sample, row and micro-batch), bucket sizes at, one byte under and one over
a run of parameters.

Run time: ~8 s on a two-core box (one intra-op thread; `--durations=0`).
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from meshtrain.models import attention as attn


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread: these are many small ops, which two contending threads on a
    shared two-core box slow ~20x."""
    yield


# ----------------------------------------------------------------------------- layouts


def _segments(lengths: list[int], seq: int) -> list[int]:
    """Document ids of a row packed with documents of these lengths (cut at `seq`)."""
    ids = [d for d, n in enumerate(lengths) for _ in range(n)][:seq]
    assert len(ids) == seq, (lengths, seq)
    return ids


def _compositions(seq: int) -> torch.Tensor:
    """(2^(seq-1), seq): the segment ids of every way of cutting a row of `seq` tokens into
    documents (bit i of the row's index: a document starts at position i + 1)."""
    bits = (torch.arange(2 ** (seq - 1))[:, None] >> torch.arange(seq - 1)) & 1
    return torch.cat([torch.zeros(len(bits), 1, dtype=torch.long), bits.cumsum(1)], 1)


def _one_document_anywhere(seq: int):
    """One document [s, e) for every 0 <= s < e <= seq, the rest of the row documents of
    one token: every span from a tile back to a document's start occurs, and decides the
    window (the 1-token documents need one tile)."""
    for s in range(seq):
        for e in range(s + 1, seq + 1):
            yield [1] * s + [e - s] + [1] * (seq - e)


def _adversarial_lengths(tile: int, seq: int, rng: random.Random) -> list[int]:
    """Random document lengths drawn mostly from k x tile + {-1, 0, +1} (k = 1, 2, 3, 4
    mostly, up to seq / tile at times) and 1-token documents, the rest uniform."""
    out, total = [], 0
    while total < seq:
        kind = rng.random()
        if kind < 0.6:
            k = rng.choice((1, 1, 2, 2, 3, 4, rng.randint(1, max(1, seq // tile))))
            n = k * tile + rng.choice((-1, 0, 1))
        elif kind < 0.8:
            n = 1
        else:
            n = rng.randint(1, seq)
        n = max(1, n)
        out.append(n)
        total += n
    return out


def _dense_mask(segments: torch.Tensor) -> torch.Tensor:
    """The reference, by hand: (batch, seq, seq) bool, query q sees key k when both are in
    one document and k is not after q."""
    seq = segments.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return (segments[:, :, None] == segments[:, None, :]) & causal


def _needed_spans(segments: torch.Tensor, tile: int) -> torch.Tensor:
    """By hand, from the dense mask: per row, the most keys any tile of `tile` queries must
    look back over, from the tile's last position back to the first key any of its
    queries sees (rows of whole tiles)."""
    batch, seq = segments.shape
    ends = (torch.arange(seq // tile) + 1) * tile
    spans = []
    for rows in segments.split(max(1, 2 ** 22 // seq ** 2)):  # a few MB of mask at a time
        first = _dense_mask(rows).to(torch.uint8).argmax(-1)  # each query's first visible key (itself at worst)
        spans.append((ends - first.view(len(rows), seq // tile, tile).min(-1).values).max(-1).values)
    return torch.cat(spans)


def _round_up_pow2(span: int, tile: int) -> int:
    """tile x the least power of two with tile x 2^j >= span (j >= 0), by integer bits."""
    k = max(1, -(-span // tile))  # tiles, rounded up
    return tile * (1 << (k - 1).bit_length())


def _attended_through_window(segments: torch.Tensor, window: int, tile: int) -> torch.Tensor:
    """(batch, seq, seq) bool: which keys each query attends in windowed_document_attention,
    read from the code's window_mask (key j of tile t's window is position
    (t + 1) x tile - window + j); asserts that no key before the row is attended."""
    batch, seq = segments.shape
    n = seq // tile
    wm = attn.window_mask(segments, window, torch.float64, tile)
    assert wm.shape == (batch * n, 1, tile, window)
    sees = (wm == 0).view(batch, n, tile, window)
    assert not (wm.isnan().any() or (wm > 0).any())
    out = torch.zeros(batch, seq, seq, dtype=torch.bool)
    for t in range(n):
        keys = torch.arange(window) + (t + 1) * tile - window
        inside = keys >= 0
        assert not sees[:, t][..., ~inside].any(), "a key before the row is attended"
        out[:, t * tile:(t + 1) * tile, keys[inside]] = sees[:, t][..., inside]
    return out


def _reference_attention(q, k, v, segments):
    """Dense masked attention by hand (fp64): softmax(q k^T / sqrt(d) + mask) v, GQA by
    repeating each kv head over its group of query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~_dense_mask(segments)[:, None], float("-inf"))
    return scores.softmax(-1) @ v


# ------------------------------------------------------------------- tiles and windows

def _by_span(tile: int, segments: torch.Tensor):
    """`segments` rows in batches of one needed span each (so a batch's window is each of
    its rows' own: a window too short for one span is not hidden by a longer row)."""
    spans = _needed_spans(segments, tile)
    for span in spans.unique().tolist():
        yield tile, segments[spans == span]


def _window_layouts():
    """(tile, segments) batches the window properties run over: every composition of a row
    of 16 tokens at tile 2 and at tile 4 (32,768 rows each), one document at every (start,
    end) of rows of 32 (tile 4) and 64 (tile 8) (528 and 2,080 rows), all in batches of
    one needed span; and 1,000 seeded adversarial batches of 1-3 rows each."""
    rows16 = _compositions(16)
    for tile in (2, 4):
        yield from _by_span(tile, rows16)
    for tile, seq in ((4, 32), (8, 64)):
        yield from _by_span(tile, torch.tensor([_segments(r, seq) for r in _one_document_anywhere(seq)]))
    rng = random.Random(40)
    for tile, seq in ((4, 32), (4, 48), (8, 64), (8, 128), (4, 36)):
        for _ in range(200):
            yield tile, torch.tensor([_segments(_adversarial_lengths(tile, seq, rng), seq)
                                      for _ in range(rng.randint(1, 3))])


def _window_violations(layouts, first_only: bool = False) -> list[str]:
    """The window property over `layouts`: for every query, the keys windowed attention
    attends (through the window document_window chose and window_mask) are exactly its own
    document's keys at or before it; a description of each batch where they are not (only
    the first found with `first_only`)."""
    bad = []
    for tile, segments in layouts:
        seq = segments.shape[1]
        window = attn.document_window(segments, tile)
        dense = _dense_mask(segments)
        if window == 0:  # plain causal: right only when every row is one document
            ok = bool(dense.equal(torch.ones(seq, seq, dtype=torch.bool).tril().expand_as(dense)))
        elif window is None:  # one dense mask: only where no window of tile x 2^j < seq would do
            ok = bool(attn.document_mask(segments)[:, 0].equal(dense)) and (
                seq % tile != 0 or seq <= tile or _round_up_pow2(int(_needed_spans(segments, tile).max()), tile) >= seq)
        else:
            ok = bool(_attended_through_window(segments, window, tile).equal(dense))
        if not ok:
            bad.append(f"tile {tile}, {len(segments)} rows like {segments[0].tolist()}: window {window}, needed "
                       f"span {int(_needed_spans(segments, tile).max()) if seq % tile == 0 else '-'}")
            if first_only:
                break
    return bad


def test_the_window_attends_exactly_each_querys_document():
    """For every query, every key of its own document at or before it lies inside the
    window document_window chose for its tile, and no other key (nor one before the row)
    is attended -- window_mask against the dense document mask built here; 0 (plain
    causal) only when every row is one document; None (one dense mask) only when the
    window tile x 2^j covering the needed span would reach the row. Layouts: every
    composition of 16 tokens at tile 2 and at tile 4 (2 x 32,768 rows), one document at
    every (start, end) of rows of 32 at tile 4 and 64 at tile 8 (2,608 rows), 1,000 seeded
    adversarial batches of 1-3 rows (documents of k x tile +- 1 and of 1 token)."""
    bad = _window_violations(_window_layouts())
    assert not bad, f"{len(bad)} batches, e.g. " + "; ".join(bad[:5])


def _default_tile_layouts():
    """Rows of 1,024 tokens at the real tile (128): one document starting at 0 or at
    k x 128 + {-1, 0, 1} (k = 1, 2, 3) and ending 1, 127, 128, 129, 255, 256, 257, 511,
    512 or 513 tokens later (or at the row's end), the rest documents of one token (and,
    for starts k x 128 + 1, also a row whose other documents are 128 long), in batches of
    one needed span."""
    seq, tile = 1024, attn.TILE
    rows = []
    for s in (0, 127, 128, 129, 255, 256, 257, 383, 384, 385):
        for n in (1, 127, 128, 129, 255, 256, 257, 511, 512, 513, seq - s):
            if s + n <= seq:
                rows.append(_segments([1] * s + [n] + [1] * (seq - s - n), seq))
                if s % tile == 1:
                    rows.append(_segments([s] + [n] + [tile] * 8, seq))
    segments = torch.tensor(rows)
    spans = _needed_spans(segments, tile)
    for span in spans.unique().tolist():
        yield tile, segments[spans == span]


def test_the_window_attends_exactly_each_querys_document_at_the_real_tile():
    """The same property at TILE = 128 and rows of 1,024 (what a compiled step uses):
    documents starting at k x 128 + {-1, 0, 1}, of lengths around 128 x 2^j
    (143 rows, in batches of one needed span)."""
    bad = _window_violations(_default_tile_layouts())
    assert not bad, f"{len(bad)} batches, e.g. " + "; ".join(bad[:5])


def test_the_window_is_the_needed_span_rounded_up_to_tile_times_a_power_of_two():
    """document_window is the least tile x 2^j covering the most keys any tile needs (so
    a compiled graph meets few windows, none longer than needed): over the layouts of the
    window property, against the span read from the dense mask here."""
    for tile, segments in itertools.chain(_window_layouts(), _default_tile_layouts()):
        seq = segments.shape[1]
        window = attn.document_window(segments, tile)
        if all(len(set(row.tolist())) == 1 for row in segments):
            assert window == 0
        elif seq % tile or seq <= tile:
            assert window is None
        else:
            want = _round_up_pow2(int(_needed_spans(segments, tile).max()), tile)
            assert window == (want if want < seq else None), (tile, segments.tolist())


def test_window_for_rounds_up_to_tile_times_a_power_of_two():
    """window_for(span, seq, tile) is the least tile x 2^j >= span, None when that is >= seq:
    every span 0..seq + tile for tiles 1, 2, 3, 4, 8, 128 and seq 1..16 tiles (22,288
    cases), against integer bit arithmetic here."""
    for tile in (1, 2, 3, 4, 8, 128):
        for tiles in range(1, 17):
            seq = tile * tiles
            for span in range(0, seq + tile + 1):
                want = _round_up_pow2(span, tile)
                assert attn.window_for(span, seq, tile) == (want if want < seq else None), (span, seq, tile)


def test_boundaries_and_tile_starts_are_each_documents_first_position():
    """_boundaries marks exactly the positions whose document differs from the one before
    (and position 0); _tile_starts gives, per tile, the first position of the document of
    the tile's first query -- by a loop over tokens, for every composition of 12 tokens at
    tiles 1, 2, 3, 4, 5 and 12 (2,048 rows each, the last tile partial where 12 is not a
    multiple)."""
    rows = _compositions(12)
    want_first, want_start = [], []
    for row in rows.tolist():
        first, start = [], []
        for i, d in enumerate(row):
            first.append(i == 0 or row[i - 1] != d)
            start.append(i if first[-1] else start[-1])
        want_first.append(first)
        want_start.append(start)
    want_first, want_start = torch.tensor(want_first), torch.tensor(want_start)
    got_first = attn._boundaries(rows)
    assert got_first.equal(want_first)
    for tile in (1, 2, 3, 4, 5, 12):
        assert attn._tile_starts(rows, got_first, tile).equal(want_start[:, ::tile]), tile


def _tile_layouts():
    """(tile, segments) for the eager tiles: every composition of 10 tokens at tiles 3 and 4
    (the last tile partial) and 5, one document at every (start, end) of 24 at tile 4, and
    200 seeded adversarial rows of 20-40 tokens at tiles 4 and 8."""
    rows10 = _compositions(10)
    for tile in (3, 4, 5):
        yield tile, rows10
    yield 4, torch.tensor([_segments(r, 24) for r in _one_document_anywhere(24)])
    rng = random.Random(41)
    for _ in range(200):
        tile, seq = rng.choice((4, 8)), rng.randint(20, 40)
        yield tile, torch.tensor([_segments(_adversarial_lengths(tile, seq, rng), seq)])


def test_each_eager_tile_attends_exactly_its_queries_documents():
    """tile_masks: tile t holds queries [t x tile, min(seq, (t + 1) x tile)); its first key
    lo is the first position of its first query's document (every key its queries see is
    at or after lo, and its first query sees lo); its mask is 0 exactly where the dense
    document mask built here is true, -inf elsewhere. 3,572 rows (the eager tiles' layouts)."""
    for tile, segments in _tile_layouts():
        seq = segments.shape[1]
        dense = _dense_mask(segments)
        tiles = attn.tile_masks(segments, torch.float64, tile)
        assert len(tiles) == len(segments)
        for b, row in enumerate(tiles):
            assert [(a, e) for a, e, _, _ in row] == [(a, min(seq, a + tile)) for a in range(0, seq, tile)]
            for a, e, lo, mask in row:
                assert not dense[b, a:e, :lo].any(), (tile, segments[b].tolist(), a, lo)  # nothing seen is cut off
                assert dense[b, a, lo], (tile, segments[b].tolist(), a, lo)  # and lo is needed
                assert mask.shape == (1, 1, e - a, e - lo)
                assert set(mask.unique().tolist()) <= {0.0, float("-inf")}
                assert (mask[0, 0] == 0).equal(dense[b, a:e, lo:e]), (tile, segments[b].tolist(), a)


def _attention_layouts():
    """28 layouts for the attention outputs: hand-picked spans just past a power of two
    times the tile, a row of one document beside one of 1-token documents, and seeded
    batches of 1-2 rows of 32 and 64 tokens at tiles 4 and 8 (two in three of short
    documents, so the window is shorter than the row)."""
    rng = random.Random(42)
    out = [(4, torch.tensor([_segments([1, 9, 22], 32)])),  # span 9 = 2 x 4 + 1 from the tile ending at 12
           (4, torch.tensor([_segments([3, 17, 12], 32)])),  # span 17 = 4 x 4 + 1
           (8, torch.tensor([_segments([7, 17, 40], 64)])),  # span 17 = 2 x 8 + 1
           (8, torch.tensor([_segments([64], 64), _segments([1] * 64, 64)]))]  # one document; all of 1 token
    for i in range(24):
        tile, seq = rng.choice(((4, 32), (8, 64), (4, 64)))
        if i % 3:  # short documents: windows shorter than the row
            sizes = (1, tile - 1, tile, tile + 1, 2 * tile - 1, 2 * tile + 1, 4 * tile + 1)
            rows = [[rng.choice(sizes) for _ in range(seq)] for _ in range(rng.randint(1, 2))]
        else:
            rows = [_adversarial_lengths(tile, seq, rng) for _ in range(rng.randint(1, 2))]
        out.append((tile, torch.tensor([_segments(r, seq) for r in rows])))
    return out


def test_windowed_and_tiled_attention_equal_dense_masked_attention():
    """windowed_document_attention over the window document_window chooses -- and over
    every larger window tile x 2^j < seq -- and tiled_document_attention equal dense
    masked attention computed here (fp64, GQA 4 query heads over 2 kv heads, tile 4 or
    8), outputs and q/k/v gradients: 28 layouts."""
    g = torch.Generator().manual_seed(0)
    for tile, segments in _attention_layouts():
        batch, seq = segments.shape
        q = torch.randn(batch, 4, seq, 8, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(batch, 2, seq, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
        want = _reference_attention(q, k, v, segments)
        dout = torch.randn(want.shape, generator=g, dtype=torch.float64)
        want_grads = torch.autograd.grad(want, (q, k, v), dout)
        chosen = attn.document_window(segments, tile)
        windows = [] if not chosen else [w for w in (tile << j for j in range(8)) if chosen <= w < seq]
        runs = [lambda: attn.tiled_document_attention(q, k, v, segments, tile)]
        runs += [lambda w=w: attn.windowed_document_attention(q, k, v, segments, w, tile) for w in windows]
        for run in runs:
            got = run()
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), want_grads):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("plant", ["one tile short", "one power of two short", "one key short",
                                   "the last query's document"])
def test_the_window_property_catches_a_short_window(plant, monkeypatch):
    """The layouts above are adversarial enough: a window chosen one tile too short, one
    power of two too short, one key too short (the span less 1), or from the document of
    each tile's last query instead of its first, each breaks the window property on some
    of them (the class of issue 40's surviving mutant)."""
    window_for, tile_starts = attn.window_for, attn._tile_starts
    if plant == "one tile short":
        monkeypatch.setattr(attn, "window_for", lambda span, seq, tile=attn.TILE:
                            (lambda w: w if w is None else w - tile)(window_for(span, seq, tile)))
    elif plant == "one power of two short":
        monkeypatch.setattr(attn, "window_for", lambda span, seq, tile=attn.TILE:
                            (lambda w: w if w is None or w == tile else w // 2)(window_for(span, seq, tile)))
    elif plant == "one key short":
        monkeypatch.setattr(attn, "window_for", lambda span, seq, tile=attn.TILE: window_for(span - 1, seq, tile))
    else:
        monkeypatch.setattr(attn, "_tile_starts", lambda segments, first, tile:
                            tile_starts(segments, first, 1)[:, tile - 1::tile])
    assert _window_violations(itertools.chain(_window_layouts(), _default_tile_layouts()), first_only=True)


# ------------------------------------------------------------------------ zigzag chunks

def _zigzag_columns(seq: int, cp: int, r: int) -> list[int]:
    """By hand: cp rank r's positions, chunk r then chunk 2cp - 1 - r of 2cp equal chunks."""
    c = seq // (2 * cp)
    return list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))


def test_zigzag_order_gives_each_rank_chunks_i_and_2cp_minus_1_minus_i():
    """zigzag_order(seq, cp): block r of its cp equal blocks is chunks r and 2cp - 1 - r of
    the sequence, so every position is on exactly one cp rank; for cp 1..8 and every seq
    2cp x 1..6 (48 cases); every other seq up to 12 x cp (and cp 0) is refused."""
    from meshtrain.errors import ConfigError
    from meshtrain.parallel.zigzag import zigzag_order

    for cp in range(1, 9):
        for seq in range(1, 12 * cp + 1):
            if seq % (2 * cp):
                with pytest.raises(ConfigError, match="multiple of 2\\*cp"):
                    zigzag_order(seq, cp)
                continue
            perm = zigzag_order(seq, cp).tolist()
            blocks = [perm[r * seq // cp:(r + 1) * seq // cp] for r in range(cp)]
            assert blocks == [_zigzag_columns(seq, cp, r) for r in range(cp)], (seq, cp)
            assert sorted(perm) == list(range(seq))
    with pytest.raises(ConfigError):
        zigzag_order(4, 0)


def test_zigzag_segments_follow_their_tokens(monkeypatch):
    """_zigzag_segments (every cp rank's document ids side by side, from one all-gather)
    is the row's ids in zigzag order, and _natural_segments puts them back in row order:
    for cp 1..8, seq 2cp x 1..3, two rows of seeded adversarial documents each (the
    all-gather played here: rank r's shard is its hand-zigzag columns)."""
    from meshtrain.parallel import cp_exchanges as cpa

    rng = random.Random(43)
    for cp in range(1, 9):
        for seq in (2 * cp, 4 * cp, 6 * cp):
            full = torch.tensor([_segments(_adversarial_lengths(2, seq, rng), seq) for _ in range(2)])
            shards = [full[:, _zigzag_columns(seq, cp, r)] for r in range(cp)]

            def gather(out, x, group, shards=shards):
                assert group == "cp group" and any(x.equal(s) for s in shards)
                out.copy_(torch.cat(shards))

            monkeypatch.setattr(cpa, "_all_gather", gather)
            monkeypatch.setattr(cpa.dist, "get_world_size", lambda group, cp=cp: cp)
            zig = cpa._zigzag_segments(shards[cp - 1], "cp group")
            assert zig.equal(full[:, [i for r in range(cp) for i in _zigzag_columns(seq, cp, r)]]), (cp, seq)
            assert cpa._natural_segments(shards[0], "cp group", cpa.zigzag_order(seq, cp)).equal(full)


# ------------------------------------------------------ segment ids, positions, EOD masks

EOD = 3


def _by_hand(tokens: list[int], targets: list[int], eod: int):
    """One row, a token at a time: (segment ids, positions, targets with every EOD input's
    target ignored)."""
    segments, positions, masked = [], [], []
    doc, pos = 0, 0
    for t, y in zip(tokens, targets):
        segments.append(doc)
        positions.append(pos)
        masked.append(-1 if t == eod else y)
        if t == eod:  # the EOD ends its document: the next token starts the next one
            doc, pos = doc + 1, 0
        else:
            pos += 1
    return segments, positions, masked


def _token_rows(rng: random.Random):
    """Rows with EODs anywhere: every EOD pattern of 1..10 tokens (2,046 rows), and seeded
    rows of 64 with EOD densities 0, 1/64, 1/8, 1/2 and 1 (first, last, adjacent, none,
    all), each as (tokens, targets, eod)."""
    for n in range(1, 11):
        for pattern in itertools.product((False, True), repeat=n):
            tokens = [EOD if e else rng.choice((0, 1, 2, 4, 5)) for e in pattern]
            yield tokens, [rng.choice((-1, 0, 1, 4)) for _ in range(n)], EOD
    for density in (0.0, 1 / 64, 1 / 8, 0.5, 1.0):
        for eod in (0, 7):
            for _ in range(20):
                tokens = [eod if rng.random() < density else rng.choice((1, 2, 8, 9)) for _ in range(64)]
                yield tokens, [rng.randrange(-1, 10) for _ in range(64)], eod


def test_segments_positions_and_eod_masks_match_a_loop_over_tokens():
    """document_segments (the EODs before a token), document_positions (0 at the row's
    start and after every EOD) and mask_after_eod (an EOD input's target ignored; other
    targets, -1 included, kept) against a loop over the tokens, on 2,246 rows with EODs
    anywhere; the same rows batched, and in (2, n, seq) stacks, give the same rows."""
    from meshtrain.data.documents import document_positions, document_segments, mask_after_eod

    rng = random.Random(44)
    by_shape: dict[tuple[int, int], list] = {}
    for tokens, targets, eod in _token_rows(rng):
        want = _by_hand(tokens, targets, eod)
        t, y = torch.tensor([tokens]), torch.tensor([targets])
        got = (document_segments(t, eod), document_positions(t, eod), mask_after_eod(t, y, eod))
        assert [g[0].tolist() for g in got] == list(want), (tokens, eod)
        by_shape.setdefault((len(tokens), eod), []).append((tokens, targets, want))
    for (n, eod), rows in by_shape.items():  # each length's rows as one (rows, seq) batch and (2, rows / 2, seq)
        t, y = torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])
        want = [torch.tensor([r[2][i] for r in rows]) for i in range(3)]
        for shape in ([len(rows), n], [2, len(rows) // 2, n]) if len(rows) % 2 == 0 else ([len(rows), n],):
            assert document_segments(t.view(shape), eod).equal(want[0].view(shape))
            assert document_positions(t.view(shape), eod).equal(want[1].view(shape))
            assert mask_after_eod(t.view(shape), y.view(shape), eod).equal(want[2].view(shape))


# ------------------------------------------------- micro-batch rows, columns and stages

class _Cells:
    """A data source whose token at (sample s, column c) is 1000 + s x (seq + 1) + c:
    which cells a rank read, read back from its tokens."""

    def __init__(self, seq: int):
        self.seq = seq

    def batch(self, start: int, count: int) -> torch.Tensor:
        s = torch.arange(start, start + count)[:, None]
        return 1000 + s * (self.seq + 1) + torch.arange(self.seq + 1)

    def loss_mask(self, start: int, count: int):
        return None


class _Table:
    """A data source of seeded tokens with many EODs and a seeded loss mask."""

    def __init__(self, samples: int, seq: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, 6, (samples, seq + 1), generator=g)  # EOD = 3: one token in six
        self.mask = torch.rand(samples, seq + 1, generator=g) < 0.8

    def batch(self, start: int, count: int) -> torch.Tensor:
        return self.tokens[start:start + count]

    def loss_mask(self, start: int, count: int) -> torch.Tensor:
        return self.mask[start:start + count]


def _layouts():
    """(parallel sizes, world) of the micro-batch layouts: one process, dp, fsdp, HSDP,
    cp 2/4/8 alone and beside dp, fsdp and tp, tp, pp 2/4 beside dp, fsdp, cp, interleaved."""
    return [({}, 1), ({"dp": 2}, 2), ({"fsdp": 4}, 4), ({"dp": 2, "fsdp": 2}, 4), ({"dp": 2, "fsdp": 4}, 8),
            ({"cp": 2}, 2), ({"cp": 4}, 4), ({"cp": 8}, 8), ({"fsdp": 2, "cp": 2}, 4), ({"dp": 2, "cp": 4}, 8),
            ({"fsdp": 2, "cp": 2, "tp": 2}, 8), ({"tp": 2}, 2), ({"fsdp": 2, "tp": 2}, 4),
            ({"pp": 2}, 2), ({"pp": 4}, 4), ({"pp": 2, "dp": 2}, 4), ({"pp": 2, "fsdp": 2, "cp": 2}, 8),
            ({"pp": 2, "pp_virtual": 2, "pp_schedule": "interleaved", "fsdp": 2}, 4)]


def _rank_batches(sizes: dict, world: int, micro_batch: int, accumulation: int, start: int):
    """Per rank: (its mesh coordinates by axis, the micro-step count, the cells (sample,
    column) of each micro-step it reads, and each micro-step's tokens, targets, segments
    and positions from a seeded table), through the run's own reader (`_Run._batch` over
    the RowSlice build_run makes)."""
    import types

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshtrain.config import RunConfig
    from meshtrain.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
    from meshtrain.pipeline import partition
    from meshtrain.run.fit import _Run
    from meshtrain.run.rows import RowSlice
    from meshtrain.train.pipeline_step import local_stage_layout

    p = {"fsdp": 1, **sizes}
    dp_size = p.get("dp", 1) * p["fsdp"]
    cp, seq = p.get("cp", 1), 6 * p.get("cp", 1)
    global_batch = micro_batch * dp_size * accumulation
    cfg = RunConfig(model=ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                                      max_seq_len=64),
                    parallel=ParallelConfig(**p), train=TrainConfig(global_batch=global_batch, micro_batch=micro_batch,
                                                                    seq_len=seq),
                    data=DataConfig(document_mask=True, reset_positions=True, eod_mask_loss=True))
    plan = cfg.plan(world)
    m = cfg.accumulation_steps(plan.mesh.dp * plan.mesh.fsdp)  # as _Run.__init__
    micro_rows = global_batch // m
    table = _Table(start + global_batch, seq, seed=world * 100 + accumulation)
    out = []
    for rank in range(world):
        if world > 1:
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = plan.mesh.build() if world > 1 else None
            coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())) if mesh is not None else {}
            if plan.mesh.pp > 1:  # as build_run
                stages = partition(cfg.model_def(), plan.mesh.pp, cfg.parallel.pp_virtual, None, seq_len=seq,
                                   micro_batch=micro_batch)
                _, sub_plan, sub_mesh = local_stage_layout(plan, mesh, stages)
                rows = RowSlice(sub_plan, sub_mesh, micro_rows, seq)
            else:
                rows = RowSlice(plan, mesh, micro_rows, seq)
            run = types.SimpleNamespace(cfg=cfg, accumulation=m, micro_rows=micro_rows, rows=rows,
                                        data=types.SimpleNamespace(eod=EOD, loss_mask=True),
                                        device=torch.device("cpu"))
            local = lambda x: x.to_local() if hasattr(x, "to_local") else x  # noqa: E731
            cells = [local(t) - 1000 for t in _Run._batch(run, _Cells(seq), start)["tokens"]]
            cells = [(t // (seq + 1), t % (seq + 1)) for t in cells]
            read = {k: [local(t) for t in v] for k, v in _Run._batch(run, table, start).items()
                    if k in ("tokens", "targets", "segments", "positions")}
        finally:
            if world > 1:
                dist.destroy_process_group()
        out.append((coords, m, cells, read))
    return out, table, seq, cp, global_batch, micro_rows


@pytest.mark.parametrize("sizes,world", _layouts(),
                         ids=[f"{'x'.join(f'{k}{v}' for k, v in s.items()) or 'one'}-{w}" for s, w in _layouts()])
def test_every_cell_of_a_global_batch_is_read_once_per_model_replica(sizes, world):
    """A global batch of B samples splits into B / (micro_batch x dp x fsdp) micro-steps of
    consecutive samples; in each, every sample row is read by exactly one data-parallel
    (dp x fsdp) rank, and every column of it by exactly one cp rank -- rank r its zigzag
    chunks r and 2cp - 1 - r -- while tp and pp peers read the same cells; the tokens,
    targets (loss mask, then EOD mask), segments and positions each rank gets are those of
    its cells, found on the whole rows (by hand here). 18 layouts x 3 (micro_batch,
    micro-steps) pairs (1 for interleaved, which needs micro-steps a multiple of pp),
    starting mid-stream."""
    for micro_batch, accumulation in ((1, 1), (2, 3), (3, 2)):
        if sizes.get("pp_schedule") == "interleaved" and accumulation % sizes["pp"]:
            continue
        start = 7 * micro_batch + 1
        ranks, table, seq, cp, global_batch, micro_rows = _rank_batches(sizes, world, micro_batch, accumulation,
                                                                         start)
        dp_size = sizes.get("dp", 1) * sizes.get("fsdp", 1)
        assert all(m == global_batch // (micro_batch * dp_size) == accumulation for _, m, _, _ in ranks)
        assert micro_rows == micro_batch * dp_size
        axes = ("dp", "fsdp", "cp", "tp", "pp")
        for step in range(accumulation):
            lo = start + step * micro_rows
            by_replica: dict = {}  # (tp, pp) coordinates -> the cells read there
            by_cells: dict = {}  # (dp, fsdp, cp) coordinates -> what was read there
            for coords, _, cells, read in ranks:
                c = {a: coords.get(a, 0) for a in axes}
                samples, columns = cells[step]
                assert samples.shape == (micro_batch, seq // cp)
                assert (samples == samples[:, :1]).all()  # whole rows ...
                assert (columns == columns[:1]).all()  # ... and the same columns in each
                cols = _zigzag_columns(seq, cp, c["cp"]) if cp > 1 else list(range(seq))
                assert columns[0].tolist() == cols, (c, columns[0].tolist())
                rows = samples[:, 0].tolist()
                assert all(lo <= s < lo + micro_rows for s in rows), (step, rows)
                by_replica.setdefault((c["tp"], c["pp"]), []).extend((s, j) for s in rows for j in cols)
                by_cells.setdefault((c["dp"], c["fsdp"], c["cp"]), []).append([read[k][step] for k in sorted(read)])
                for i, s in enumerate(rows):  # the content of its cells, by hand on the whole row
                    tokens, targets = table.tokens[s].tolist(), table.tokens[s, 1:].tolist()
                    targets = [y if keep else -1 for y, keep in zip(targets, table.mask[s, 1:].tolist())]
                    segments, positions, targets = _by_hand(tokens[:-1], targets, EOD)
                    assert read["tokens"][step][i].tolist() == [tokens[j] for j in cols]
                    assert read["targets"][step][i].tolist() == [targets[j] for j in cols]
                    assert read["segments"][step][i].tolist() == [segments[j] for j in cols]
                    assert read["positions"][step][i].tolist() == [positions[j] for j in cols]
            every = sorted((s, j) for s in range(lo, lo + micro_rows) for j in range(seq))
            for key, got in by_replica.items():
                assert sorted(got) == every, (step, key)  # each cell exactly once per model replica
            for key, reads in by_cells.items():  # tp / pp peers: the same tensors
                assert all(all(a.equal(b) for a, b in zip(r, reads[0])) for r in reads), key


def test_micro_steps_are_the_global_batch_over_micro_batch_times_data_ranks():
    """accumulation_steps(dp x fsdp) is global_batch / (micro_batch x dp x fsdp) where that
    divides, and refused where it does not; with the interleaved pipeline schedule it is
    refused too unless a multiple of pp: global_batch 1..24, micro_batch 1..4, dp x fsdp
    1..4, pp 1 and (interleaved) 2 and 3 (1,152 cases)."""
    from meshtrain.config import RunConfig
    from meshtrain.config import ParallelConfig, TrainConfig
    from meshtrain.errors import ConfigError

    for pp in (1, 2, 3):
        parallel = ParallelConfig(pp=pp, pp_virtual=2, pp_schedule="interleaved") if pp > 1 else ParallelConfig()
        for global_batch, micro_batch, data_ranks in itertools.product(range(1, 25), range(1, 5), range(1, 5)):
            cfg = RunConfig(parallel=parallel, train=TrainConfig(global_batch=global_batch, micro_batch=micro_batch))
            m, left = divmod(global_batch, micro_batch * data_ranks)
            if left or (pp > 1 and m % pp):
                with pytest.raises(ConfigError):
                    cfg.accumulation_steps(data_ranks)
            else:
                assert cfg.accumulation_steps(data_ranks) == m


def _models():
    """Small models of 1..8 layers: llama untied and tied, GPT-2 (tied, with pos_emb)."""
    from meshtrain.models import build, gpt2, llama

    for n in range(1, 9):
        yield build("llama", llama.LlamaConfig(dim=16, n_layers=n, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                               vocab_size=32, max_seq_len=16, tie_embeddings=n % 2 == 0))
    for n in (1, 3, 5):
        yield build("gpt2", gpt2.GPT2Config(dim=16, n_layers=n, n_heads=2, vocab_size=32, max_seq_len=16))


def _positive_compositions(n: int, parts: int):
    """Every list of `parts` positive integers summing to n."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def test_every_layer_is_in_exactly_one_stage_contiguous_and_in_order():
    """partition with an explicit layout (every composition of n layers into pp x v
    positive counts, n = 1..8, every pp x v <= n) and balanced (layout None): stages in
    order, each a contiguous run of layers that follows the one before, together every
    layer once, the counts the layout's; stage s on rank s % pp; every parameter owned by
    exactly one stage -- a layer's by the stage holding the layer, the embeddings by the
    first, the final norm and head by the last -- and a tied table shared by the last
    stage alone. 766 partitions of 11 models; a layout of the wrong length, with a
    count < 1 or of the wrong sum is refused."""
    from meshtrain.errors import ConfigError
    from meshtrain.pipeline.partition import partition

    cases = 0
    for model in _models():
        n, specs = model.cfg.n_layers, model.specs
        tied = "tok_emb" in specs and "output" not in specs
        for pp in range(1, n + 1):
            for v in range(1, n // pp + 1):
                for layout in [None, *_positive_compositions(n, pp * v)]:
                    stages = partition(model, pp, v, layout, seq_len=8, micro_batch=2)
                    cases += 1
                    assert [s.index for s in stages] == list(range(pp * v))
                    assert [s.rank for s in stages] == [s % pp for s in range(pp * v)]
                    assert stages[0].layers[0] == 0 and stages[-1].layers[1] == n
                    assert all(a.layers[1] == b.layers[0] for a, b in zip(stages, stages[1:]))
                    assert all(s.layers[1] > s.layers[0] for s in stages)
                    if layout is not None:
                        assert [s.layers[1] - s.layers[0] for s in stages] == layout
                    owners: dict[str, list[int]] = {}
                    for s in stages:
                        for name in s.params:
                            owners.setdefault(name, []).append(s.index)
                    assert set(owners) == set(specs) and all(len(o) == 1 for o in owners.values())
                    for name, (s,) in owners.items():
                        if name.startswith("layers."):
                            layer = int(name.split(".")[1])
                            assert stages[s].layers[0] <= layer < stages[s].layers[1], (name, s)
                        elif name in ("tok_emb", "pos_emb"):
                            assert s == 0, name
                        else:
                            assert s == pp * v - 1, name
                    assert [s.shared for s in stages] == [()] * (pp * v - 1) + [
                        ("tok_emb",) if tied and pp * v > 1 else ()]
                    assert [s.has_embedding for s in stages] == [s == 0 for s in range(pp * v)]
                    assert [s.has_head for s in stages] == [s == pp * v - 1 for s in range(pp * v)]
        bad = [(1, [n + 1]), (1, [n, 0]), (2, [n]), (2, [n + 1, -1])] + ([(2, [0, n]), (2, [1, n - 2])]
                                                                          if n > 1 else [])
        for pp, layout in bad:
            with pytest.raises(ConfigError):
                partition(model, pp, 1, layout, seq_len=8, micro_batch=2)
    assert cases == 766


def test_every_stage_runs_every_micro_batch_once_forward_and_once_backward():
    """build_pipeline_schedule for gpipe, 1f1b, zb (pp 1..6, m 1..10) and interleaved
    (pp 1..4, v 2..3, m a multiple of pp up to 12): on rank r only its stages r, r + pp, ...;
    each stage runs each micro-batch 0..m-1 forward once, and backward once (B, or BI and
    then BW), after its forward; micro-batches in order within each kind; forward_only
    runs each once forward. ~220 schedules."""
    from meshtrain.pipeline.schedule import COMPUTE, build_pipeline_schedule, forward_only

    cases = []
    for name in ("gpipe", "1f1b", "zb"):
        cases += [(name, pp, m, 1) for pp in range(1, 7) for m in range(1, 11)]
    cases += [("interleaved", pp, m, v) for pp in range(1, 5) for v in (2, 3) for m in range(pp, 13, pp)]
    for name, pp, m, v in cases:
        sched = build_pipeline_schedule(name, pp, m, v)
        assert (sched.pp, sched.v, sched.m, len(sched.ranks)) == (pp, v, m, pp)
        for r, actions in enumerate(sched.ranks):
            compute = [(a.kind, a.stage, a.micro) for a in actions if a.kind in COMPUTE]
            assert {s for _, s, _ in compute} == set(range(r, pp * v, pp)), (name, pp, m, v, r)
            for s in range(r, pp * v, pp):
                kinds = {k: [i for kk, ss, i in compute if kk == k and ss == s] for k in ("F", "B", "BI", "BW")}
                assert kinds["F"] == list(range(m)), (name, pp, m, v, s)
                if name == "zb":
                    assert kinds["B"] == [] and kinds["BI"] == list(range(m)) and kinds["BW"] == list(range(m))
                else:
                    assert kinds["B"] == list(range(m)) and kinds["BI"] == kinds["BW"] == []
                at = {(k, i): n for n, (k, ss, i) in enumerate(compute) if ss == s}
                for i in range(m):
                    back = at.get(("B", i), at.get(("BI", i)))
                    assert at[("F", i)] < back and at.get(("BW", i), back) >= back
        fwd = forward_only(pp, v, m)
        for r, actions in enumerate(fwd.ranks):
            compute = sorted((a.stage, a.micro) for a in actions if a.kind in COMPUTE)
            assert compute == [(s, i) for s in range(r, pp * v, pp) for i in range(m)]


# ------------------------------------------------------------ packed sample boundaries

def _document_lengths(seq_len: int):
    """Every list of up to 3 documents of lengths 0, 1, seq_len - 1, seq_len, seq_len + 1
    and 2 x seq_len + 1 (empty, 1-token, around a sample, longer than two)."""
    sizes = sorted({0, 1, max(seq_len - 1, 0), seq_len, seq_len + 1, 2 * seq_len + 1})
    for n in range(1, 4):
        yield from (list(x) for x in itertools.product(sizes, repeat=n))


def test_sample_k_is_tokens_k_seq_len_to_k_seq_len_plus_seq_len_plus_1():
    """PackedDataset over documents [a, b) of an in-memory dataset: sample k is tokens
    [k x seq_len, k x seq_len + seq_len + 1) of the documents' concatenation (consecutive
    samples share one token), there are (tokens - 1) // seq_len of them, an index past
    them is refused, fewer than seq_len + 1 tokens are refused, and no loss mask means all
    True: for seq_len 1..5, every list of up to 3 documents of lengths 0, 1, about one
    sample and over two (~1,100 datasets), over every document range [a, b) of each
    (~3,500), plus 100 seeded random datasets of up to 12 documents."""
    from meshtrain.data.dataset import PackedDataset
    from meshtrain.data.errors import DataError
    from meshtrain.data.indexed import IndexedDataset

    rng = random.Random(45)
    cases = [(seq_len, lengths) for seq_len in range(1, 6) for lengths in _document_lengths(seq_len)]
    cases += [(rng.randint(1, 9), [rng.choice((0, 1, rng.randint(0, 30))) for _ in range(rng.randint(1, 12))])
              for _ in range(100)]
    checked = 0
    for seq_len, lengths in cases:
        docs, next_token = [], 1
        for n in lengths:  # every token distinct: a token read from the wrong place shows
            docs.append(list(range(next_token, next_token + n)))
            next_token += n
        source = IndexedDataset.in_memory(docs, np.int32, "generated")
        ranges = [(a, b) for a in range(len(docs) + 1) for b in range(a, len(docs) + 1)]
        for a, b in ranges if len(docs) <= 3 else [(0, len(docs)), (1, len(docs) - 1)]:
            stream = [t for d in docs[a:b] for t in d]
            if len(stream) < seq_len + 1:
                with pytest.raises(DataError, match="fewer than one sample"):
                    PackedDataset(source, seq_len, a, b)
                continue
            data = PackedDataset(source, seq_len, a, b)
            n = (len(stream) - 1) // seq_len
            assert len(data) == n, (seq_len, lengths, a, b)
            for k in range(n):
                assert data[k].tolist() == stream[k * seq_len:k * seq_len + seq_len + 1], (seq_len, lengths, a, b, k)
                assert data.loss_mask(k).tolist() == [True] * (seq_len + 1)
            assert data.samples(list(range(n))[::-1]).tolist() == [
                stream[k * seq_len:k * seq_len + seq_len + 1] for k in range(n)][::-1]
            for k in (-1, n):
                with pytest.raises(IndexError):
                    data[k]
            checked += 1
    assert checked > 2500


# ---------------------------------------------------------------------- bucket ranges

def _bucket_plans():
    """Plans, built without any process, of small models (llama of 1 and 3 layers, tied
    and not; llama with MoE blocks after the first, a shared expert and a frozen expert
    bias; GPT-2) on meshes of one rank, dp, fsdp 2 and 3 (uneven shards), HSDP, fsdp x tp
    with sp, fsdp x cp, tp, and experts folded (ep 2 of fsdp 4; ep 4 of fsdp x cp x tp)."""
    from meshtrain import MeshSpec, Rules, build, make_plan
    from meshtrain.models import gpt2, llama
    from meshtrain.models.moe import MoeConfig

    small = dict(dim=16, n_heads=2, n_kv_heads=2, ffn_dim=32, vocab_size=32, max_seq_len=16)
    moe = MoeConfig(num_experts=4, top_k=2, expert_ffn_dim=8, layers="1:", balance="aux_free", shared_experts=1)
    models = [build("llama", llama.LlamaConfig(n_layers=1, **small)),
              build("llama", llama.LlamaConfig(n_layers=3, tie_embeddings=True, **small)),
              build("llama", llama.LlamaConfig(n_layers=3, moe=moe, **small)),
              build("gpt2", gpt2.GPT2Config(dim=16, n_layers=2, n_heads=2, vocab_size=32, max_seq_len=16))]
    meshes = [(MeshSpec(), 1, False), (MeshSpec(dp=2), 2, False), (MeshSpec(fsdp=2), 2, False),
              (MeshSpec(fsdp=3), 3, False), (MeshSpec(dp=2, fsdp=2), 4, False), (MeshSpec(fsdp=2, tp=2), 4, True),
              (MeshSpec(fsdp=2, cp=2), 4, False), (MeshSpec(tp=2), 2, False)]
    for model in models:
        for mesh, world, sp in meshes:
            yield make_plan(model.specs, Rules.default(sp=sp), mesh, world=world)
    for mesh, world, sp in ((MeshSpec(fsdp=4, ep=2), 4, False), (MeshSpec(fsdp=2, cp=2, tp=2, ep=4), 8, True)):
        yield make_plan(models[2].specs, Rules.default(sp=sp), mesh, world=world)


def _hand_bytes(p) -> int:
    """A parameter's bytes as a bucket holds it, by hand: its shape with every dim split
    over a mesh axis that is not gathered (tp, ep) divided by that axis, the gathered
    (fsdp, cp) dims whole."""
    from torch.distributed.tensor import Shard

    shape = list(p.spec.shape)
    for axis, q in zip(p.mesh.axes, p.placements):
        if isinstance(q, Shard) and axis not in ("fsdp", "cp"):
            shape[q.dim] //= p.mesh.size(axis)
    return math.prod(shape) * p.spec.dtype.itemsize


def test_every_parameter_is_in_exactly_one_bucket_in_forward_order():
    """plan_buckets with unit block, param, and a size in MB around every parameter's and
    every run of 2-3 parameters' bytes (+-1 byte): every parameter in exactly one bucket
    or left to a collective of its own (only the frozen or strided ones, and all of them
    with unit param), the buckets in forward (the plan's) order, each on one mesh; block:
    a new bucket exactly where the block (the parameters before the first layer, layer i,
    those after the last) or the mesh changes; size: no bucket above the size unless it is
    one parameter, and each as full as greedy packing in order makes it (the next one's
    first parameter would not fit, or is on another mesh). 34 plans x ~50 units: 1,756 cases."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from meshtrain.layout.buckets import plan_buckets

    cases = 0
    for plan in _bucket_plans():
        order = list(plan.params)
        fixed = {n for n, p in plan.params.items()
                 if not p.spec.trainable or any(isinstance(q, _StridedShard) for q in p.placements)}
        bucketed = [n for n in order if n not in fixed]
        sizes = [_hand_bytes(plan.params[n]) for n in bucketed]
        runs = {sum(sizes[i:i + k]) for k in (1, 2, 3) for i in range(len(sizes))}
        limits = sorted({x + d for x in runs | {1, sum(sizes)} for d in (-1, 0, 1)} - {0})
        for unit in ["block", "param"] + [x / 2 ** 20 for x in limits]:
            buckets, alone = plan_buckets(plan, unit)
            cases += 1
            names = [n for b in buckets for n in b.names]
            assert sorted(names + sorted(alone)) == sorted(order) and len(set(names)) == len(names)
            assert [b.index for b in buckets] == list(range(len(buckets)))
            if unit == "param":
                assert buckets == [] and alone == set(order)
                continue
            assert alone == fixed and names == bucketed  # forward order
            assert all(plan.params[n].mesh == b.mesh for b in buckets for n in b.names)
            if unit == "block":  # by hand: where the block or the mesh changes
                want, seen_layer, key = [], False, None
                for n in bucketed:
                    parts = n.split(".")
                    block = ".".join(parts[:2]) if parts[0] == "layers" else ("after" if seen_layer else "before")
                    seen_layer = seen_layer or parts[0] == "layers"
                    if (block, plan.params[n].mesh) != key:
                        want.append([])
                        key = (block, plan.params[n].mesh)
                    want[-1].append(n)
                assert [list(b.names) for b in buckets] == want
                continue
            limit = unit * 2 ** 20
            held = [[_hand_bytes(plan.params[n]) for n in b.names] for b in buckets]
            for b, nbytes in zip(buckets, held):
                assert sum(nbytes) <= limit or len(nbytes) == 1, (unit, b.names)
                assert b.nbytes(plan) == sum(nbytes)
            for a, b, nbytes in zip(buckets, buckets[1:], held):  # greedy: the next would not fit
                assert sum(nbytes) + _hand_bytes(plan.params[b.names[0]]) > limit or a.mesh != b.mesh
    assert cases == 1756
