"""Activation offload (train.activation_checkpointing offload): what autograd saves inside a
transformer block goes to host memory in forward and comes back to the device in
backward, one saved tensor at a time, as its backward node needs it; nothing is
recomputed, so the step is bit for bit the step without it.

Not moved: the parameters themselves and views of them (resident anyway), and
whatever a saved-tensor hook around the block already replaces (ShardedContext's
regather hooks keep a gathered weight's shard instead, parallel/regather.py): the hooks
here run the outer pair first and move only what it left as a tensor. A DTensor moves
as its local tensor, rebuilt with its placements when it comes back. On CUDA the host
copies are pinned and the copies asynchronous on the current stream.

`observe()` lists every device storage moved (its address and bytes), so the tests can
count what stays on the device where host and device are one memory (CPU).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from ..errors import ConfigError

_observers: list[list[tuple[int, int]]] = []


@contextlib.contextmanager
def observe():
    """Within: [(storage address, storage bytes)] of each device tensor moved to host."""
    moved: list[tuple[int, int]] = []
    _observers.append(moved)
    try:
        yield moved
    finally:
        _observers.remove(moved)


class _OnHost:
    """A saved tensor's host copy and how to rebuild it on its device."""

    __slots__ = ("host", "device", "spec")

    def __init__(self, t: torch.Tensor):
        local = t._local_tensor if isinstance(t, DTensor) else t
        self.spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        self.device = local.device
        pin = local.device.type == "cuda"
        # Its strides kept (a kernel given other strides may round differently); an
        # expanded or overlapping tensor is copied dense (empty_like's rule).
        self.host = torch.empty_like(local, device="cpu", pin_memory=pin)
        self.host.copy_(local, non_blocking=pin)
        for moved in _observers:
            moved.append((local.untyped_storage().data_ptr(), local.untyped_storage().nbytes()))

    def value(self) -> torch.Tensor:
        local = self.host.to(self.device, non_blocking=self.host.is_pinned())
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _movable(t: torch.Tensor) -> bool:
    """Not a parameter or a view of one (a transposed weight: resident anyway), nor what
    has no storage of its own (a pending collective's result)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    base = t if t._base is None else t._base
    return (not (base.is_leaf and base.requires_grad) and type(local) is torch.Tensor
            and local.device.type != "meta" and not local.is_sparse)


def refuse_compiled(activation_checkpointing: str) -> None:
    """A compiled step cannot offload: torch 2.13's dynamo does not trace saved-tensor
    hooks inside a graph (measured: "saved_tensors_hooks.__init__ should not be traced")."""
    if activation_checkpointing == "offload":
        raise ConfigError("train.activation_checkpointing=offload cannot be compiled (torch 2.13's dynamo refuses the "
                          "saved-tensor hooks that move activations to host): set train.compile false, or use "
                          "activation_checkpointing selective or full to save activation memory in a compiled step")


def offloaded(fn, *args):
    """fn(*args) with what autograd saves inside moved to host memory (module docstring)."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(t):
        if outer_pack is not None:
            packed = outer_pack(t)
            if packed is not t:  # the outer pair keeps something else instead
                return ("outer", packed)
        return ("host", _OnHost(t)) if _movable(t) else ("kept", t)

    def unpack(packed):
        kind, value = packed
        if kind == "outer":
            return outer_unpack(value)
        return value.value() if kind == "host" else value

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(*args)
