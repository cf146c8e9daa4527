"""What a block keeps for backward, at the textbook minimum (issue 25): norms that keep
their input and per-row statistics only (models/layers.py), and sequence parallelism that
keeps the shard of an all-gathered activation and gathers it again in backward
(parallel/regather.py `_FetchActivation`; the bytes are checked against the planner in
tests/test_memory_estimate.py)."""

from __future__ import annotations

import pytest
import torch

from meshtrain.models.layers import layer_norm, rms_norm


def _plain_rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _plain_layer_norm(x, w, b, eps):
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    return ((xf - mean) * torch.rsqrt(var + eps)).to(x.dtype) * w + b


def _inputs(dtype, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 33, 64, generator=g).to(dtype).requires_grad_()
    w, b = (torch.randn(64, generator=g).to(dtype).requires_grad_() for _ in range(2))
    return (x, w, b) if bias else (x, w)


NORMS = {"rms": (rms_norm, _plain_rms, False), "layer": (layer_norm, _plain_layer_norm, True)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", NORMS)
def test_norms_equal_the_plain_ops_bit_for_bit(norm, dtype):
    """Forward and every gradient, inside a residual block (x is read by the norm and the
    residual add: the order autograd sums x's gradient terms in matters in fp32)."""
    ours, plain, bias = NORMS[norm]
    args = _inputs(dtype, bias)
    mix = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    grad = torch.randn(4, 33, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    results = []
    for f in (ours, plain):
        x = args[0] * 1.5
        y = x + f(x, *args[1:], 1e-5) @ mix
        results.append((y, *torch.autograd.grad(y, args, grad)))
    for got, want in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.parametrize("norm", NORMS)
def test_norm_gradients_in_double(norm):
    ours, _, bias = NORMS[norm]
    args = tuple(t.detach().double().requires_grad_() for t in _inputs(torch.float32, bias))
    assert torch.autograd.gradcheck(lambda *a: ours(*a, 1e-5), args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", NORMS)
def test_a_norm_keeps_its_input_and_fp32_row_statistics(norm, dtype):
    """Saved for backward: the input in its own dtype, the weight, and per row one fp32
    rsqrt (RMSNorm) or mean and rsqrt (LayerNorm): no fp32 copy of the input, no
    normalised value (which the plain ops keep: 6 bytes per element under bf16, not 2)."""
    ours, plain, bias = NORMS[norm]
    args = _inputs(dtype, bias)
    x, w = args[:2]
    rows, stats = x.numel() // x.shape[-1], 2 if bias else 1

    def saved_bytes(f):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            f(*args, 1e-5)
        return sum(seen.values())

    assert saved_bytes(ours) == x.nbytes + w.nbytes + 4 * stats * rows
    # The plain ops keep at least the normalised value besides (and under bf16 an fp32
    # copy of the input; LayerNorm's two centred copies): an input's bytes more in fp32,
    # two more under bf16.
    assert saved_bytes(plain) >= saved_bytes(ours) + (x.nbytes if dtype == torch.float32 else 2 * x.nbytes)
