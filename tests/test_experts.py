"""Mixture-of-experts kernels against per-expert Python loops: grouped matmuls and the SwiGLU
expert MLP (outputs and gradients, on the _grouped_mm path and the fallback, eager and
compiled), routing sorts and capacity dropping."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtrain.errors import ConfigError
from meshtrain.models.experts import (capacity_keep, expert_capacity, expert_swiglu, grouped_linear,
                                      sort_by_expert)

FP32 = dict(rtol=1e-5, atol=1e-5)
E = 6
# d and F in fp32: multiples of 4 take torch._grouped_mm, others the per-expert loop.
GROUPED, FALLBACK = (8, 12), (5, 7)


def loop_swiglu(x, w_gate, w_up, w_down, counts, scale=None):
    """The reference: each expert's rows through its own MLP, one expert at a time."""
    outs = []
    for e, rows in enumerate(x.split(counts.tolist())):
        h = F.silu(rows @ w_gate[e].T) * (rows @ w_up[e].T)
        outs.append(h @ w_down[e].T)
    y = torch.cat(outs)
    return y if scale is None else y * scale[:, None]


def routing(tokens: int, top_k: int = 2, seed: int = 0):
    """Random top-k routing over experts 0, 2, 3 and 5 only: experts 1 and 4 get no rows."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor([0, 2, 3, 5])
    choice = torch.rand(tokens, len(used), generator=g).topk(top_k, dim=-1).indices
    return used[choice]


def problem(tokens: int, d: int, f: int, dtype=torch.float32, seed: int = 0):
    """Rows grouped by expert, the three expert weights, counts and per-row gates."""
    order, counts = sort_by_expert(routing(tokens, seed=seed), E)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(order.numel(), d, generator=g)
    weights = [torch.randn(E, f, d, generator=g) / d**0.5, torch.randn(E, f, d, generator=g) / d**0.5,
               torch.randn(E, d, f, generator=g) / f**0.5]
    scale = torch.rand(order.numel(), generator=g)
    return [t.to(dtype).requires_grad_() for t in (x, *weights)], counts, scale


@pytest.fixture
def grouped_mm_calls(monkeypatch):
    """Counts the torch._grouped_mm calls, to check which path a case took."""
    calls = []
    real = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    return calls


def grads(out, inputs, seed=1):
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, dy)


@pytest.mark.parametrize("dims", [GROUPED, FALLBACK], ids=["grouped_mm", "fallback"])
@pytest.mark.parametrize("tokens", [13, 0])
def test_grouped_linear_matches_loop(dims, tokens, grouped_mm_calls):
    (x, w, _, _), counts, _ = problem(tokens, *dims)
    assert counts[1] == counts[4] == 0 and counts.sum() == x.shape[0]
    out = grouped_linear(x, w, counts)
    got = (out, *grads(out, (x, w)))
    ref = torch.cat([rows @ w[e].T for e, rows in enumerate(x.split(counts.tolist()))])
    want = (ref, *grads(ref, (x, w)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **FP32)
    assert got[2][1].abs().max() == 0 and got[2][4].abs().max() == 0  # experts without rows
    assert len(grouped_mm_calls) == (3 if dims == GROUPED else 0)  # forward, dX, dW


@pytest.mark.parametrize("dims", [GROUPED, FALLBACK], ids=["grouped_mm", "fallback"])
@pytest.mark.parametrize("tokens", [13, 0])
@pytest.mark.parametrize("scaled", [False, True])
def test_expert_swiglu_matches_loop(dims, tokens, scaled, grouped_mm_calls):
    inputs, counts, scale = problem(tokens, *dims)
    scale = scale if scaled else None
    out = expert_swiglu(*inputs, counts, scale=scale)
    ref = loop_swiglu(*inputs, counts, scale=scale)
    torch.testing.assert_close(out, ref, **FP32)
    for a, b in zip(grads(out, inputs), grads(ref, inputs)):
        torch.testing.assert_close(a, b, **FP32)
    assert bool(grouped_mm_calls) == (dims == GROUPED)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_grouped_path_tracks_fp32(dtype, grouped_mm_calls):
    inputs, counts, scale = problem(24, 16, 32, dtype=dtype)  # 16 and 32 of 2 bytes: aligned
    out = expert_swiglu(*inputs, counts, scale=scale)
    assert out.dtype == dtype and len(grouped_mm_calls) == 3
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    ref = loop_swiglu(*ref_inputs, counts, scale=scale)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads(out, inputs), grads(ref, ref_inputs)):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dims,grouped", [(GROUPED, True), (FALLBACK, False)], ids=["grouped_mm", "fallback"])
def test_custom_ops_pass_opcheck(dims, grouped):
    """The opaque ops' schemas, fake kernels (shapes and strides) and autograd registration."""
    from meshtrain.models.experts import _grouped_linear, _grouped_linear_backward

    d, f = dims
    x, w, dy = torch.randn(9, d), torch.randn(4, f, d), torch.randn(9, f)
    offs = torch.tensor([3, 3, 9, 9], dtype=torch.int32)
    torch.library.opcheck(_grouped_linear, (x.requires_grad_(), w.requires_grad_(), offs, grouped))
    torch.library.opcheck(_grouped_linear_backward, (dy, x.detach(), w.detach(), offs, grouped))


