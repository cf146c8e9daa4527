"""Write safetensors files one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header giving every
tensor's dtype, shape and byte range, then the raw little-endian data. Every shape and
dtype of an export is known before any value is read, so the header is written first
and each tensor's bytes are appended as soon as that tensor is converted: no shard is
ever assembled in memory. Files are read back with `safetensors.safe_open`.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from pathlib import Path
from typing import Sequence

import torch

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class StreamWriter:
    """One safetensors file whose tensors are `entries` [(name, shape, dtype)], written
    in that order by `write`; `close` checks all were written and fsyncs the file."""

    def __init__(self, path: str | os.PathLike, entries: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None):
        if sys.byteorder != "little":  # safetensors data is little-endian; torch writes native order
            raise RuntimeError("writing safetensors needs a little-endian host")
        self.path = Path(path)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for name, shape, dtype in entries:
            if name in header:
                raise ValueError(f"{self.path}: tensor {name} listed twice")
            size = nbytes(shape, dtype)
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors itself writes it
        self.data_bytes = offset
        self._todo = list(entries)
        self._next = 0
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._todo):
            raise ValueError(f"{self.path}: tensor {name} written but not in the header")
        want_name, shape, dtype = self._todo[self._next]
        if name != want_name or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(f"{self.path}: expected tensor {want_name} {tuple(shape)} {dtype} next, got {name} "
                             f"{tuple(tensor.shape)} {tensor.dtype}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        try:
            if self._next != len(self._todo):
                raise ValueError(f"{self.path}: {len(self._todo) - self._next} tensors never written, first "
                                 f"{self._todo[self._next][0]}")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def abort(self) -> None:
        self._file.close()
