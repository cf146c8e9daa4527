"""fp8 on the CPU: the eager CPU path gives the scaled GEMM and the fp8 operands of the
layout and formula it replaced, bit for bit, and a training step of configs/tiny.yaml's
model in fp8 stays within 10x of the bf16 step."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import yaml

from meshtrain import TrainState, build, make_train_step
from meshtrain.config import RunConfig
from meshtrain.models import fp8
from meshtrain.models.spec import init_slice

from support.cli import TINY

# (P, Q, R) of a @ b: odd, prime and size-1 dims, and the tiny model's own.
SHAPES = [(1, 1, 1), (3, 5, 7), (17, 33, 9), (1, 64, 31), (31, 1, 5), (512, 256, 688)]
MAX_RATIO = 10.0


def _operands(p, q, r, recipe, seed):
    """a (P,Q) and b (Q,R) quantized as fp8_linear quantizes its forward operands (b as w.T),
    with their reciprocal scales."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(p, q, generator=gen).bfloat16()
    w = (torch.randn(r, q, generator=gen) * 1e-3).bfloat16()
    a, a_inv = fp8._quantize(x, fp8.FWD_DTYPE, "x", 1, recipe, None)
    wq, w_inv = fp8._quantize(w, fp8.FWD_DTYPE, "w", 1, recipe, None)
    return a, a_inv, wq.t(), fp8._t_scale(w_inv)


@pytest.mark.parametrize("recipe", fp8.RECIPES)
@pytest.mark.parametrize("p,q,r", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_cpu_gemm_equals_scaled_mm_in_the_cuda_layout(recipe, p, q, r, out_dtype):
    """Exact: the emulated CPU kernel makes both operands row-major before its fp32 GEMM,
    so handing it b as is (row-major for the backward GEMMs) instead of column-major changes
    which copies are made, not one value. b is also given row-major, as the backward's are.
    oneDNN stays enabled around the call, as in any run: on a CPU with AMX torch would take
    oneDNN's fp8 kernel, which _mm turns off for itself and restores."""
    a, a_inv, b, b_inv = _operands(p, q, r, recipe, seed=p * q * r)
    for b_layout in (b, b.contiguous()):
        assert torch.backends.mkldnn.enabled
        ours = fp8._mm(a, a_inv, b_layout, b_inv, out_dtype)
        assert torch.backends.mkldnn.enabled
        with torch.backends.mkldnn.flags(enabled=False):
            ref = torch._scaled_mm(a.contiguous(), b_layout.t().contiguous().t(), a_inv, b_inv, out_dtype=out_dtype)
        assert ours.dtype == out_dtype and torch.equal(ours, ref)
    assert fp8._mm(a, a_inv, b, b_inv, out_dtype).abs().sum() > 0  # the test compares something


@pytest.mark.parametrize("recipe", fp8.RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,dim", [((17, 33), 0), ((17, 33), 1), ((1, 5), 1), ((64, 1), 0)])
def test_quantize_equals_quantizing_an_fp32_copy(recipe, dtype, shape, dim):
    """Exact: the amax is a max (exact in any dtype) and t * scale computes in fp32."""
    t = (torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 3).to(dtype)
    t[0, 0] = 0.0
    for fp8_dtype in (fp8.FWD_DTYPE, fp8.GRAD_DTYPE):
        q, inv = fp8._quantize(t, fp8_dtype, "x", dim, recipe, None)
        over = (0, 1) if recipe == "tensorwise" else (dim,)
        f = t.float()
        scale = torch.finfo(fp8_dtype).max / f.abs().amax(dim=over, keepdim=True).clamp(min=fp8.AMAX_EPS)
        ref = (f * scale).clamp(-torch.finfo(fp8_dtype).max, torch.finfo(fp8_dtype).max).to(fp8_dtype)
        assert q.dtype == fp8_dtype and torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
        assert torch.equal(inv, scale.reciprocal())


@pytest.fixture
def one_thread():
    """Both precisions on one intra-op thread: on a shared 2-core box a second thread makes
    every step wait for a core at each kernel, by as much as the machine's load (measured
    bf16 steps of 2.5-34 s on two threads, 0.5-0.8 s on one), and the ratio would measure
    the load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.alone
def test_fp8_step_within_10x_of_bf16_on_the_tiny_model(one_thread):
    """configs/tiny.yaml's model (3.2M parameters) and micro-batch, one micro-step per step:
    bf16, fp8 tensorwise and fp8 rowwise steps taken in turn, each timed after a first
    warm-up step; the median of 5 against bf16's. Measured 2026-11-28 (2-core CPU, one
    thread): fp8 / bf16 = 2.7-3.0 either recipe, bf16 0.075-0.087 s a step."""
    cfg = RunConfig.from_dict(yaml.safe_load(TINY.read_text()))
    model, t = build(cfg.model.arch, cfg.family_config()), cfg.train
    tokens = torch.randint(0, cfg.model.vocab_size, (1, t.micro_batch, t.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[..., :-1], "targets": tokens[..., 1:]}
    runs = {}
    for precision, recipe in [("bf16", "tensorwise"), ("fp8", "tensorwise"), ("fp8", "rowwise")]:
        params = {n: init_slice(s, n, cfg.seed).requires_grad_() for n, s in model.specs.items()}
        step = make_train_step(model, precision=precision, fp8_recipe=recipe)
        runs[f"{precision} {recipe}"] = (step, TrainState.create(params), [])
    for _ in range(6):
        for step, state, times in runs.values():
            start = time.perf_counter()
            step(state, batch)
            times.append(time.perf_counter() - start)
    median = {name: statistics.median(times[1:]) for name, (_, _, times) in runs.items()}
    bf16 = median.pop("bf16 tensorwise")
    ratios = {name: m / bf16 for name, m in median.items()}
    assert all(r < MAX_RATIO for r in ratios.values()), (bf16, ratios)
