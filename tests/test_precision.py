"""bf16 compute with fp32 master weights: parameters gather in bf16, gradients reduce in
fp32, and the loss stays close to the fp32 run."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain import MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step
from meshtrain.models.spec import init_slice
from meshtrain.testing import run_ranks

from test_equivalence import CFG, _optimizer, batches, single_process


class CollectiveDtypes(TorchDispatchMode):
    """Records (collective, dtype) for every c10d functional op issued."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, torch.dtype]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("_c10d_functional::") and name != "_c10d_functional::wait_tensor":
            self.seen.add((name.split("::")[1], args[0].dtype))
        return func(*args, **(kwargs or {}))


def bf16_fsdp_run():
    import torch.distributed as dist

    model = build("llama", CFG)
    plan = make_plan(model.specs, Rules.default(), MeshSpec(fsdp=2), world=dist.get_world_size())
    mesh = plan.mesh.build()
    params = init_params(plan, mesh, seed=0)
    step = make_train_step(model, plan, mesh, precision="bf16", **_optimizer())
    state = TrainState.create(params)
    recorder = CollectiveDtypes()
    with recorder:
        losses = [step(state, b)["loss"] for b in batches(micro_steps=1)]
    dtypes = {n: p.dtype for n, p in params.items()}
    return losses, sorted((op, str(dt)) for op, dt in recorder.seen), dtypes


def test_bf16_single_process_tracks_fp32():
    model = build("llama", CFG)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    step = make_train_step(model, precision="bf16", **_optimizer())
    state = TrainState.create(params)
    losses = [step(state, b)["loss"] for b in batches(micro_steps=1)]
    reference = single_process()[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-2, atol=0)
    assert all(p.dtype == torch.float32 for p in params.values())  # fp32 master weights


@pytest.mark.slow
def test_bf16_fsdp_gathers_in_bf16_and_reduces_in_fp32():
    losses, collectives, dtypes = run_ranks(bf16_fsdp_run, 2)[0]
    assert ("all_gather_into_tensor", "torch.bfloat16") in collectives
    assert ("all_gather_into_tensor", "torch.float32") not in collectives
    assert ("reduce_scatter_tensor", "torch.float32") in collectives
    assert ("reduce_scatter_tensor", "torch.bfloat16") not in collectives
    assert set(dtypes.values()) == {torch.float32}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(single_process()[0]), rtol=1e-2, atol=0)


def bf16_cp_runs():
    """cp 2 in bf16 with each exchange (the bytes on the wire: test_comms_estimate)."""
    import torch.distributed as dist

    model = build("llama", CFG)
    out = {}
    for comm in ("allgather", "ring", "a2a"):
        plan = make_plan(model.specs, Rules.default(), MeshSpec(cp=2), world=dist.get_world_size(), cp_comm=comm)
        mesh = plan.mesh.build()
        params = init_params(plan, mesh, seed=0)
        step = make_train_step(model, plan, mesh, precision="bf16", **_optimizer())
        state = TrainState.create(params)
        out[comm] = [step(state, b)["loss"] for b in batches(micro_steps=1)]
    return out


@pytest.mark.slow
def test_bf16_context_parallel_tracks_one_bf16_process():
    model = build("llama", CFG)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    step = make_train_step(model, precision="bf16", **_optimizer())
    state = TrainState.create(params)
    reference = torch.tensor([step(state, b)["loss"] for b in batches(micro_steps=1)])
    for comm, losses in run_ranks(bf16_cp_runs, 2)[0].items():
        # Measured: within 3e-5 (the attention sums in a different order, in fp32).
        torch.testing.assert_close(torch.tensor(losses), reference, rtol=1e-4, atol=0, msg=lambda m: f"{comm}: {m}")
