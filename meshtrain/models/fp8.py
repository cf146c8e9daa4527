"""An fp8 linear layer: all three GEMMs of forward and backward run through
`torch._scaled_mm` with dynamically computed (per step, from the current amax) scales."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

RECIPES = ("tensorwise", "rowwise")  # train.fp8_recipe

# Inputs and weights keep more mantissa (e4m3); gradients need more range (e5m2).
FWD_DTYPE = torch.float8_e4m3fn
GRAD_DTYPE = torch.float8_e5m2
# Floor for amax, so an all-zero tensor gets a finite scale (and quantizes to zeros).
AMAX_EPS = 1e-12

Allmax = Callable[[Tensor, str, tuple[int, ...]], Tensor]


def _quantize(t: Tensor, dtype: torch.dtype, operand: str, dim: int, recipe: str,
              allmax: Allmax | None) -> tuple[Tensor, Tensor]:
    """(t in fp8, 1/scale) with the amax taken along the GEMM's contraction dim `dim` of t
    (rowwise) or over all of t (tensorwise); 1/scale keeps t's rank (size 1 along `over`)."""
    over = (0, 1) if recipe == "tensorwise" else (dim,)
    # No fp32 copy of t: a max is exact in t's own dtype, and t * scale (an fp32 tensor)
    # computes in fp32, so the fp8 values are those of t.float() * scale.
    amax = t.abs().amax(dim=over, keepdim=True).float()
    if allmax is not None:
        amax = allmax(amax, operand, over)
    fmax = torch.finfo(dtype).max
    scale = fmax / amax.clamp(min=AMAX_EPS)
    # Saturate: the cast turns a value past fmax into inf (e5m2) or NaN (e4m3fn on CUDA),
    # should an amax (from allmax, say) ever fall short of the tensor's.
    return (t * scale).clamp_(-fmax, fmax).to(dtype), scale.reciprocal()


# _scaled_mm takes mat1 row-major and mat2 column-major. Both are no-ops when the layout
# is already right, else one copy of the 1-byte fp8 tensor (never of the bf16/fp32 one).
def _row_major(t: Tensor) -> Tensor:
    return t.contiguous()


def _col_major(t: Tensor) -> Tensor:
    return t.t().contiguous().t()


def _t_scale(inv: Tensor) -> Tensor:
    """Transpose a (1,R), (P,1) or (1,1) scale. With a size-1 dim that is a reshape; view()
    gives it the plain strides _scaled_mm checks, which t() would not (stride R on dim 1)."""
    return inv.view(inv.shape[::-1])


