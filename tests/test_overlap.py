"""Overlap, read from a recorded eager step: with parallel.prefetch 1, block i+1's
parameter all-gather is issued before block i's matmuls and waited on after them in
forward, and backward's re-gathers run one block ahead the other way; with prefetch 0
every gather is waited on before any matmul runs. The step is recorded op by op (issue =
the collective's dispatch, wait = `wait_tensor` on its result). Compiled steps are read
from their graphs' order, which parallel/overlap.py sets the same way."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain import AdamW, MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step
from meshtrain.layout.traffic import Traffic
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


def _step(prefetch: int, compile=False, given: str = "keyword"):
    """given: the switch as make_train_step's keyword, or inside a Traffic (as fit gives it)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    model = build("llama", CFG)
    plan = make_plan(model.specs, Rules.default(), MeshSpec(fsdp=2), world=2)
    mesh = plan.mesh.build()
    switch = {"prefetch": prefetch} if given == "keyword" else {"traffic": Traffic(prefetch=prefetch)}
    step = make_train_step(model, plan, mesh, optimizer=AdamW(lr=1e-3), compile=compile, **switch)
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


def _graph_events(gm, collective: str = "all_gather_into_tensor") -> list:
    """_Order's events read from a compiled graph's node order (the order it runs in), for
    the `collective`s."""
    events, ids = [], {}
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "").split(".")[0]
        if name == collective:
            ids[node] = len(ids)
            events.append(("issue", ids[node]))
        elif name == "wait_tensor" and node.args[0] in ids:
            events.append(("wait", ids[node.args[0]]))
        elif name in MATMULS:
            events.append(("mm", None))
    return events


@pytest.mark.parametrize("prefetch, given", [(1, "keyword"), (0, "keyword"), (0, "traffic")])
def test_compiled_gathers_overlap_the_previous_block(prefetch, given, monkeypatch):
    """The compiled step's graphs (aot_eager, as parallel/overlap.py leaves them: its
    compiler is recorded), in the order they run: the same overlap as eager with
    prefetch 1, none without; prefetch 0 also given in a Traffic, as fit gives it (the
    graph pass must read the same value the gathers do)."""
    import torch._dynamo.backends.debugging as debugging

    graphs, nop = [], debugging.boxed_nop

    def recording_nop(gm, inputs):
        graphs.append((_graph_events(gm), _graph_events(gm, "reduce_scatter_tensor")))
        return nop(gm, inputs)

    monkeypatch.setattr(debugging, "boxed_nop", recording_nop)
    step, state, batch = _step(prefetch, compile="aot_eager", given=given)
    try:
        torch._dynamo.reset()
        step(state, batch)
    finally:
        dist.destroy_process_group()
    (forward, _), (backward, reductions) = graphs[:2]  # the loss's graphs (the update's follow)
    fwd, bwd = _overlapped(forward), _overlapped(backward)
    assert len(fwd) == CFG.n_layers + 2 and len(bwd) == CFG.n_layers + 1, (fwd, bwd)
    # Gradient reduce-scatters, in backward's order: the head's bucket, blocks 3 to 0, the
    # embedding. Each is waited after the next is issued, so the head's and blocks 3 to 1
    # run beside the next block's backward matmuls; block 0's has only the embedding's
    # backward (no matmul) after it, and the embedding's is waited at the graph's end.
    red = _overlapped(reductions)
    assert len(red) == CFG.n_layers + 2, red
    if prefetch:
        assert fwd[2:] == [True] * CFG.n_layers, fwd
        assert bwd[1:] == [True] * CFG.n_layers, bwd
        assert red == [True] * CFG.n_layers + [False, False], red
    else:
        assert not any(fwd) and not any(bwd) and not any(red), (fwd, bwd, red)


def _code_events(code: str, collective: str = "all_gather_into_tensor") -> list:
    """_Order's events read from inductor's generated code (its call order), for the
    `collective`s."""
    events, ids = [], {}
    for line in code.splitlines():
        gather = re.search(rf"(buf\d+) = torch\.ops\._c10d_functional\.{collective}\.default\(", line)
        wait = re.search(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((buf\d+)\)", line)
        if gather:
            ids[gather.group(1)] = len(ids)
            events.append(("issue", ids[gather.group(1)]))
        elif wait and wait.group(1) in ids:
            events.append(("wait", ids[wait.group(1)]))
        elif "extern_kernels.mm(" in line:
            events.append(("mm", None))
    return events


@pytest.mark.slow
def test_inductor_keeps_the_prefetch_order():
    """Inductor's generated code, prefetch 1: its scheduler keeps the order the passes set
    (make_train_step turns off its peak-memory reordering, which would move each gather
    back to its first use), the gathers' in forward and the reduce-scatters' in backward."""
    from torch._inductor.utils import run_and_get_code

    step, state, batch = _step(1, compile=True)
    try:
        torch._dynamo.reset()
        _, codes = run_and_get_code(step, state, batch)
    finally:
        dist.destroy_process_group()
    fwd = _overlapped(_code_events(codes[0]))
    assert len(fwd) == CFG.n_layers + 2 and fwd[2:] == [True] * CFG.n_layers, fwd
    red = _overlapped(_code_events(codes[1], "reduce_scatter_tensor"))  # as in the aot_eager graphs
    assert red == [True] * CFG.n_layers + [False, False], red
