"""What a step computes in: the dispatch-level recorder of tests/test_precision.py and
tests/test_deepseek_v3.py; the batches a reduced-precision run learns from, and the
tolerance it tracks fp32 within (tests/test_precision.py, tests/test_fp16.py)."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .equivalence import BATCH, CFG, SEQ

# Measured (this CPU, torch 2.13) as the largest |loss - fp32 loss| / fp32 loss over the 6
# steps of test_precision: bf16 2.7e-4, fp8 tensorwise 3.6e-4, fp8 rowwise 4.5e-4; a bf16
# run that never updates sits 0.166 from the fp32 curve. Tolerances: 3-4x the measured
# difference, over 100x below the non-training distance.
BF16_RTOL = 1e-3


def counting_batches(micro_steps: int = 1, steps: int = 6):
    """Sequences that count up by one (the next token is a function of the current one), so
    a run learns; test_equivalence's random tokens barely move a short curve."""
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        start = torch.randint(0, CFG.vocab_size, (BATCH, 1), generator=g)
        t = (start + torch.arange(SEQ + 1)) % CFG.vocab_size  # the next token is this one + 1
        t = t.reshape(micro_steps, BATCH // micro_steps, SEQ + 1)
        yield {"tokens": t[..., :-1], "targets": t[..., 1:]}


class ComputeDtypes(TorchDispatchMode):
    """Counts (op, operand dtypes) for the GEMMs, attention and embedding lookups, and
    (collective, dtype) for every c10d functional op issued."""

    OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "embedding", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_flash_attention_for_cpu_backward"}

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.collectives: set[tuple[str, str]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("_c10d_functional::") and name != "_c10d_functional::wait_tensor":
            self.collectives.add((name.split("::")[1], str(args[0].dtype)))
        op = func.overloadpacket.__name__
        if op in self.OPS:
            self.ops[(op, tuple(str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, torch.Tensor)))] += 1
        return func(*args, **(kwargs or {}))
