"""Which rows and columns of each global batch this rank reads, and the DTensor it wraps
them in: the batch layout of the plan ("batch", "seq"), zigzag columns under cp."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..parallel.cp_attention import zigzag_order


class RowSlice:
    """Which rows (and columns) of a micro-batch this rank holds, from the plan's layout
    of ("batch", "seq") activations, and how to wrap them as that DTensor."""

    def __init__(self, plan, mesh, rows: int, seq_len: int):
        self.mesh, self.shape = mesh, (rows, seq_len)
        if mesh is None:
            self.offset, self.local = (0, 0), self.shape
            return
        self.placements = plan.activation(("batch", "seq")).placements
        self.local, self.offset = compute_local_shape_and_global_offset(self.shape, mesh, self.placements)
        # Positions of this rank's columns; split over cp they are its zigzag chunks.
        self.columns = torch.arange(seq_len)
        if "cp" in plan.mesh.axes:
            self.columns = zigzag_order(seq_len, plan.mesh.cp)
        self.columns = self.columns[self.offset[1]: self.offset[1] + self.local[1]]

    def read(self, source, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (tokens, targets) of the micro-batch starting at row `start`."""
        window = source.batch(start + self.offset[0], self.local[0])
        if self.mesh is None:
            return window[:, :-1], window[:, 1:]
        return window[:, self.columns], window[:, self.columns + 1]

    def wrap(self, local: torch.Tensor):
        if self.mesh is None:
            return local
        local = local.contiguous()
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=torch.Size(self.shape),
                                  stride=(self.shape[1], 1))
