"""MFU of meshtrain's single-device training step, against Hugging Face transformers.

One training step (forward, backward, global grad-norm clipping at --grad-clip: 1.0, 0.25
with --tiny, below that config's natural norm of ~0.55 so the clip engages; AdamW lr 3e-4,
betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on >= 2-D parameters only) of the same
Llama, from the same initial parameters (meshtrain's `init_slice`, seed 0), on the same
batches, in one process on one device:

  ours          meshtrain make_train_step(model, precision=..., compile=True): fp32 master
                parameters and optimizer state, parameters cast to bf16 where used; the
                loss and the AdamW/clip update each one torch.compile(fullgraph=True) graph
                (--no-compile: eager)
  hf-eager      transformers.LlamaForCausalLM of the same config (meshtrain.interop.hf's
                config and name mapping), fp32 parameters, forward under
                torch.autocast(bf16), mean cross-entropy on fp32 logits,
                torch.nn.utils.clip_grad_norm_(--grad-clip, foreach=True),
                torch.optim.AdamW(fused=True on CUDA, foreach on CPU; decay on >= 2-D only).
                Attention (--hf-attn): "sdpa-causal" (default), a function registered through
                transformers' AttentionInterface that calls F.scaled_dot_product_attention
                (is_causal=True, enable_gqa, no mask tensor), as ours does; or "sdpa", the
                stock one, which under torch.compile (transformers 5.17, torch 2.11) ran
                the same cuDNN attention kernels ~2.8x slower on an H100 (consistent with a
                materialised causal mask; docs/performance.md)
  hf-compiled   the same, the loss function (forward + cross-entropy) in torch.compile
                (optimizer and clipping stay as they are: fused AdamW is one kernel already)

The headline ratio is ours over the FASTEST reference measured (`--ref` picks which run).

Order of work, each implementation in turn (only one is on the device at a time, so a
~1B model fits at seq 4096): build it, run --warmup steps (the first includes the
compile, reported as compile_s, never counted in tokens/s), check its warm-up losses
against the first implementation run (hf-eager when it runs) at rtol 2e-2 under bf16 /
1e-4 under fp32, its warm-up grad norms (before clipping) at GRAD_NORM_RTOL (and, under
fp32, the parameters after the warm-up, per tensor |p - p_ref| / |p_ref - p_init| <=
1e-3); the JSON says in how many warm-up steps the clip engaged (clipped_steps); if
anything differs the bench prints REFUSING TO
REPORT and exits 1 before timing that implementation, and reports nothing. Then --rounds
rounds of --steps steps each (the device synchronised around each round); tokens/s is the
median over rounds. FLOPs per token: meshtrain.train.metrics.flops_per_token (6 x matmul
parameters, the tied head counted, + 12 x layers x dim x seq attention over the full
square, as Megatron/TorchTitan count it); peak: meshtrain.train.metrics.device_peak_tflops
(H100 SXM dense bf16 989.4 TFLOP/s), or --peak-tflops.

    python bench/mfu.py                       # llama3-1b shape (configs/llama3-1b.yaml), 2 x 4096, bf16, CUDA
    python bench/mfu.py --no-compile --batch 1 --json out.json
    python bench/mfu.py --tiny --json out.json   # seconds on a CPU (fp32 there, ours eager): for CI
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshtrain import AdamW, TrainState, build, make_train_step  # noqa: E402
from meshtrain.interop.hf import hf_layout, to_hf_config  # noqa: E402
from meshtrain.models import llama  # noqa: E402
from meshtrain.models.spec import init_slice  # noqa: E402
from meshtrain.train.metrics import device_peak_tflops, flops_per_token  # noqa: E402

# fp8 against the bf16 references: fp8 GEMM rounding (3 mantissa bits forward, 2 in the
# gradients) on top of bf16's; measured ~1e-2 on the tiny CPU config.
LOSS_RTOL = {"bf16": 2e-2, "fp32": 1e-4, "fp8": 5e-2}
UPDATE_RTOL = 1e-3  # fp32 only; see bench/step_cpu.py (measured here 3.1e-5 with the clip engaged)
# Every warm-up step's grad norm (before clipping) against the reference's. Measured, max
# relative difference over the warm-up: fp32 2.2e-7 (tiny, CPU); bf16 8.0e-5 (tiny, CPU) and
# 1.6e-4 (first step, llama3-1b on an H100, docs/performance.md); fp8 1.1e-3 tensorwise, 1.2e-3
# rowwise (tiny, CPU; not measured on a GPU). About 10x (fp32), 6x (bf16), 4x (fp8) the largest.
GRAD_NORM_RTOL = {"fp32": 2e-6, "bf16": 1e-3, "fp8": 5e-3}
OPTIMIZER = AdamW(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

# configs/llama3-1b.yaml's model (Llama 3.2 1B shape: tied embeddings, no RoPE scaling).
FULL = dict(dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256, rope_theta=500000.0,
            batch=2, seq=4096, micro=1, warmup=3, steps=10, rounds=3, grad_clip=1.0)
# grad_clip 0.25: the tiny config's natural grad norm is ~0.55, so every step is clipped and
# the clip's scaling is part of what the check compares.
TINY = dict(dim=64, layers=2, heads=4, kv_heads=2, ffn=176, vocab=256, rope_theta=10000.0,
            batch=4, seq=64, micro=2, warmup=2, steps=3, rounds=2, grad_clip=0.25)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--tiny", action="store_true",
                   help="small config for CI (seconds on a CPU; ours eager unless --compile)")
    m = p.add_argument_group("model and batch (defaults: configs/llama3-1b.yaml; --tiny: a small one)")
    for flag, typ in (("dim", int), ("layers", int), ("heads", int), ("kv-heads", int), ("ffn", int),
                      ("vocab", int), ("rope-theta", float)):
        m.add_argument(f"--{flag}", type=typ, default=None)
    m.add_argument("--untied", action="store_true", help="separate output head (default: tied, as llama3-1b)")
    m.add_argument("--batch", type=int, default=None, help="sequences per micro-step")
    m.add_argument("--seq", type=int, default=None)
    m.add_argument("--micro", type=int, default=None, help="micro-steps per step (gradient accumulation)")
    r = p.add_argument_group("run")
    r.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    r.add_argument("--precision", choices=("bf16", "fp32", "fp8"), default=None,
                   help="default bf16 on CUDA, fp32 on CPU; fp8: ours with fp8 GEMMs (torch._scaled_mm), the "
                        "references in bf16")
    r.add_argument("--fp8-recipe", choices=("tensorwise", "rowwise"), default="tensorwise")
    c = r.add_mutually_exclusive_group()
    c.add_argument("--compile", dest="compile", action="store_true", default=None, help="ours compiled")
    c.add_argument("--no-compile", dest="compile", action="store_false", help="ours eager")
    r.add_argument("--ref", choices=("eager", "compiled", "both", "none"), default=None,
                   help="which Hugging Face references run (default: both on CUDA, eager on CPU)")
    r.add_argument("--hf-attn", choices=("sdpa", "sdpa-causal"), default="sdpa-causal",
                   help="transformers' attention: sdpa-causal (registered here: no mask tensor, is_causal=True, "
                        "as ours) or the stock sdpa")
    r.add_argument("--grad-clip", type=float, default=None,
                   help="global grad-norm clip (default 1.0; --tiny 0.25, below its natural norm)")
    r.add_argument("--warmup", type=int, default=None, help="untimed steps (compile + checks)")
    r.add_argument("--steps", type=int, default=None, help="timed steps per round")
    r.add_argument("--rounds", type=int, default=None, help="measurement rounds (median reported)")
    r.add_argument("--peak-tflops", type=float, default=None, help="override the device's dense peak")
    r.add_argument("--profile", action="store_true", help="profile 2 steps of each: device time by kernel kind")
    r.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    defaults = TINY if args.tiny else FULL
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(args.device)
    if args.precision is None:
        args.precision = "bf16" if dev.type == "cuda" else "fp32"
    if args.compile is None:
        args.compile = not args.tiny
    if args.ref is None:
        args.ref = "both" if dev.type == "cuda" else "eager"
    if min(args.warmup, args.steps, args.rounds) < 1:
        p.error("--warmup, --steps and --rounds must be >= 1")
    return args


# --------------------------------------------------------------------------- setup


def model_config(args) -> llama.LlamaConfig:
    return llama.LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                             ffn_dim=args.ffn, vocab_size=args.vocab, max_seq_len=args.seq,
                             rope_theta=args.rope_theta, tie_embeddings=not args.untied)


def make_batches(cfg, args, device, n: int = 4, seed: int = 1234) -> list[dict]:
    """n batches of (micro, batch, seq) tokens and next-token targets, every target valid."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, cfg.vocab_size, (args.micro, args.batch, args.seq + 1), generator=g)
        out.append({"tokens": t[..., :-1].contiguous().to(device), "targets": t[..., 1:].contiguous().to(device),
                    # as meshtrain.run.fit passes it: no count (and no device sync) per step
                    "num_targets": args.micro * args.batch * args.seq})
    return out


