"""What context parallelism's block kernels (parallel/cp_blocks.py) achieve on this device,
measured for `meshtrain calibrate` (the Hardware's `block_attention`): the work one rank of
cp 2's ring does for a sequence (its own causal block of half the sequence, then the
earlier half block), forward and backward, over the causal FLOPs it stands for (half the
sequence's: zigzag shares them evenly). On CUDA in half precision the blocks are the flash
kernel's; elsewhere (a CPU, fp32) the unfused path that materialises each block's scores."""

from __future__ import annotations

import torch

from ..estimate.calibrate import TORCH_DTYPES, MIN_SAMPLE_S, attention_flops, median_seconds
from ..parallel.cp_blocks import _acc, _attend, _attend_backward, _running


def measure_block_attention(device: torch.device, dtypes, seqs, repeats: int, heads: int = 4,
                            head_dim: int = 64, lockstep: bool = False) -> list[list]:
    """[seq, dtype, TFLOP/s] of cp 2's ring work on rank 0 (module docstring)."""
    out = []
    for dtype in dtypes:
        for seq in seqs:
            local, c = seq // 2, seq // 4
            q, k, v, k2, v2, dout = (torch.randn(1, local, heads, head_dim, device=device,
                                                 dtype=TORCH_DTYPES[dtype]) for _ in range(6))
            # rank 0 of 2: its own block (causal over its zigzag positions), then rank 1's
            # block, which only its later chunk follows
            own, later = [(slice(None), slice(None), True)], [(slice(c, None), slice(None), False)]

            def step():
                o, lse = _running(q)
                _attend(q, k, v, own, o, lse)
                _attend(q, k2, v2, later, o, lse)
                dq = torch.zeros(q.shape, dtype=_acc(q.dtype), device=device)
                for kk, vv, pieces in ((k, v, own), (k2, v2, later)):
                    dkv = torch.zeros((2,) + kk.shape, dtype=dq.dtype, device=device)
                    _attend_backward(dout, q, kk, vv, o.to(q.dtype), lse, pieces, dq, dkv)

            seconds = median_seconds(step, device, repeats, lockstep=lockstep, min_sample_s=MIN_SAMPLE_S)
            out.append([seq, dtype, attention_flops(heads, seq, head_dim) / 2 / seconds / 1e12])
    return out
