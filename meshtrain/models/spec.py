"""Parameter specs and layout-invariant initialisation.

A parameter's initial values depend only on (seed, name, shape): rows are generated in
fixed blocks whose boundaries depend on the shape alone, each block from its own
generator seeded by a hash of (seed, name, block). A rank can therefore materialise any
slice of a parameter without generating the rest, and every layout and world size
sees bitwise the same full tensor.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

# Elements per generated block: large enough to amortise generator setup, small enough
# that a rank holding a thin slice does not generate much it then throws away.
_BLOCK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class ParamSpec:
    """Shape, dtype, init rule and one logical axis name per dim.

    init: "normal" (mean 0, std `std`), "ones" or "zeros".
    units: per dim, how many consecutive elements must stay on one shard (head_dim for
    a dim that packs heads), so a layout can only split whole heads.
    reused: the forward uses this parameter at more than one place (a tied embedding), so
    a runtime that gathers parameters should gather it once and keep it for the forward.
    trainable: False for state the step updates itself (the aux-free expert bias): no
    gradient, no optimizer moments.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"
    std: float = 0.02
    dtype: torch.dtype = torch.float32
    units: tuple[int, ...] | None = None
    reused: bool = False
    trainable: bool = True

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")
        if self.units is None:
            object.__setattr__(self, "units", (1,) * len(self.shape))
        if self.init not in ("normal", "ones", "zeros"):
            raise ValueError(f"unknown init rule {self.init!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def rows_per_block(shape: tuple[int, ...]) -> int:
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, _BLOCK_ELEMENTS // max(row, 1))


def init_slice(spec: ParamSpec, name: str, seed: int, index: tuple[slice, ...] | None = None,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Values of `spec[index]` (each slice has step 1), identical whatever slice is asked."""
    shape = spec.shape
    index = tuple(index or ()) + tuple(slice(0, n) for n in shape[len(index or ()):])
    local_shape = tuple(s.stop - s.start for s in index)
    if spec.init != "normal" or 0 in local_shape:
        fill = 1.0 if spec.init == "ones" else 0.0
        return torch.full(local_shape, fill, dtype=spec.dtype, device=device)
    if not shape:  # scalar parameter
        g = torch.Generator().manual_seed(_block_seed(seed, name, 0))
        return (torch.randn((), generator=g) * spec.std).to(spec.dtype).to(device)
    rows, rest = index[0], index[1:]
    row_shape = shape[1:]
    per_block = rows_per_block(shape)
    pieces = []
    for block in range(rows.start // per_block, (max(rows.stop, rows.start + 1) - 1) // per_block + 1):
        lo = block * per_block
        n = min(per_block, shape[0] - lo)
        g = torch.Generator().manual_seed(_block_seed(seed, name, block))
        values = torch.randn((n, *row_shape), generator=g)
        start, stop = max(rows.start, lo) - lo, min(rows.stop, lo + n) - lo
        pieces.append(values[(slice(start, stop), *rest)])
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return (out * spec.std).to(spec.dtype).to(device).contiguous()
