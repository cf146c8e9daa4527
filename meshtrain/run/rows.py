"""Which rows and columns of each global batch this rank reads, and the DTensor it wraps
them in: the batch layout of the plan ("batch", "seq"), zigzag columns under cp."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..data.documents import document_positions, document_segments, mask_after_eod
from ..models.mtp import mtp_rows
from ..parallel.zigzag import zigzag_order


class RowSlice:
    """Which rows (and columns) of a micro-batch this rank holds, from the plan's layout
    of ("batch", "seq") activations, and how to wrap them as that DTensor."""

    def __init__(self, plan, mesh, rows: int, seq_len: int, mtp_depth: int = 0):
        self.mesh, self.shape, self.mtp_depth = mesh, (rows, seq_len), mtp_depth
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

    def read(self, source, start: int, eod: int | None = None, documents: tuple[str, ...] = ()) -> dict:
        """This rank's "tokens" and "targets" of the micro-batch starting at row `start`,
        and the `documents` asked for, found from the EOD tokens `eod` of whole rows:
        "segments", "positions", "eod_mask_loss" (targets after an EOD ignored), and
        "loss_mask" (targets the data's loss mask leaves out ignored); with multi-token
        prediction, each depth's "mtp_tokens_k" and "mtp_targets_k" (models/mtp.py)."""
        window = source.batch(start + self.offset[0], self.local[0])
        out = {"tokens": window[:, :-1], "targets": window[:, 1:]}
        if "loss_mask" in documents:
            mask = source.loss_mask(start + self.offset[0], self.local[0])
            if mask is not None:
                out["targets"] = torch.where(mask[:, 1:], out["targets"], -1)
        if "segments" in documents:
            out["segments"] = document_segments(out["tokens"], eod)
        if "positions" in documents:
            out["positions"] = document_positions(out["tokens"], eod)
        if "eod_mask_loss" in documents:
            out["targets"] = mask_after_eod(out["tokens"], out["targets"], eod)
        if self.mtp_depth:
            out.update(mtp_rows(out["tokens"], out["targets"], self.mtp_depth, out.get("segments")))
        if self.mesh is not None:  # this rank's columns, of values found on the whole rows
            out = {k: v[:, self.columns] for k, v in out.items()}
        return out

    def wrap(self, local: torch.Tensor):
        if self.mesh is None:
            return local
        local = local.contiguous()
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=torch.Size(self.shape),
                                  stride=(self.shape[1], 1))