def _cpu_scaled_mm(a: Tensor, b: Tensor, a_inv: Tensor, b_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    """_scaled_mm's emulated CPU kernel (fp8 operands made row-major, widened to fp32, one
    fp32 GEMM, then the scales). On a CPU with AMX, torch hands fp8 to oneDNN instead, whose
    fp8 matmul there is its reference loop: 0.6 s for a 256x192x192 product on an Intel Xeon
    (2026-11-29), over 1000x the emulated kernel, and with other roundings. Off, the choice
    is the same on every CPU."""
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        return torch._scaled_mm(a, b, a_inv, b_inv, out_dtype=out_dtype)
    finally:
        torch.backends.mkldnn.enabled = enabled


# The same kernel as one opaque op for torch.compile: inductor's own lowering of _scaled_mm
# wants the CUDA layout and calls the oneDNN kernel above, and its fused kernels that write
# the column-major fp8 copies gave NaN on that Intel Xeon (AVX-512).
cpu_scaled_mm_op = torch.library.custom_op("meshtrain::cpu_scaled_mm", mutates_args=())(_cpu_scaled_mm)


@cpu_scaled_mm_op.register_fake
def _(a: Tensor, b: Tensor, a_inv: Tensor, b_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _mm(a: Tensor, a_inv: Tensor, b: Tensor, b_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a (P,Q) @ b (Q,R), dequantized by the reciprocal scales a_inv (P,1)|(1,1), b_inv (1,R)|(1,1)."""
    if a.device.type == "cpu":
        # The CPU kernel makes both operands row-major itself: a column-major b would be
        # copied there and back.
        mm = cpu_scaled_mm_op if torch.compiler.is_compiling() else _cpu_scaled_mm
        return mm(a, b, a_inv, b_inv, out_dtype)
    return torch._scaled_mm(_row_major(a), _col_major(b), a_inv, b_inv, out_dtype=out_dtype)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, recipe: str, allmax: Allmax | None) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.allmax = recipe, allmax
        # y = x @ w.T, contracting K: dim 1 of both x (M,K) and w (N,K).
        xq, x_inv = _quantize(x, FWD_DTYPE, "x", 1, recipe, allmax)
        wq, w_inv = _quantize(w, FWD_DTYPE, "w", 1, recipe, allmax)
        return _mm(xq, x_inv, wq.t(), _t_scale(w_inv), x.dtype)

    @staticmethod
    def backward(ctx, g: Tensor):
        # Requantize x and w from their saved originals: the rowwise backward GEMMs contract
        # other dims (N, M) than the forward's K, so need amaxes along those dims.
        x, w = ctx.saved_tensors
        recipe, allmax = ctx.recipe, ctx.allmax
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # grad_x (M,K) = g (M,N) @ w (N,K), contracting N
            gq, g_inv = _quantize(g, GRAD_DTYPE, "grad", 1, recipe, allmax)
            wq, w_inv = _quantize(w, FWD_DTYPE, "w", 0, recipe, allmax)
            grad_x = _mm(gq, g_inv, wq, w_inv, x.dtype)
        if ctx.needs_input_grad[1]:  # grad_w (N,K) = g.T (N,M) @ x (M,K), contracting M
            gq, g_inv = _quantize(g, GRAD_DTYPE, "grad", 0, recipe, allmax)
            xq, x_inv = _quantize(x, FWD_DTYPE, "x", 0, recipe, allmax)
            grad_w = _mm(gq.t(), _t_scale(g_inv), xq, x_inv, w.dtype)
        return grad_x, grad_w, None, None


def fp8_linear(x: Tensor, w: Tensor, recipe: str = "tensorwise", allmax: Allmax | None = None) -> Tensor:
    """y = x @ w.T like F.linear(x, w) (x (..., K), w (N, K), no bias), with all three GEMMs
    of forward and backward in fp8 via torch._scaled_mm.

    x and w are quantized to float8_e4m3fn, the incoming gradient to float8_e5m2. Scales are
    dynamic: scale = fp8_max / amax (fp32), the operand is multiplied by it, clamped to
    +-fp8_max and cast, and the GEMM multiplies its fp32 result by the reciprocal scales.
    y has x's dtype; the gradients have x's and w's dtypes.

    recipe "tensorwise": one amax per operand. "rowwise": one amax per row of each GEMM
    operand along that GEMM's contraction dim (K forward, N for grad_x, M for grad_w), as in
    torchao's rowwise recipe, so a row of small values is not flushed by a large row.

    allmax(amax, operand, over) -> amax: called on every local amax before it becomes a
    scale (forward: x then w; backward: grad and w for grad_x, then grad and x for
    grad_w). `operand` is "x", "w" or "grad", the tensor the amax was taken from, in its
    original orientation: x is (M, K) (x flattened to 2-D), w is (N, K), grad is (M, N).
    `over` is the tuple of that tensor's dims the amax was reduced over, (0, 1) for
    tensorwise, (1,) or (0,) for rowwise; amax has the tensor's rank with size 1 along `over`.
    A caller whose x, w or grad are shards of a larger tensor must return the elementwise
    max of amax over the mesh ranks that split any of that tensor's dims in `over`, and
    over no others. E.g. with M split over a data-parallel group (dim 0 of x and grad) and
    N over a tensor-parallel group (dim 0 of w, dim 1 of grad): all-reduce(MAX) "x" over dp
    if 0 in over; "w" over tp if 0 in over; "grad" over dp if 0 in over and over tp if 1 in
    over. Then every rank quantizes with exactly the scales one process holding the whole
    tensors would use, so its y and gradient shards are those of the single process (up to
    the summation order of a gradient whose contraction dim is split). Every rank calls it
    the same number of times in the same order, so it may be a collective; allmax=None
    reduces nothing (one process, or per-shard scales).
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    y = _FP8Linear.apply(x.reshape(-1, x.shape[-1]), w, recipe, allmax)
    return y.reshape(*x.shape[:-1], w.shape[0])
