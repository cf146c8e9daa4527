"""Pure building blocks shared by the model families."""

from __future__ import annotations

import math

import torch


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or wider when it is wider."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _over_rows(t: torch.Tensor) -> tuple[int, ...]:
    """The dims a per-feature weight's gradient sums over: all but the last."""
    return tuple(range(t.ndim - 1))


def _rms(xf, weight, eps, dtype):
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(dtype) * weight, rstd


def _layer(xf, weight, bias, eps, dtype):
    mean = xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
    return ((xf - mean) * rstd).to(dtype) * weight + bias, mean, rstd


class _RMSNorm(torch.autograd.Function):
    """RMSNorm keeping for backward only its input in its own dtype and one fp32 rsqrt
    per row: autograd of the plain ops would keep an fp32 copy of the input and the
    normalised value besides (6 bytes per element under bf16 instead of 2).

    The backward is the plain ops' term by term, so it rounds as they did (fp8 runs are
    sensitive to it); x comes twice because in fp32 the plain ops read x itself twice,
    and autograd adds each term to x's gradient on its own, after the residual's."""

    @staticmethod
    def forward(ctx, x, x_again, weight, eps):
        xf = _upcast(x)
        y, rstd = _rms(xf, weight, eps, x.dtype)
        ctx.terms_apart = xf is x
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xf = _upcast(x)
        grad_w = (grad * (xf * rstd).to(x.dtype)).sum(_over_rows(grad)).to(weight.dtype)
        g = _upcast(grad * weight)
        grad_scaled = g * rstd  # through x * rstd
        grad_rstd = (g * xf).sum(-1, keepdim=True)
        grad_sq = (-0.5 * grad_rstd * rstd.pow(3)).expand_as(xf) / xf.shape[-1]
        grad_squared = grad_sq * (2 * xf)  # through x.pow(2)
        if ctx.terms_apart:
            return grad_scaled, grad_squared, grad_w, None
        return (grad_scaled + grad_squared).to(x.dtype), None, grad_w, None


class _LayerNorm(torch.autograd.Function):
    """LayerNorm keeping its input in its own dtype and the fp32 mean and rsqrt per row;
    backward as _RMSNorm's (x comes three times: the plain ops read it thrice)."""

    @staticmethod
    def forward(ctx, x, x_again, x_thrice, weight, bias, eps):
        xf = _upcast(x)
        y, mean, rstd = _layer(xf, weight, bias, eps, x.dtype)
        ctx.terms_apart = xf is x
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, rstd = ctx.saved_tensors
        centred = _upcast(x) - mean
        rows, width = _over_rows(grad), x.shape[-1]
        grad_w = (grad * (centred * rstd).to(x.dtype)).sum(rows).to(weight.dtype)
        g = _upcast(grad * weight)
        grad_out = g * rstd  # through the output's (x - mean)
        grad_rstd = (g * centred).sum(-1, keepdim=True)
        grad_var = (-0.5 * grad_rstd * rstd.pow(3)).expand_as(centred) / width
        grad_in = grad_var * (2 * centred)  # through the variance's (x - mean)
        grad_mean = ((-grad_in).sum(-1, keepdim=True) + (-grad_out).sum(-1, keepdim=True)).expand_as(centred) / width
        if ctx.terms_apart:
            return grad_out, grad_in, grad_mean, grad_w, grad.sum(rows), None
        return (grad_out + grad_in + grad_mean).to(x.dtype), None, None, grad_w, grad.sum(rows), None


# Normalised in fp32 whatever the compute dtype, as the reference implementations do.
# Traced, the plain ops: the compiler picks what to keep and what to recompute itself
# (and dynamo refuses a tensor given twice to a Function).

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _rms(_upcast(x), weight, eps, x.dtype)[0]
    return _RMSNorm.apply(x, x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _layer(_upcast(x), weight, bias, eps, x.dtype)[0]
    return _LayerNorm.apply(x, x, x, weight, bias, eps)


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies, with the Llama-3 long-context rescaling when `scaling` is given
    (keys: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings),
    or YaRN's when it says type yarn (yarn_frequencies)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling and scaling.get("type") == "yarn":
        return yarn_frequencies(inv, head_dim, theta, scaling).float()
    if scaling:
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def yarn_frequencies(inv: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023): frequencies that turn fewer than beta_slow times over the
    original context are interpolated (divided by factor), those that turn more than
    beta_fast times kept, with a linear ramp over the dims between."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_of(turns: float) -> float:  # the dim whose frequency turns `turns` times over old_len
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(scaling["beta_fast"])), 0)
    high = min(math.ceil(dim_of(scaling["beta_slow"])), head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature term 0.1 x mscale x ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_table_gain(scaling: dict) -> float:
    """YaRN's factor on the cos/sin tables: mscale's term over mscale_all_dim's when both
    are set (1 when they are equal, as DeepSeek's), else the plain term."""
    factor, m, m_all = scaling["factor"], scaling["mscale"], scaling["mscale_all_dim"]
    return yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor, 1.0)


def rope_table(seq_len: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq, head_dim) in the half-split (Hugging Face) convention."""
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, scaling: dict | None = None,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE tables (seq_len, head_dim) on `device` (computed on the CPU, as decode's).
    YaRN scales them (yarn_table_gain)."""
    cos, sin = rope_table(seq_len, rope_frequencies(head_dim, theta, scaling))
    if scaling and scaling.get("type") == "yarn":
        gain = yarn_table_gain(scaling)
        cos, sin = cos * gain, sin * gain
    return cos.to(device), sin.to(device)


# A function of the config alone: under torch.compile it becomes a constant of the graph
# instead of being recomputed (in double precision, per element) inside every kernel
# that applies it, which cost ~9% of a compiled step (docs/performance.md). This is what
# torch._dynamo.assume_constant_result does; importing dynamo for it cost every process
# ~3 s at start (tests/test_compile.py checks the two agree).
rope_cos_sin._dynamo_marked_constant = True


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, seq, heads, head_dim); cos/sin (seq, head_dim), or (batch, seq, head_dim)
    when each row has positions of its own (documents restarting them)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on dims laid out in interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek's
    released weights are; the rotated pairs come out half-split (evens, then odds), which
    a dot product of two such tensors does not see. cos/sin as for apply_rope."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(-2), sin[..., :half].unsqueeze(-2)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
