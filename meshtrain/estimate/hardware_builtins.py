"""The built-in devices of `meshtrain plan --gpu`: SXM parts in nodes of 8, NVLink inside a
node and one InfiniBand NIC per GPU across nodes.

Sources, and what is assumed:
- peak_tflops: the vendors' data sheets, dense (no sparsity). fp32 is TF32 on tensor
  cores, as train/metrics.py's PEAK_TFLOPS counts MFU (tests check the two agree). A100
  SXM 80GB: TF32 156, BF16/FP16 312, no FP8. H100 SXM5 and H200 SXM (same compute): TF32
  494.7, BF16/FP16 989.4, FP8 1978.9. HGX B200 (1000 W): TF32 1100, BF16/FP16 2250, FP8
  4500.
- memory_bytes: data-sheet capacity (80 GB A100/H100, 141 GB H200; B200 180 GB, DGX
  B200's 1,440 GB over 8 GPUs). memory_bandwidth: data-sheet HBM bandwidth (2.039, 3.35,
  4.8, 8 TB/s); achieved copies run lower (about 4.3 TB/s measured on an H200,
  /work/.library/device/KINDS.md), which the model does not yet subtract.
- matmul: measured only at one point: an 8192^3 bf16 product at 769-798 TFLOP/s on an
  H200 (KINDS.md; docs/performance.md). So bf16/fp16 max_tflops = 0.8 x peak on every
  part (assumed to carry over), fp8 0.7 x peak and TF32 0.8 x peak (assumed), and
  half_flops = 10 us x max_tflops: a fixed cost of ~10 us per product for launch and
  tail waves (assumed; a 4096^3 product then gets 94% of max).
- attention: one measured point, cuDNN flash attention, causal, head dim 64, seq 4096,
  forward + backward, at ~307 TFLOP/s on an H100 (docs/performance.md); with half_seq
  512 (assumed) that gives max 345 for H100/H200, scaled by the bf16 peak for the others.
- links: per-rank bandwidth in one direction. NVLink: A100 600 GB/s, H100/H200 900 GB/s,
  B200 1.8 TB/s in both directions together (halved here). Across nodes one NIC per GPU:
  HDR 200 Gb/s (25 GB/s) for A100, NDR / ConnectX-7 400 Gb/s (50 GB/s) for the others.
  Latencies per algorithm step, 3 us inside a node and 10 us across nodes, are assumed
  (typical NCCL figures), not measured.
"""

from __future__ import annotations

from .hardware import Curve, Hardware, Link

_NOTES = "built-in: data-sheet peaks and bandwidths; achieved matmul, attention and latencies assumed " \
         "(meshtrain/estimate/hardware_builtins.py says which)"


def _builtin(name: str, memory_gb: float, peaks: dict[str, float], hbm_gb_s: float, nvlink_gb_s: float,
             nic_gb_s: float) -> Hardware:
    matmul = {d: Curve(p * (0.7 if d == "fp8" else 0.8), 10e-6 * p * (0.7 if d == "fp8" else 0.8) * 1e12)
              for d, p in peaks.items()}
    attention_top = 345.0 * peaks["bf16"] / 989.4
    attention = {d: Curve(min(attention_top, peaks[d]), 512.0) for d in ("fp32", "bf16", "fp16")}
    return Hardware(name=name, memory_bytes=int(memory_gb * 10**9), ranks_per_node=8, peak_tflops=dict(peaks),
                    matmul=matmul, attention=attention, memory_bandwidth=hbm_gb_s * 1e9,
                    links={"intra_node": Link(3e-6, nvlink_gb_s * 1e9), "inter_node": Link(10e-6, nic_gb_s * 1e9)},
                    notes=_NOTES)


_HOPPER = {"fp32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}
BUILTINS: dict[str, Hardware] = {
    "h100": _builtin("h100", 80, _HOPPER, 3350, 450, 50),
    "h200": _builtin("h200", 141, _HOPPER, 4800, 450, 50),
    "b200": _builtin("b200", 180, {"fp32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0}, 8000, 900, 50),
    "a100": _builtin("a100", 80, {"fp32": 156.0, "bf16": 312.0, "fp16": 312.0}, 2039, 300, 25),
}
