"""The zigzag order of a sequence split over context-parallel ranks.

With a causal mask a contiguous split would leave the first cp rank almost idle and the
last one with most of the work, so the sequence is cut into 2*cp chunks and rank r holds
chunks r and 2cp-1-r (one early, one late: every rank does the same work).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


def zigzag_order(seq_len: int, cp: int) -> torch.Tensor:
    """LongTensor perm of length seq_len: x.index_select(seq_dim, perm) puts the sequence in
    zigzag order, so that its cp equal contiguous blocks are the ranks' shards (block r = chunks
    r and 2cp-1-r). Raises ConfigError if seq_len is not a multiple of 2*cp."""
    if cp < 1 or seq_len < 1 or seq_len % (2 * cp):
        step = 2 * max(cp, 1)
        raise ConfigError(f"sequence length {seq_len} cannot be split zigzag over cp={cp}: it must be a "
                          f"multiple of 2*cp={step}; use a seq_len like {max(seq_len // step, 1) * step}")
    chunks = torch.arange(seq_len).view(2 * cp, -1)
    ranks = torch.arange(cp)
    return chunks[torch.stack([ranks, 2 * cp - 1 - ranks], 1).flatten()].flatten()