class Impl:
    """One implementation: step(batch) -> {"loss", "grad_norm"}; params() in meshtrain names."""

    def __init__(self, name, step, params, release):
        self.name, self.step, self.params, self.release = name, step, params, release


def build_ours(args, model, init, device) -> Impl:
    params = {n: v.to(device, copy=True).requires_grad_() for n, v in init.items()}  # init stays untouched
    state = TrainState.create(params)
    step = make_train_step(model, optimizer=OPTIMIZER, precision=args.precision, fp8_recipe=args.fp8_recipe,
                           grad_clip=args.grad_clip, compile=args.compile)
    name = "ours" if args.compile else "ours-eager"
    return Impl(name, lambda b: step(state, b), lambda: state.params, lambda: None)


def _register_causal_sdpa() -> str:
    """An attention implementation for transformers' AttentionInterface: no mask built,
    F.scaled_dot_product_attention(is_causal=True, enable_gqa=True), as meshtrain's. Stock
    "sdpa" does the same when eager, but under torch.compile transformers may build the
    causal mask as a tensor and pass it to SDPA (no causal block skipping). Every sequence
    here is full length with no padding, so the two compute the same attention."""
    import transformers
    from transformers.masking_utils import AttentionMaskInterface

    def causal_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=True,
                                             enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2).contiguous(), None

    transformers.AttentionInterface.register("sdpa_causal", causal_sdpa)
    AttentionMaskInterface.register("sdpa_causal", lambda *args, **kwargs: None)
    return "sdpa_causal"


