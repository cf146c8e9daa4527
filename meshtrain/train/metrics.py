"""What a run measures: model FLOPs per token, MFU against the device's peak, memory.

MFU = achieved model FLOP/s per device / the device's dense peak for the run's precision.
Model FLOPs per token = 6 x (weight-matrix parameters) + 12 x layers x dim x seq_len
(Llama's; attention_flops_per_token counts any family's from its attention shapes):
the first term is the forward (2) and backward (4) of every weight matmul (token and
position embedding lookups are not matmuls, nor are norm scales and biases; the output
head is, tied or not); the second
is the attention scores and the weighted sum of values, counted over the full square as
Megatron, TorchTitan and PaLM's appendix B do (causal masking does not reduce it).
Activation recomputation is not counted: it is hardware FLOPs, not model FLOPs.
"""

from __future__ import annotations

import resource
import sys

import torch

from ..models.cost_terms import attention_flops

# Dense peak TFLOP/s per device (no sparsity), from the vendors' data sheets. fp32 runs on
# tensor cores as TF32. Devices missing here report no MFU.
PEAK_TFLOPS = {
    "H200": {"fp32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "H100 SXM": {"fp32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "H100 PCIe": {"fp32": 378.0, "bf16": 756.0, "fp16": 756.0},
    "A100": {"fp32": 156.0, "bf16": 312.0, "fp16": 312.0},
}

EMBEDDING_TABLES = ("tok_emb", "pos_emb")


def flops_per_token(model, seq_len: int) -> float:
    """Model FLOPs to train on one token (forward + backward) of `model` (a ModelDef), as
    in the module docstring. Of the stacked expert weights a token uses top_k of
    num_experts; multi-token prediction's modules run the head once more each."""
    specs, cfg = model.specs, model.cfg
    matrices = sum(s.numel for n, s in specs.items() if len(s.shape) == 2 and n not in EMBEDDING_TABLES)
    moe = getattr(cfg, "moe", None)
    experts = sum(s.numel for s in specs.values() if "experts" in s.axes)
    active = experts * moe.top_k / moe.num_experts if moe is not None else 0
    head = specs["tok_emb" if cfg.tie_embeddings else "output"].numel
    matmul = matrices + active + (head if cfg.tie_embeddings else 0) + _mtp_depth(cfg) * head
    return 6.0 * matmul + attention_flops_per_token(model, seq_len)


def attention_flops_per_token(model, seq_len: int) -> float:
    """The attention term per token over `seq_len` keys, forward and backward (x 3), of
    every block, multi-token prediction's included (models/cost_terms.py attention_flops:
    the shapes the family's own forward gives attention; 12 x dim x seq_len for Llama)."""
    return 3.0 * attention_flops(model, seq_len) * (model.cfg.n_layers + _mtp_depth(model.cfg))


def _mtp_depth(cfg) -> int:
    mtp = getattr(cfg, "mtp", None)
    return mtp.depth if mtp is not None else 0


def device_peak_tflops(device: torch.device, precision: str) -> float | None:
    """The dense peak MFU is counted against. fp8 runs count against the bf16 peak (as
    TorchTitan reports them): their attention, norms and head run in bf16, and fp8 and bf16
    MFU stay comparable (higher is faster)."""
    if device.type != "cuda":
        return None
    precision = "bf16" if precision == "fp8" else precision
    name = torch.cuda.get_device_name(device)
    for key in ("H200", "A100"):
        if key in name:
            return PEAK_TFLOPS[key].get(precision)
    if "H100" in name:
        return PEAK_TFLOPS["H100 PCIe" if "PCIe" in name else "H100 SXM"].get(precision)
    return None


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: device memory allocated on CUDA, resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib / (2**30 if sys.platform == "darwin" else 2**20)
