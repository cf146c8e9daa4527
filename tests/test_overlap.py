"""Overlap, read from a recorded eager step: with parallel.prefetch 1, block i+1's
parameter all-gather is issued before block i's matmuls and waited on after them in
forward, and backward's re-gathers run one block ahead the other way; with prefetch 0
every gather is waited on before any matmul runs. The step is recorded op by op (issue =
the collective's dispatch, wait = `wait_tensor` on its result). Compiled steps gather a
bucket at its first use and issue nothing ahead yet (docs/parallelism.md, section 3), so
there is no compiled order to check."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain import AdamW, MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step
from meshtrain.models import llama

CFG = llama.LlamaConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
MATMULS = {"mm", "addmm", "bmm"}


class _Order(TorchDispatchMode):
    """Events in dispatch order: ("issue", k), ("wait", k) for the k-th parameter gather,
    ("mm", None) for a matmul; `backward` marks where backward began."""

    def __init__(self):
        super().__init__()
        self.events, self._ids, self.backward, self._n = [], {}, None, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if self.backward is None and torch._C._current_autograd_node() is not None:
            self.backward = len(self.events)
        if name == "all_gather_into_tensor":
            # By address: a later gather may reuse a freed buffer's, and takes it over.
            self._ids[out.data_ptr()] = k = self._n
            self._n += 1
            self.events.append(("issue", k))
        elif name == "wait_tensor" and out.data_ptr() in self._ids:  # its argument is a wrapper
            self.events.append(("wait", self._ids[out.data_ptr()]))
        elif name in MATMULS:
            self.events.append(("mm", None))
        return out


def _step(prefetch: int, compile=False):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    model = build("llama", CFG)
    plan = make_plan(model.specs, Rules.default(), MeshSpec(fsdp=2), world=2)
    mesh = plan.mesh.build()
    step = make_train_step(model, plan, mesh, optimizer=AdamW(lr=1e-3), prefetch=prefetch, compile=compile)
    state = TrainState.create(init_params(plan, mesh, seed=0))
    t = torch.randint(0, CFG.vocab_size, (1, 4, 9), generator=torch.Generator().manual_seed(0))
    return step, state, {"tokens": t[..., :-1], "targets": t[..., 1:]}


def _overlapped(events) -> list[bool]:
    """Per gather (in issue order): did a matmul run between its issue and its wait?"""
    issued, waited = {}, {}
    for i, (kind, k) in enumerate(events):
        if kind == "issue":
            issued[k] = i
        elif kind == "wait" and k not in waited:
            waited[k] = i
    mms = [i for i, (kind, _) in enumerate(events) if kind == "mm"]
    return [any(issued[k] < i < waited[k] for i in mms) for k in sorted(issued) if k in waited]


@pytest.mark.parametrize("prefetch", [1, 0])
def test_eager_gathers_overlap_the_previous_block(prefetch):
    step, state, batch = _step(prefetch)
    try:
        with _Order() as order:
            step(state, batch)
    finally:
        dist.destroy_process_group()
    forward = order.events[:order.backward]
    backward = order.events[order.backward:]
    # Buckets: embedding, 4 blocks, final norm + head. Forward: the embedding's gather
    # issues block 0's, which only the embedding lookup can hide (no matmul); from block 1
    # on, each gather is in flight while the block before it runs its matmuls.
    fwd = _overlapped(forward)
    assert len(fwd) == CFG.n_layers + 2
    if prefetch:
        assert fwd[2:] == [True] * CFG.n_layers, fwd
    else:
        assert not any(fwd), fwd
    # Backward re-gathers the head's bucket and the 4 blocks (the untied embedding keeps
    # no weight for backward); each after the first is issued one bucket ahead.
    bwd = _overlapped(backward)
    assert len(bwd) == CFG.n_layers + 1
    if prefetch:
        assert bwd[1:] == [True] * CFG.n_layers, bwd
    else:
        assert not any(bwd), bwd