def build_hf(args, cfg, init, device, compiled: bool) -> Impl:
    import transformers

    hf_cfg = transformers.LlamaConfig.from_dict(to_hf_config("llama", cfg, dtype="fp32"))
    hf_cfg._attn_implementation = _register_causal_sdpa() if args.hf_attn == "sdpa-causal" else "sdpa"
    hf_cfg.use_cache = False
    with torch.device(device):
        module = transformers.LlamaForCausalLM(hf_cfg)
    module.train()
    ours_name = {t.name: t.pieces[0].ours for t in hf_layout("llama", cfg)}
    own = dict(module.named_parameters())  # a tied lm_head is the embedding itself: listed once
    if set(own) != set(ours_name):
        raise RuntimeError(f"HF parameter names differ from the layout: only HF {sorted(set(own) - set(ours_name))}, "
                           f"only layout {sorted(set(ours_name) - set(own))}")
    if cfg.tie_embeddings and module.lm_head.weight is not module.model.embed_tokens.weight:
        raise RuntimeError("tie_word_embeddings is set but lm_head.weight is not the embedding table")
    with torch.no_grad():
        for hf_name, p in own.items():
            p.copy_(init[ours_name[hf_name]])
    decay = [p for p in module.parameters() if p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.ndim < 2]
    kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": OPTIMIZER.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=OPTIMIZER.lr, betas=OPTIMIZER.betas, eps=OPTIMIZER.eps, **kind)
    plist = list(module.parameters())
    amp = args.precision in ("bf16", "fp8")

    def loss_fn(tokens, targets):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = module(input_ids=tokens, use_cache=False).logits
        # Mean over the micro-batch's tokens, on fp32 logits (as HF's own ForCausalLMLoss does).
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    forward = torch.compile(loss_fn) if compiled else loss_fn

    def step(batch):
        tokens, targets = batch["tokens"], batch["targets"]
        micro = tokens.shape[0]
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(micro):
            loss = forward(tokens[m], targets[m]) / micro  # equal-sized micro-batches, every target valid
            loss.backward()
            total = total + loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(plist, args.grad_clip, foreach=True)
        opt.step()
        return {"loss": float(total), "grad_norm": float(norm)}

    def params():
        return {ours_name[n]: p for n, p in own.items()}

    def release():
        own.clear()
        plist.clear()
        opt.state.clear()

    return Impl("hf-compiled" if compiled else "hf-eager", step, params, release)


