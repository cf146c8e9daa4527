"""fp8_linear: error bounds against fp32 for both recipes, the allmax contract that lets
sharded runs quantize with a single process's scales, and torch.compile."""

from __future__ import annotations

import pytest
import torch

from meshtrain.models.fp8 import RECIPES, fp8_linear

# Error bounds. Rounding to a float with p explicit mantissa bits changes a (normal) value
# by a relative delta with |delta| <= u = 2^-(p+1): u = 2^-4 for e4m3, 2^-3 for e5m2. delta
# is at most uniform on [-u, u], so E[delta^2] <= u^2 / 3. Dynamic scaling maps the amax to
# fp8_max, so for these inputs almost every element is normal, whatever the input's
# magnitude. An output element sum_k a_k b_k (1 + da_k + db_k) then errs by
# sum_k a_k b_k (da_k + db_k): for independent random operands and errors its relative
# RMS, i.e. the relative Frobenius error, is sqrt(E[da^2] + E[db^2]) <= sqrt((ua^2 + ub^2) / 3).
# Slack of 10% covers the bf16 output's own rounding (2^-9) and the rare subnormals.
U_E4M3, U_E5M2 = 2.0**-4, 2.0**-3
BOUND_Y = 1.1 * ((2 * U_E4M3**2) / 3) ** 0.5  # x and w in e4m3: 0.056
BOUND_GRAD = 1.1 * ((U_E5M2**2 + U_E4M3**2) / 3) ** 0.5  # grad in e5m2: 0.089

M, K, N = 64, 128, 96


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def _inputs(dtype=torch.float32, seed=0, x_scale=1.0, w_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=gen) * x_scale).to(dtype)
    w = (torch.randn(N, K, generator=gen) * w_scale).to(dtype)
    g = torch.randn(M, N, generator=gen).to(dtype)
    return x, w, g


def _run(fn, x, w, g, **kw):
    """(y, grad_x, grad_w) of fn(x, w) with upstream gradient g."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w, **kw)
    return (y, *torch.autograd.grad(y, (x, w), g))


def _errors(x, w, g, recipe):
    """Relative Frobenius errors of (y, grad_x, grad_w) against an fp32 matmul."""
    ref = _run(lambda a, b: a @ b.T, x.float(), w.float(), g.float())
    out = _run(fp8_linear, x, w, g, recipe=recipe)
    for o, i in zip(out, (x, x, w)):
        assert o.dtype == i.dtype and torch.isfinite(o).all()
    return [_rel(o, r) for o, r in zip(out, ref)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", RECIPES)
def test_error_bound(recipe, dtype):
    ey, egx, egw = _errors(*_inputs(dtype), recipe)
    assert ey < BOUND_Y and egx < BOUND_GRAD and egw < BOUND_GRAD, (ey, egx, egw)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("x_scale,w_scale", [(1e4, 1.0), (1e-4, 1.0), (1e4, 1e-4), (1e-4, 1e-4)])
def test_extreme_magnitudes(recipe, x_scale, w_scale):
    # Dynamic scaling makes the error independent of the magnitude (bf16 and fp8 alike).
    ey, egx, egw = _errors(*_inputs(torch.bfloat16, 1, x_scale, w_scale), recipe)
    assert ey < BOUND_Y and egx < BOUND_GRAD and egw < BOUND_GRAD, (ey, egx, egw)


@pytest.mark.parametrize("recipe", RECIPES)
def test_zero_input(recipe):
    x, w, g = _inputs(torch.bfloat16, 2)
    y, gx, gw = _run(fp8_linear, torch.zeros_like(x), w, g, recipe=recipe)
    assert not y.any() and not gw.any()
    assert _rel(gx, g.float() @ w.float()) < BOUND_GRAD


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_operand_rounds_to_its_format(recipe):
    # With one GEMM operand the identity the GEMM returns the other, quantized. Every row and
    # column of x, w, g has amax 1.75, so all scales are powers of two (fp8 max is 1.75 * 2^8
    # for e4m3, 1.75 * 2^15 for e5m2) and quantizing is plain rounding to 3 resp. 2 mantissa
    # bits: x and w must come out rounded to e4m3 in every GEMM, g to e5m2.
    def rounded(t, dtype):
        scale = torch.finfo(dtype).max / 1.75
        return (t * scale).to(dtype).float() / scale

    gen, eye = torch.Generator().manual_seed(5), torch.eye(M)
    x, w, g = (torch.rand(M, M, generator=gen).mul(3).sub(1.5).fill_diagonal_(1.75) for _ in range(3))
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    y_x, gx_g, _ = _run(fp8_linear, x, eye, g, recipe=recipe)  # y = x, grad_x = g
    y_w, _, gw_g = _run(fp8_linear, eye, w, g, recipe=recipe)  # y = w.T, grad_w = g.T
    _, gx_w, gw_x = _run(fp8_linear, x, w, eye, recipe=recipe)  # grad_x = w, grad_w = x
    for out, ref in [(y_x, rounded(x, e4)), (y_w, rounded(w, e4).T), (gx_g, rounded(g, e5)),
                     (gw_g, rounded(g, e5).T), (gx_w, rounded(w, e4)), (gw_x, rounded(x, e4))]:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_saturates_when_amax_falls_short(recipe):
    # A caller's allmax that underestimates (e.g. reduces over too few ranks) must not
    # overflow the casts to inf/NaN: values beyond the scale saturate at the fp8 max.
    out = _run(fp8_linear, *_inputs(), recipe=recipe, allmax=lambda t, operand, over: t / 4)
    assert all(torch.isfinite(o).all() for o in out)


def test_rowwise_keeps_small_rows():
    # e4m3 spans ~2^17.8 (448 down to the smallest subnormal 2^-9), so rows 1000x smaller
    # than the amax still land on normals and tensorwise loses little; 1e5x smaller they
    # fall into the subnormals and lose most of their bits, unless each row has its own scale.
    x, w, _ = _inputs()
    x[1::2] /= 1e5
    ref = (x @ w.T)[1::2]
    err = {r: _rel(fp8_linear(x, w, r)[1::2], ref) for r in RECIPES}
    assert err["rowwise"] < BOUND_Y < 4 * BOUND_Y < err["tensorwise"], err


def test_allmax_calls():
    """The hook sees each amax with its operand's name, the dims reduced, keepdim shape."""
    for recipe, fwd, gx, gw in [("tensorwise", (0, 1), (0, 1), (0, 1)), ("rowwise", (1,), (1,), (0,))]:
        calls = []

        def allmax(t, operand, over):
            calls.append((operand, over, tuple(t.shape)))
            return t

        _run(fp8_linear, *_inputs(), recipe=recipe, allmax=allmax)
        shape = {"x": (M, K), "w": (N, K), "grad": (M, N)}
        # grad_x contracts N: dim 1 of grad, dim 0 of w; grad_w contracts M: dim 0 of both.
        w_gx = (0, 1) if recipe == "tensorwise" else (0,)
        expected = [("x", fwd), ("w", fwd), ("grad", gx), ("w", w_gx), ("grad", gw), ("x", gw)]
        assert calls == [(op, over, tuple(1 if d in over else n for d, n in enumerate(shape[op])))
                         for op, over in expected]


