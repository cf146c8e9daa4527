"""Mixture-of-experts compute, mesh-free: grouped expert matmuls, the SwiGLU expert MLP,
routing slots sorted by expert, and capacity-based token dropping.

Tokens reach the experts as rows of one (N, d) tensor grouped contiguously by expert, with
`counts` (E,) rows per expert: the layout `sort_by_expert` produces."""

from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.nn.functional as F

from ..errors import ConfigError

# ---------------------------------------------------------------- grouped matmul
#
# torch._grouped_mm does all experts in one kernel, but on torch 2.13 its fake (meta) kernel
# accepts bf16 only, so fp32 cannot be traced by torch.compile, and its autograd backward
# fails on CPU ("Invalid strides/sizes"). So the forward and the backward are each an
# opaque custom op: graphs compile with fullgraph=True on either path, and the backward is
# the two products below. Inside the ops the per-expert fallback may read the row counts
# back (.tolist(), a host sync on GPU) without breaking the graph.

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes x (N, in) @ w (E, out, in)^T and both backward products:
    one dtype among fp32/bf16/fp16, on CPU or CUDA, with in and out features each a multiple of
    16 bytes (its stride rule: a multiple of 4 in fp32, of 8 in bf16/fp16). Operands are made
    contiguous by the caller. Measured on CPU; CUDA (a CUTLASS kernel for bf16) is untested here."""
    itemsize = x.element_size()
    return (x.dtype == w.dtype and x.dtype in _GROUPED_DTYPES and x.device.type in ("cpu", "cuda")
            and w.shape[1] * itemsize % 16 == 0 and w.shape[2] * itemsize % 16 == 0)


def _sizes(offs: torch.Tensor) -> list[int]:
    return torch.diff(offs, prepend=offs.new_zeros(1)).tolist()


@torch.library.custom_op("meshtrain::grouped_linear", mutates_args=())
def _grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, grouped: bool) -> torch.Tensor:
    if grouped:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    return torch.cat([rows @ w[e].T for e, rows in enumerate(x.split(_sizes(offs)))])


@_grouped_linear.register_fake
def _(x, w, offs, grouped):
    return x.new_empty((x.shape[0], w.shape[1]))


@torch.library.custom_op("meshtrain::grouped_linear_backward", mutates_args=())
def _grouped_linear_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                             grouped: bool) -> list[torch.Tensor]:
    if grouped:
        # dW[e] = dy_e^T x_e: the 2-D x 2-D form groups the contraction (row) dimension, and
        # gives zeros for an expert without rows.
        return [torch._grouped_mm(dy, w, offs=offs), torch._grouped_mm(dy.t(), x, offs=offs)]
    sizes = _sizes(offs)
    dys, xs = dy.split(sizes), x.split(sizes)
    return [torch.cat([d @ w[e] for e, d in enumerate(dys)]),
            torch.stack([d.T @ r for d, r in zip(dys, xs)])]


@_grouped_linear_backward.register_fake
def _(dy, x, w, offs, grouped):
    return [x.new_empty(x.shape), w.new_empty(w.shape)]


def _setup_context(ctx, inputs, output):
    x, w, offs, ctx.grouped = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, dy):
    x, w, offs = ctx.saved_tensors
    # Autograd may hand over an expanded (stride 0) gradient, which _grouped_mm rejects.
    dx, dw = _grouped_linear_backward(dy.contiguous(), x, w, offs, ctx.grouped)
    return dx, dw, None, None


_grouped_linear.register_autograd(_backward, setup_context=_setup_context)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-expert linear maps without bias. x (N, in) holds the rows of expert 0, then of
    expert 1, ..., counts (E,) how many each (summing to N; zero allowed); w (E, out, in).
    Row r of expert e gives x[r] @ w[e].T; returns (N, out). Differentiable w.r.t. x and w.

    One torch._grouped_mm call per product where `_grouped_mm_ok` (e.g. fp32 with in and out multiples of
    4), else a loop over experts with the same numbers. Both paths compile with
    fullgraph=True: counts stay a tensor outside the opaque ops, so shapes stay static."""
    offs = counts.cumsum(0).to(torch.int32)
    return _grouped_linear(x.contiguous(), w.contiguous(), offs, _grouped_mm_ok(x, w))


def expert_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  counts: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The SwiGLU MLP of each expert over rows grouped as for `grouped_linear`:
    (silu(x W_gate^T) * (x W_up^T) * scale) W_down^T. x (N, d); w_gate, w_up (E, F, d);
    w_down (E, d, F); counts (E,). `scale` (N,), e.g. the routing gates, multiplies each row's
    hidden activation: the down projection is linear, so this equals scaling the output,
    and it is folded in where the activation is rounded anyway. Returns (N, d)."""
    h = F.silu(grouped_linear(x, w_gate, counts)) * grouped_linear(x, w_up, counts)
    if scale is not None:
        h = (h * scale[:, None]).to(h.dtype)  # fp32 gates round once, into the compute dtype
    return grouped_linear(h, w_down, counts)


# ---------------------------------------------------------------- routing

def sort_by_expert(expert_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing slots (T, k) flattened and sorted by expert: returns `order` (T*k,), the
    flat slot indices in expert order (slot s is choice s % k of token s // k), and `counts`
    (E,) slots per expert. The sort is stable, so the result is deterministic and each
    expert's slots stay in token order."""
    flat = expert_idx.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots each expert keeps: ceil(capacity_factor * tokens * top_k / num_experts), so 1.0 is
    room for a perfectly balanced routing. At least 1 whenever there are tokens, as
    capacity_factor must be positive."""
    if capacity_factor <= 0:
        raise ConfigError(f"capacity_factor {capacity_factor}: must be positive (e.g. 1.25)")
    # The factor's decimal value as written: 1.1 * 100 * 2 / 4 is 55, not ceil(55.00000000000001).
    return math.ceil(Fraction(str(capacity_factor)) * tokens * top_k / num_experts)


def capacity_keep(expert_idx: torch.Tensor, gates: torch.Tensor, num_experts: int,
                  capacity: int) -> torch.Tensor:
    """Token dropping: which routing slots (T, k) their expert keeps. Each expert keeps at most
    `capacity` of the slots routed to it, those of highest gate; ties go to the earlier token,
    then the lower choice. A dropped slot contributes nothing (the residual carries its token
    on unchanged). Returns a bool (T, k)."""
    flat, n = expert_idx.reshape(-1), expert_idx.numel()
    # Stable sorts, the last by expert: (expert, -gate, slot) order, and slot order is (token, choice).
    by_gate = torch.argsort(gates.reshape(-1), descending=True, stable=True)
    order = by_gate[torch.argsort(flat[by_gate], stable=True)]
    counts = torch.bincount(flat, minlength=num_experts)
    rank = torch.arange(n, device=flat.device) - (counts.cumsum(0) - counts)[flat[order]]
    keep = torch.zeros(n, dtype=torch.bool, device=flat.device).scatter(0, order, rank < capacity)
    return keep.view(expert_idx.shape)