# --------------------------------------------------------------------------- measuring


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


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")):
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"  # as meshtrain fit sets it
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = model_config(args)
    model = build("llama", cfg)
    specs = model.specs
    t0 = time.perf_counter()
    init = {n: init_slice(s, n, seed=0) for n, s in specs.items()}  # CPU, copied onto the device per impl
    init_s = time.perf_counter() - t0
    n_params = sum(v.numel() for v in init.values())
    tokens_per_step = args.micro * args.batch * args.seq
    fpt = flops_per_token(model, args.seq)
    peak = args.peak_tflops or device_peak_tflops(device, args.precision)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": dev_name,
           "hf_attn": args.hf_attn,
           "cuda": torch.version.cuda if device.type == "cuda" else None}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
        if args.ref != "none":
            print("transformers is not installed: pip install transformers, or --ref none", file=sys.stderr)
            return 2
    print(f"model: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads / {cfg.n_kv_heads} kv, ffn {cfg.ffn_dim}, "
          f"vocab {cfg.vocab_size}, {'tied' if cfg.tie_embeddings else 'untied'}, rope theta {cfg.rope_theta:g}; "
          f"{n_params / 1e6:.1f}M params; {args.micro} x {args.batch} x {args.seq} = {tokens_per_step} tokens/step; "
          f"{args.precision}; {fpt / 1e9:.3f} GFLOP/token; transformers attention: {args.hf_attn}")
    print(f"device: {dev_name}, torch {env['torch']}, transformers {env['transformers']}; peak "
          f"{peak if peak else 'unknown'} TFLOP/s ({args.precision}, dense)", flush=True)

    batches = make_batches(cfg, args, device)
    rtol = LOSS_RTOL[args.precision]
    plan = []
    if args.ref in ("eager", "both"):
        plan.append(("hf-eager", lambda: build_hf(args, cfg, init, device, compiled=False)))
    plan.append(("ours" if args.compile else "ours-eager", lambda: build_ours(args, model, init, device)))
    if args.ref in ("compiled", "both"):
        plan.append(("hf-compiled", lambda: build_hf(args, cfg, init, device, compiled=True)))

    results, errors, skipped = {}, [], {}
    base_name = base = base_params = None
    for name, make in plan:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        print(f"{name}: warm-up {args.warmup} steps (compile included) ...", flush=True)
        try:
            impl = make()
            info = warmup(impl, batches, args.warmup, device, args.grad_clip)
        except Exception as e:
            if name != "hf-compiled":
                raise
            # An optional reference: report without it rather than lose the run.
            import traceback

            traceback.print_exc()
            skipped[name] = f"{type(e).__name__}: {e}"[:2000]
            print(f"  {name} failed, left out: {skipped[name].splitlines()[0]}", flush=True)
            impl = None
            torch._dynamo.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        print(f"  first step {info['first_step_s']:.1f} s; losses {', '.join(f'{x:.5f}' for x in info['losses'])}; "
              f"grad norms {', '.join(f'{x:.4f}' for x in info['grad_norms'])} (clip {args.grad_clip:g} engaged in "
              f"{info['clipped_steps']} of {args.warmup})", flush=True)
        if base is None:
            base_name, base = name, info
            if args.precision == "fp32":
                base_params = {n: p.detach().cpu().clone() for n, p in impl.params().items()}
        else:
            fp32 = args.precision == "fp32"
            c, errs = check(name, info, base_name, base, rtol, GRAD_NORM_RTOL[args.precision],
                            impl.params() if fp32 else None, base_params, init if fp32 else None)
            info["check_vs_" + base_name] = c
            print("  vs " + base_name + ": " + ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in c.items()), flush=True)
            if errs:
                errors += errs
                print("REFUSING TO REPORT: the implementations do not compute the same step:", file=sys.stderr)
                for e in errors:
                    print("  " + e, file=sys.stderr)
                return 1
        per = measure(impl, batches, args.rounds, args.steps, tokens_per_step, device)
        info["tokens_per_s_rounds"] = per
        info["tokens_per_s"] = statistics.median(per)
        info["ms_per_step"] = 1e3 * tokens_per_step / info["tokens_per_s"]
        info["peak_memory_gib"] = (torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None
        # Reserved over allocated at the peak: the caching allocator's slack, which
        # meshtrain plan states (estimate/memory.py ALLOCATOR_SLACK) and this measures.
        info["peak_reserved_gib"] = (torch.cuda.max_memory_reserved(device) / 2**30) if device.type == "cuda" else None
        print(f"  {info['tokens_per_s']:,.0f} tokens/s (rounds {', '.join(f'{x:,.0f}' for x in per)}), "
              f"{info['ms_per_step']:.1f} ms/step"
              + (f", peak memory {info['peak_memory_gib']:.1f} GiB allocated, {info['peak_reserved_gib']:.1f} GiB "
                 f"reserved" if info["peak_memory_gib"] else ""), flush=True)
        if args.profile:
            try:
                info["profile"] = pr = profile(impl, batches, device)
            except Exception as e:  # the profile is extra: never lose the measurement to it
                print(f"  profile failed: {type(e).__name__}: {e}", flush=True)
                info["profile"] = pr = None
        if args.profile and pr:
            print(f"  profile: wall {pr['wall_ms_per_step']:.1f} ms/step, device busy {pr['device_busy_ms_per_step']:.1f}: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in pr["device_ms_per_step_by_kind"].items()), flush=True)
        results[name] = info
        release(impl, device)
        del impl

    ours_name = "ours" if args.compile else "ours-eager"
    ours = results[ours_name]
    refs = {n: r for n, r in results.items() if n.startswith("hf-")}
    best_ref = max(refs, key=lambda n: refs[n]["tokens_per_s"]) if refs else None
    ref_tps = refs[best_ref]["tokens_per_s"] if best_ref else None
    ratio = ours["tokens_per_s"] / ref_tps if ref_tps else None

    def mfu(tps):
        return tps * fpt / (peak * 1e12) if peak else None

    print()
    print(f"{'implementation':14s} {'compile s':>9s} {'tokens/s':>10s} {'ms/step':>8s} {'TFLOP/s':>8s} {'MFU':>6s} "
          f"{'peak GiB':>8s} {'vs ' + (best_ref or '-'):>15s}")
    for name, r in results.items():
        r["tflops"] = r["tokens_per_s"] * fpt / 1e12
        r["mfu"] = mfu(r["tokens_per_s"])
        mfu_s = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem_s = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] else "-"
        vs_s = f"{r['tokens_per_s'] / ref_tps:.2f}x" if ref_tps else "-"
        print(f"{name:14s} {r['compile_s']:9.1f} {r['tokens_per_s']:10,.0f} {r['ms_per_step']:8.1f} "
              f"{r['tflops']:8.1f} {mfu_s:>6s} {mem_s:>8s} {vs_s:>15s}")
    print(f"\n{ours_name}: {ours['tokens_per_s']:,.0f} tokens/s, {ours['tflops']:.1f} TFLOP/s"
          + (f", MFU {100 * ours['mfu']:.1f}% of {peak:g} TFLOP/s" if ours["mfu"] is not None else ", MFU n/a (no peak)")
          + (f"; reference ({best_ref}) {ref_tps:,.0f} tokens/s; ratio {ratio:.2f}x" if ratio else ""))

    if args.json:
        args.json.write_text(json.dumps({
            "tokens_per_s": ours["tokens_per_s"], "mfu": ours["mfu"], "reference_tokens_per_s": ref_tps,
            "ratio": ratio, "reference": best_ref, "ours": ours_name, "tflops": ours["tflops"],
            "peak_tflops": peak, "flops_per_token": fpt, "compile_s": ours["compile_s"],
            "peak_memory_gib": ours["peak_memory_gib"], "peak_reserved_gib": ours["peak_reserved_gib"], "env": env,
            "init_s": init_s, "skipped": skipped,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"}
            | {"params": n_params, "tokens_per_step": tokens_per_step},
            "results": results,
        }, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