def _sharded(x, w, g, recipe, split, allreduce):
    """fp8_linear run by 2 emulated ranks: split "M" cuts x and g into row blocks (data
    parallel), "N" cuts w's rows and g's columns (tensor parallel). With allreduce, allmax
    takes the max over both ranks' amaxes whenever `over` covers a split dim, as a MAX
    all-reduce would: each rank runs once to record its amaxes, then again with them.
    Returns (y, grad_x, grad_w) reassembled as a single process would hold them."""
    split_dims = {"M": {"x": 0, "grad": 0}, "N": {"w": 0, "grad": 1}}[split]
    if split == "M":
        shards = [(xs, w, gs) for xs, gs in zip(x.chunk(2), g.chunk(2))]
    else:
        shards = [(x, ws, gs) for ws, gs in zip(w.chunk(2), g.chunk(2, dim=1))]
    recorded = [[], []]  # per rank, its amaxes in call order

    def record(rank):
        return lambda t, operand, over: recorded[rank].append(t) or t

    def all_reduce(rank):
        calls = iter(range(len(recorded[rank])))

        def allmax(t, operand, over):
            i = next(calls)
            return torch.maximum(*(r[i] for r in recorded)) if split_dims.get(operand) in over else t
        return allmax

    for rank, shard in enumerate(shards):
        _run(fp8_linear, *shard, recipe=recipe, allmax=record(rank))
    outs = [_run(fp8_linear, *shard, recipe=recipe, allmax=all_reduce(rank) if allreduce else None)
            for rank, shard in enumerate(shards)]
    (y0, gx0, gw0), (y1, gx1, gw1) = outs
    if split == "M":  # grad_w contracts the split M: each rank holds a partial sum
        return torch.cat([y0, y1]), torch.cat([gx0, gx1]), gw0 + gw1
    return torch.cat([y0, y1], dim=1), gx0 + gx1, torch.cat([gw0, gw1])


@pytest.mark.parametrize("split", ["M", "N"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_allmax_makes_sharded_match(recipe, split):
    x, w, g = _inputs(seed=3)
    y, gx, gw = _run(fp8_linear, x, w, g, recipe=recipe)
    ys, gxs, gws = _sharded(x, w, g, recipe, split, allreduce=True)
    # Same scales, so the same fp8 operands: the split outputs are bitwise equal; the
    # contracted gradient only differs by summing two fp32 partial GEMMs.
    concat, concat_ref, summed, summed_ref = (gxs, gx, gws, gw) if split == "M" else (gws, gw, gxs, gx)
    assert torch.equal(ys, y) and torch.equal(concat, concat_ref)
    torch.testing.assert_close(summed, summed_ref, rtol=1e-5, atol=1e-4)
    if recipe == "tensorwise":  # local scales differ per shard: the hook is what makes it exact
        assert not torch.equal(_sharded(x, w, g, recipe, split, allreduce=False)[0], y)


@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_matches_eager(recipe):
    # fullgraph: any graph break raises. The backward graph is compiled by inductor too.
    x, w, g = _inputs(torch.bfloat16, 4)
    compiled = torch.compile(fp8_linear, fullgraph=True, backend="inductor")
    for c, e in zip(_run(compiled, x, w, g, recipe=recipe), _run(fp8_linear, x, w, g, recipe=recipe)):
        assert torch.equal(c, e)
