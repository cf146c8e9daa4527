"""Timing, checking and profiling one implementation of bench/mfu.py: warm-up steps
(compile included), the check against the first implementation run, timed rounds and a
profile by kernel kind."""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch

UPDATE_RTOL = 1e-3  # fp32 only; see bench/step_cpu.py (measured here 3.1e-5 with the clip engaged)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warmup(impl, batches, n, device, grad_clip: float) -> dict:
    times, metrics = [], []
    for i in range(n):
        sync(device)
        t0 = time.perf_counter()
        metrics.append(impl.step(batches[i % len(batches)]))
        sync(device)
        times.append(time.perf_counter() - t0)
    # compile_s: the first step's time beyond a warm step's (compile, autotuning, allocator growth)
    return {"compile_s": max(0.0, times[0] - (statistics.median(times[1:]) if n > 1 else 0.0)),
            "first_step_s": times[0],
            "warmup_step_s": times, "losses": [m["loss"] for m in metrics],
            "grad_norms": [m["grad_norm"] for m in metrics],
            "clipped_steps": sum(m["grad_norm"] > grad_clip for m in metrics)}


def check(name, info, base_name, base, rtol, gn_rtol, params=None, base_params=None, init=None
          ) -> tuple[dict, list]:
    errors = []
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(info["losses"], base["losses"]))
    gn_rel = max(abs(a - b) / abs(b) for a, b in zip(info["grad_norms"], base["grad_norms"]))
    out = {"loss_max_rel_diff": loss_rel, "grad_norm_max_rel_diff": gn_rel}
    if not all(math.isfinite(x) for x in info["losses"] + info["grad_norms"]):
        errors.append(f"{name}: non-finite loss or grad norm {info['losses']} {info['grad_norms']}")
    if not loss_rel <= rtol:
        errors.append(f"{name}: warm-up losses differ from {base_name}'s by rel {loss_rel:.2e} > {rtol:g} "
                      f"({info['losses']} vs {base['losses']})")
    if not gn_rel <= gn_rtol:
        errors.append(f"{name}: warm-up grad norms differ from {base_name}'s by rel {gn_rel:.2e} > {gn_rtol:g} "
                      f"({info['grad_norms']} vs {base['grad_norms']})")
    if params is not None:
        upd = {n: ((params[n].detach().cpu() - base_params[n]).norm()
                   / (base_params[n] - init[n]).norm().clamp_min(1e-30)).item() for n in base_params}
        worst = max(upd, key=upd.get)
        out.update(update_max_rel_diff=upd[worst], update_worst_param=worst)
        if not upd[worst] <= UPDATE_RTOL:
            errors.append(f"{name}: after the warm-up the update of {worst} differs from {base_name}'s by rel "
                          f"{upd[worst]:.2e} > {UPDATE_RTOL:g}")
    return out, errors


def measure(impl, batches, rounds, steps, tokens_per_step, device) -> list[float]:
    per = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        for i in range(steps):
            impl.step(batches[i % len(batches)])
        sync(device)
        per.append(steps * tokens_per_step / (time.perf_counter() - t0))
    return per


# First match wins: attention kernels carry "wgmma"/"cutlass" in their names too.
KINDS = (("attention", ("flash", "fmha", "sdpa", "attention")),
         ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma")),
         ("optimizer (eager/fused)", ("multi_tensor", "foreach", "adam")),
         ("inductor update", ("triton_for_",)),
         ("inductor fused", ("triton_",)),
         ("copies/casts", ("copy_kernel", "direct_copy")))


def profile(impl, batches, device, n_steps=2) -> dict:
    """Device time per step by kernel kind, and the step's wall time, from torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with torch_profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for i in range(n_steps):
            impl.step(batches[i % len(batches)])
        sync(device)
        wall = time.perf_counter() - t0
    kinds = {k: 0.0 for k, _ in KINDS} | {"other": 0.0}
    kernels = []
    for e in prof.key_averages():
        if device.type != "cuda" or getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        # Ranges on the device timeline (Optimizer.step#AdamW.step, ProfilerStep#n) are not kernels.
        if getattr(e, "is_user_annotation", False) or e.key.startswith(("Optimizer.", "ProfilerStep")):
            continue
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        kernels.append((us / n_steps / 1e3, e.count // n_steps, e.key[:90]))
        low = e.key.lower()
        kind = next((k for k, keys in KINDS if any(s in low for s in keys)), "other")
        kinds[kind] += us / n_steps / 1e3
    busy = sum(kinds.values())
    return {"wall_ms_per_step": 1e3 * wall / n_steps, "device_busy_ms_per_step": busy,
            "device_ms_per_step_by_kind": kinds, "top_kernels_ms_count_name": sorted(kernels, reverse=True)[:12]}


def release(impl, device):
    impl.release()
    impl.step = impl.params = None
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
