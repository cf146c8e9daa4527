"""Causal attention over packed documents, with work that grows with the documents'
squared lengths rather than the row's.

A query sees the keys before it in its own document. Queries are taken a tile at a
time: a tile's visible keys lie between the start of its first query's document and its
last query, so each tile attends over that span only (a dense mask inside it). For short
documents the spans are short: the cost is about tile x (document length + tile) per
tile, against sequence^2 / 2 for one causal mask over the row. The span bounds are read
on the host, so this runs eager. A compiled graph needs static shapes: there each tile
looks back over one window of keys for the whole micro-batch, the longest span rounded up
to a tile x a power of two (`document_window`, read on the host with the batch; each
window seen is a graph of its own, at most log2(seq / 128) + 1), through strided views of
the keys (`windowed_document_attention`); a window that would reach the whole row takes
one dense mask (`dense_document_attention`). All give the same numbers.

The tiles' masks are built once per micro-batch, not per layer: every layer passes the
same `key` (the batch's segments object), and the last micro-batch's masks are kept, as
additive masks in the compute dtype, so each layer's kernel keeps a reference to them for
backward rather than a converted copy of its own.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

TILE = 128  # queries per tile: long enough for the matmuls, short against a document
_LAST: list = []  # [(weakref to the key, dtype, tile, tiles)]: the last micro-batch's tile masks


def document_mask(segments: torch.Tensor, q_start: int = 0, k_start: int = 0, q_len: int | None = None,
                  k_len: int | None = None) -> torch.Tensor:
    """(batch, 1, q_len, k_len) bool: query i (position q_start + i) sees key j (position
    k_start + j) when j is not after i and both are in one segment."""
    seq = segments.shape[1]
    q_len, k_len = q_len or seq - q_start, k_len or seq - k_start
    q_seg, k_seg = segments[:, q_start:q_start + q_len], segments[:, k_start:k_start + k_len]
    qi = torch.arange(q_start, q_start + q_len, device=segments.device)
    kj = torch.arange(k_start, k_start + k_len, device=segments.device)
    return ((q_seg[:, :, None] == k_seg[:, None, :]) & (kj[None, :] <= qi[:, None]))[:, None]


def dense_document_attention(q, k, v, segments):
    """q (batch, heads, seq, head_dim), k/v (batch, kv_heads, seq, head_dim): one mask
    over the whole row."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(segments),
                                          enable_gqa=k.shape[1] != q.shape[1])


def tile_masks(segments, dtype: torch.dtype, tile: int = TILE) -> list[list[tuple[int, int, int, torch.Tensor]]]:
    """Per row, per tile of queries [a, e): (a, e, the first key lo, the (1, 1, e - a,
    e - lo) additive mask in `dtype`: 0 where the query sees the key, -inf elsewhere)."""
    batch, seq = segments.shape
    starts = _tile_starts(segments, _boundaries(segments), tile).tolist()
    rows = []
    for b in range(batch):
        tiles = []
        for t, lo in enumerate(starts[b]):
            a, e = t * tile, min(seq, (t + 1) * tile)
            sees = document_mask(segments[b:b + 1], a, lo, e - a, e - lo)
            tiles.append((a, e, lo, torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill(
                ~sees, float("-inf"))))
        rows.append(tiles)
    return rows


def _cached_tile_masks(segments, dtype, tile: int, key):
    """tile_masks of the micro-batch `key` stands for, built at its first layer."""
    if key is None:
        return tile_masks(segments, dtype, tile)
    if _LAST and _LAST[0][0]() is key and _LAST[0][1:3] == (dtype, tile):
        return _LAST[0][3]
    tiles = tile_masks(segments, dtype, tile)
    _LAST[:] = [(weakref.ref(key), dtype, tile, tiles)]
    return tiles


def tiled_document_attention(q, k, v, segments, tile: int = TILE, key=None):
    """As `dense_document_attention`, each tile of queries over its documents' span only.
    `key`: an object that stays the same for every layer of one micro-batch (and lives
    as long as it), so the masks are built once; None builds them for this call."""
    gqa = k.shape[1] != q.shape[1]
    rows = []
    for b, tiles in enumerate(_cached_tile_masks(segments, q.dtype, tile, key)):
        rows.append(torch.cat([F.scaled_dot_product_attention(q[b:b + 1, :, a:e], k[b:b + 1, :, lo:e],
                                                              v[b:b + 1, :, lo:e], attn_mask=mask, enable_gqa=gqa)
                               for a, e, lo, mask in tiles], dim=2))
    return torch.cat(rows)