def moe(x, expert_idx, gates, w_gate, w_up, w_down, capacity=4):
    """Tokens (T, d) through their top-k experts, gated and summed back per token; slots over
    an expert's capacity get gate 0."""
    k, num_experts = expert_idx.shape[1], w_gate.shape[0]
    gates = gates * capacity_keep(expert_idx, gates, num_experts, capacity)
    order, counts = sort_by_expert(expert_idx, num_experts)
    token = order // k
    y = expert_swiglu(x[token], w_gate, w_up, w_down, counts, scale=gates.reshape(-1)[order])
    return torch.zeros_like(x).index_add(0, token, y)


@pytest.mark.slow
@pytest.mark.parametrize("dims", [GROUPED, FALLBACK], ids=["grouped_mm", "fallback"])
def test_compiled_matches_eager(dims):
    d, f = dims
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, d, generator=g, requires_grad=True)
    gates = torch.rand(10, 2, generator=g, requires_grad=True)
    weights = [(torch.randn(shape, generator=g) / 3).requires_grad_() for shape in ((E, f, d), (E, f, d), (E, d, f))]
    expert_idx = routing(10)
    assert not capacity_keep(expert_idx, gates, E, 4).all()  # some slots dropped
    inputs = (x, expert_idx, gates, *weights)
    differentiable = (x, gates, *weights)
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager", dynamic=False)
    out, ref = compiled(*inputs), moe(*inputs)
    torch.testing.assert_close(out, ref, **FP32)
    for a, b in zip(grads(out, differentiable), grads(ref, differentiable)):
        torch.testing.assert_close(a, b, **FP32)


def test_sort_by_expert_by_hand():
    order, counts = sort_by_expert(torch.tensor([[2, 0], [1, 2], [0, 2]]), 4)
    # slots 0..5 go to experts 2 0 1 2 0 2: expert 0 has slots 1, 4; 1 has 2; 2 has 0, 3, 5.
    assert order.tolist() == [1, 4, 2, 0, 3, 5]
    assert counts.tolist() == [2, 1, 3, 0]


def test_capacity_keep_by_hand():
    expert_idx = torch.tensor([[0, 1], [0, 2], [1, 0], [1, 0], [2, 3]])
    gates = torch.tensor([[.6, .4], [.5, .5], [.7, .3], [.4, .5], [.9, .1]])
    keep = capacity_keep(expert_idx, gates, num_experts=4, capacity=2)
    # Expert 0 (slots of gate .6, .5, .3, .5): keeps .6 and the tied .5 of token 1 over token 3's.
    # Expert 1 (.4, .7, .4): keeps .7 and the tied .4 of token 0 (its 2nd choice) over token 3's.
    # Expert 2 (.5, .9) is at capacity and expert 3 (.1) under it: all kept.
    assert keep.tolist() == [[True, True], [True, True], [True, False], [False, False], [True, True]]


def brute_force_keep(expert_idx, gates, num_experts, capacity):
    keep = torch.zeros_like(expert_idx, dtype=torch.bool)
    T, k = expert_idx.shape
    for e in range(num_experts):
        slots = [(-gates[t, c].item(), t, c) for t in range(T) for c in range(k) if expert_idx[t, c] == e]
        for _, t, c in sorted(slots)[:capacity]:
            keep[t, c] = True
    return keep


@pytest.mark.parametrize("capacity", [0, 1, 7, 16, 100])
def test_capacity_keep_matches_brute_force(capacity):
    g = torch.Generator().manual_seed(capacity)
    expert_idx = torch.rand(48, 8, generator=g).topk(2, dim=-1).indices
    gates = torch.randint(0, 4, (48, 2), generator=g) / 4  # few distinct values: many ties
    keep = capacity_keep(expert_idx, gates, 8, capacity)
    assert torch.equal(keep, brute_force_keep(expert_idx, gates, 8, capacity))
    per_expert = torch.bincount(expert_idx[keep], minlength=8)
    assert (per_expert == torch.bincount(expert_idx.reshape(-1), minlength=8).clamp(max=capacity)).all()


def test_expert_capacity():
    assert expert_capacity(8, 2, 4, 1.0) == 4
    assert expert_capacity(8, 2, 4, 1.25) == 5
    assert expert_capacity(100, 2, 4, 1.1) == 55  # not 56: 1.1 * 100 * 2 / 4 is 55.00000000000001 in floats
    assert expert_capacity(3, 1, 4, 1.0) == 1
    assert expert_capacity(0, 2, 4, 1.0) == 0
    with pytest.raises(ConfigError, match="capacity_factor"):
        expert_capacity(8, 2, 4, 0.0)
