"""What a step computes in: the dispatch-level recorder of tests/test_precision.py and
tests/test_deepseek_v3.py."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode


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
