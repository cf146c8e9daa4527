"""The zero-bubble split of a compiled stage's backward (train/split_backward.py), in one
process: the input half computes the stage input's gradient and no weight gradient, the
weight half the weight gradients from what the input half kept, and together they equal
eager autograd; also with the stage input a DTensor sharded over the sequence (a tp + sp
pipeline's), on 2 gloo ranks. The pipelines that run it: tests/test_pipeline_exec.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from meshtrain import MeshSpec, Rules, build, init_params, make_plan
from meshtrain.models.context import LocalContext
from meshtrain.models.family import RESIDUAL
from meshtrain.models.policy import Policy
from meshtrain.models.spec import init_slice
from meshtrain.parallel.context import ShardedContext
from meshtrain.testing import run_ranks
from meshtrain.train.split_backward import SplitBackward

from support.equivalence import CFG

LAYERS = 2
MM = torch.ops.aten.mm.default


def _stage(checkpointing: str):
    """The last stage of a 2-stage Llama (layers and head, its loss in its graph) and its inputs."""
    cfg = dataclasses.replace(CFG, n_layers=2 * LAYERS)
    model = build("llama", cfg)
    ctx = LocalContext(Policy.of(activation_checkpointing=checkpointing))
    names = _stage_names(model)

    def run(params, x, targets):
        out = model.family.forward_stage(cfg, params, x, ctx, (LAYERS, 2 * LAYERS), False, True)
        return ctx.cross_entropy_sum(out, targets)

    params = {n: init_slice(model.specs[n], n, seed=0).requires_grad_() for n in names}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, cfg.dim, generator=g)
    targets = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    return run, params, x, targets


def _stage_names(model):
    return [n for n in model.specs if n.startswith(tuple(f"layers.{i}." for i in range(LAYERS, 2 * LAYERS)))
            or not n.startswith(("layers.", "tok_emb"))]


@pytest.mark.parametrize("backend,checkpointing", [("aot_eager", "none"), ("aot_eager", "selective"),
                                                   ("inductor", "none")])
def test_the_halves_split_the_work_and_equal_eager(backend, checkpointing):
    torch._dynamo.reset()
    run, params, x0, targets = _stage(checkpointing)
    x = x0.clone().requires_grad_()
    run(params, x, targets).backward()
    ref_x, ref = x.grad, {n: p.grad for n, p in params.items()}
    for p in params.values():
        p.grad = None

    split = SplitBackward()
    stage = torch.compile(run, fullgraph=True, dynamic=False, backend=split.backend(backend, 0))
    for micro in range(2):  # the second micro-batch accumulates onto the first's weight gradients
        x = x0.clone().requires_grad_()
        loss = stage(params, x, targets)
        with split.input_half(micro):
            torch.autograd.backward([loss], inputs=[x], retain_graph=True)
        torch.testing.assert_close(x.grad, ref_x, rtol=1e-5, atol=1e-6)
        if micro == 0:
            assert all(p.grad is None for p in params.values())  # the input half left the weights alone
        assert list(split.kept) == [micro]
        with split.weight_half(micro):
            torch.autograd.backward([loss], inputs=list(params.values()))
        assert not split.kept
    for n, p in params.items():
        torch.testing.assert_close(p.grad, 2 * ref[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")

    (first, second), = split.halves
    # Every weight matrix is one matmul in forward: its input gradient is one matmul in
    # the input half, its weight gradient one in the weight half (attention's are its own op).
    matrices = sum(p.dim() == 2 and not n.endswith("norm") for n, p in params.items())
    assert [sum(node.target is MM for node in g.graph.nodes) for g in (first, second)] == [matrices, matrices]


def _dtensor_input_halves():
    """On each of 2 gloo ranks (tp 2 + sp): the stage of `_stage` on DTensor weights, its
    input a DTensor sharded over the sequence, wrapped around the received buffer as the
    pipeline does (train/pipeline_step.py `_Pipe.wrap`); eager autograd against the halves."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    cfg = dataclasses.replace(CFG, n_layers=2 * LAYERS)
    model = build("llama", cfg)
    plan = make_plan(model.specs, Rules.default(sp=True), MeshSpec(tp=2), world=2)
    mesh = plan.mesh.build()
    names = _stage_names(model)
    params = init_params(plan, mesh, seed=0, names=names)
    _, _, x0, targets = _stage("none")  # the same values on every rank
    placements = plan.activation(RESIDUAL).placements
    shard = distribute_tensor(x0, mesh, placements).to_local()
    ctx = ShardedContext(plan, mesh)

    def run(params, x, targets):
        out = model.family.forward_stage(cfg, params, x, ctx, (LAYERS, 2 * LAYERS), False, True)
        return ctx.cross_entropy_sum(out, targets)

    def forward(fn):
        buf = shard.clone().requires_grad_()  # the received buffer: the leaf whose .grad goes back
        x = DTensor.from_local(buf, mesh, placements, run_check=False, shape=x0.shape, stride=x0.stride())
        with ctx.regather_in_backward():
            loss = fn(params, x, targets)
        return buf, loss, torch.ones_like(loss)

    buf, loss, ones = forward(run)
    torch.autograd.backward([loss], [ones])
    ref_x, ref = buf.grad, {n: p.grad.full_tensor() for n, p in params.items()}
    for p in params.values():
        p.grad = None

    split = SplitBackward()
    stage = torch.compile(run, fullgraph=True, dynamic=False, backend=split.backend("aot_eager", 1))
    for micro in range(2):
        buf, loss, ones = forward(stage)
        with split.input_half(micro):
            torch.autograd.backward([loss], [ones], inputs=[buf], retain_graph=True)
        assert buf.grad is not None, "the input half gave the DTensor input no gradient"
        torch.testing.assert_close(buf.grad, ref_x, rtol=1e-5, atol=1e-6)
        if micro == 0:
            assert all(p.grad is None for p in params.values())
        with split.weight_half(micro):
            torch.autograd.backward([loss], [ones], inputs=list(params.values()))
        assert not split.kept
    ctx.reduce_held(params)  # what the graphs left partial (the sp norms), as the pipeline step does
    for n, p in params.items():
        torch.testing.assert_close(p.grad.full_tensor(), 2 * ref[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    return len(split.halves)


def test_the_halves_equal_eager_with_a_dtensor_stage_input():
    assert run_ranks(_dtensor_input_halves, 2) == [1, 1]  # one stage graph, split once, on each rank