def document_window(segments: torch.Tensor, tile: int = TILE) -> int | None:
    """The keys every tile of `tile` queries of these rows must look back over to see its
    documents (from its last query back to its first query's document's start), rounded
    up to `tile` x a power of two, so a compiled graph meets few distinct windows (each
    is a graph of its own); None when that is the whole row (or the row is not whole
    tiles): one dense mask then costs no more; 0 when no row holds a document boundary:
    plain causal attention. Read on the host, once per micro-batch."""
    seq = segments.shape[1]
    first = _boundaries(segments)
    if not first[:, 1:].any():
        return 0
    if seq % tile or seq <= tile:
        return None
    starts = _tile_starts(segments, first, tile)
    return window_for(int((torch.arange(tile, seq + 1, tile, device=segments.device) - starts).max()), seq, tile)


def _boundaries(segments: torch.Tensor) -> torch.Tensor:
    """(batch, seq) bool: the positions where a document starts."""
    first = torch.ones_like(segments, dtype=torch.bool)
    first[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return first


def _tile_starts(segments: torch.Tensor, first: torch.Tensor, tile: int) -> torch.Tensor:
    """(batch, tiles): where the document of each tile's first query starts (segments grow
    along a row)."""
    batch, seq = segments.shape
    index = torch.arange(seq, device=segments.device).expand(batch, seq)
    return torch.where(first, index, 0).cummax(1).values[:, ::tile]


def window_for(span: int, seq: int, tile: int = TILE) -> int | None:
    """`span` keys rounded up to `tile` x a power of two; None if that reaches `seq`."""
    window = tile
    while window < span:
        window *= 2
    return window if window < seq else None


def window_mask(segments: torch.Tensor, window: int, dtype: torch.dtype, tile: int = TILE) -> torch.Tensor:
    """(batch x tiles, 1, tile, window) additive mask of windowed_document_attention: key
    j of tile t's window is position (t + 1) x tile - window + j."""
    batch, seq = segments.shape
    n = seq // tile
    keys = F.pad(segments, (window - tile, 0), value=-1).unfold(1, window, tile)  # (batch, n, window); -1: before the row
    queries = segments.view(batch, n, tile)
    i = torch.arange(tile, device=segments.device)[:, None]
    j = torch.arange(window, device=segments.device)[None, :]
    sees = (queries[..., :, None] == keys[..., None, :]) & (j <= i + window - tile)
    return torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill(~sees, float("-inf")).flatten(0, 1)[:, None]


def windowed_document_attention(q, k, v, segments, window: int, tile: int = TILE):
    """As `dense_document_attention` with static shapes, for compiled graphs: each tile of
    `tile` queries attends over the `window` keys that end at its last query (strided
    views of the keys and values, no copies but one front padding), so the work is seq x
    window, not seq^2. `window` must cover every tile's documents (document_window)."""
    batch, heads, seq = q.shape[:3]
    n = seq // tile

    def tiles(x, size):  # heads-first (batch, h, seq) -> (batch x n, h, size, dim) windows ending at each tile
        x = F.pad(x.transpose(1, 2), (0, 0, 0, 0, size - tile, 0)) if size > tile else x.transpose(1, 2)
        return x.unfold(1, size, tile).permute(0, 1, 2, 4, 3).flatten(0, 1)

    out = F.scaled_dot_product_attention(tiles(q, tile), tiles(k, window), tiles(v, window),
                                         attn_mask=window_mask(segments, window, q.dtype, tile),
                                         enable_gqa=k.shape[1] != heads)
    dim = v.shape[-1]  # values may be narrower than queries (MLA)
    return out.view(batch, n, heads, tile, dim).permute(0, 2, 1, 3, 4).reshape(batch, heads, seq, dim)


def document_attention(q, k, v, segments, key=None, window: int | None = None):
    """Block-diagonal causal attention, heads first; tiled when eager (`key`: see
    tiled_document_attention), compiled over `window` keys per tile (document_window;
    None: one dense mask; 0: rows of one document each, plain causal attention)."""
    if window == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    if torch.compiler.is_compiling():
        if window is None:
            return dense_document_attention(q, k, v, segments)
        return windowed_document_attention(q, k, v, segments, window)
    return tiled_document_attention(q, k, v, segments, key=key)
