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
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mfu_impls import build_hf, build_ours  # noqa: E402
from mfu_timing import check, measure, profile, release, warmup  # noqa: E402

from meshtrain import build  # noqa: E402
from meshtrain.models import llama  # noqa: E402
from meshtrain.models.spec import init_slice  # noqa: E402
from meshtrain.train.metrics import device_peak_tflops, flops_per_token  # noqa: E402

# fp8 against the bf16 references: fp8 GEMM rounding (3 mantissa bits forward, 2 in the
# gradients) on top of bf16's; measured ~1e-2 on the tiny CPU config.
LOSS_RTOL = {"bf16": 2e-2, "fp32": 1e-4, "fp8": 5e-2}
# Every warm-up step's grad norm (before clipping) against the reference's. Measured, max
# relative difference over the warm-up: fp32 2.2e-7 (tiny, CPU); bf16 8.0e-5 (tiny, CPU) and
# 1.6e-4 (first step, llama3-1b on an H100, docs/performance.md); fp8 1.1e-3 tensorwise, 1.2e-3
# rowwise (tiny, CPU; not measured on a GPU). About 10x (fp32), 6x (bf16), 4x (fp8) the largest.
GRAD_NORM_RTOL = {"fp32": 2e-6, "bf16": 1e-3, "fp8": 5e-3}

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


# --------------------------------------------------------------------------- main


def environment(args, device) -> dict | None:
    """Versions and device name for the JSON; None when a reference needs transformers
    and it is missing (said on stderr)."""
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": dev_name,
           "hf_attn": args.hf_attn, "cuda": torch.version.cuda if device.type == "cuda" else None}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
        if args.ref != "none":
            print("transformers is not installed: pip install transformers, or --ref none", file=sys.stderr)
            return None
    return env


def implementations(args, cfg, model, init, device) -> list[tuple[str, object]]:
    """(name, builder) in the order they run: the first one run is the others' check."""
    plan = []
    if args.ref in ("eager", "both"):
        plan.append(("hf-eager", lambda: build_hf(args, cfg, init, device, compiled=False)))
    plan.append(("ours" if args.compile else "ours-eager", lambda: build_ours(args, model, init, device)))
    if args.ref in ("compiled", "both"):
        plan.append(("hf-compiled", lambda: build_hf(args, cfg, init, device, compiled=True)))
    return plan


def _left_out(name: str, error: Exception, device) -> str:
    """An optional reference that failed: reported without it rather than lose the run."""
    import traceback

    traceback.print_exc()
    why = f"{type(error).__name__}: {error}"[:2000]
    print(f"  {name} failed, left out: {why.splitlines()[0]}", flush=True)
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return why


def _timed(args, impl, info, batches, device, tokens_per_step) -> None:
    """Rounds of timed steps (and the profile if asked) into info."""
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
    if not args.profile:
        return
    try:
        info["profile"] = pr = profile(impl, batches, device)
    except Exception as e:  # the profile is extra: never lose the measurement to it
        print(f"  profile failed: {type(e).__name__}: {e}", flush=True)
        info["profile"] = pr = None
    if pr:
        print(f"  profile: wall {pr['wall_ms_per_step']:.1f} ms/step, device busy {pr['device_busy_ms_per_step']:.1f}: "
              + ", ".join(f"{k} {v:.1f}" for k, v in pr["device_ms_per_step_by_kind"].items()), flush=True)


def run_all(args, plan, batches, init, device, tokens_per_step) -> tuple[dict, dict] | None:
    """Each implementation in turn: warm up, check against the first, time, release.
    Returns (results, skipped), or None when one computes another step (said on stderr)."""
    results, skipped = {}, {}
    base_name = base = base_params = None
    fp32 = args.precision == "fp32"
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
            impl, skipped[name] = None, _left_out(name, e, device)
            continue
        print(f"  first step {info['first_step_s']:.1f} s; losses {', '.join(f'{x:.5f}' for x in info['losses'])}; "
              f"grad norms {', '.join(f'{x:.4f}' for x in info['grad_norms'])} (clip {args.grad_clip:g} engaged in "
              f"{info['clipped_steps']} of {args.warmup})", flush=True)
        if base is None:
            base_name, base = name, info
            if fp32:
                base_params = {n: p.detach().cpu().clone() for n, p in impl.params().items()}
        else:
            c, errors = check(name, info, base_name, base, LOSS_RTOL[args.precision], GRAD_NORM_RTOL[args.precision],
                              impl.params() if fp32 else None, base_params, init if fp32 else None)
            info["check_vs_" + base_name] = c
            print("  vs " + base_name + ": " + ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in c.items()), flush=True)
            if errors:
                print("REFUSING TO REPORT: the implementations do not compute the same step:", file=sys.stderr)
                for e in errors:
                    print("  " + e, file=sys.stderr)
                return None
        _timed(args, impl, info, batches, device, tokens_per_step)
        results[name] = info
        release(impl, device)
        del impl
    return results, skipped


def report(results: dict, ours_name: str, fpt: float, peak: float | None) -> dict:
    """The table, and ours against the fastest reference; fills each result's tflops and mfu."""
    ours = results[ours_name]
    refs = {n: r for n, r in results.items() if n.startswith("hf-")}
    best_ref = max(refs, key=lambda n: refs[n]["tokens_per_s"]) if refs else None
    ref_tps = refs[best_ref]["tokens_per_s"] if best_ref else None
    ratio = ours["tokens_per_s"] / ref_tps if ref_tps else None
    print()
    print(f"{'implementation':14s} {'compile s':>9s} {'tokens/s':>10s} {'ms/step':>8s} {'TFLOP/s':>8s} {'MFU':>6s} "
          f"{'peak GiB':>8s} {'vs ' + (best_ref or '-'):>15s}")
    for name, r in results.items():
        r["tflops"] = r["tokens_per_s"] * fpt / 1e12
        r["mfu"] = r["tokens_per_s"] * fpt / (peak * 1e12) if peak else None
        mfu_s = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem_s = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] else "-"
        vs_s = f"{r['tokens_per_s'] / ref_tps:.2f}x" if ref_tps else "-"
        print(f"{name:14s} {r['compile_s']:9.1f} {r['tokens_per_s']:10,.0f} {r['ms_per_step']:8.1f} "
              f"{r['tflops']:8.1f} {mfu_s:>6s} {mem_s:>8s} {vs_s:>15s}")
    print(f"\n{ours_name}: {ours['tokens_per_s']:,.0f} tokens/s, {ours['tflops']:.1f} TFLOP/s"
          + (f", MFU {100 * ours['mfu']:.1f}% of {peak:g} TFLOP/s" if ours["mfu"] is not None else ", MFU n/a (no peak)")
          + (f"; reference ({best_ref}) {ref_tps:,.0f} tokens/s; ratio {ratio:.2f}x" if ratio else ""))
    return {"tokens_per_s": ours["tokens_per_s"], "mfu": ours["mfu"], "reference_tokens_per_s": ref_tps,
            "ratio": ratio, "reference": best_ref, "ours": ours_name, "tflops": ours["tflops"],
            "peak_tflops": peak, "flops_per_token": fpt, "compile_s": ours["compile_s"],
            "peak_memory_gib": ours["peak_memory_gib"], "peak_reserved_gib": ours["peak_reserved_gib"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")):
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"  # as meshtrain fit sets it
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = model_config(args)
    model = build("llama", cfg)
    t0 = time.perf_counter()
    init = {n: init_slice(s, n, seed=0) for n, s in model.specs.items()}  # CPU, copied onto the device per impl
    init_s = time.perf_counter() - t0
    n_params = sum(v.numel() for v in init.values())
    tokens_per_step = args.micro * args.batch * args.seq
    fpt = flops_per_token(model, args.seq)
    peak = args.peak_tflops or device_peak_tflops(device, args.precision)
    env = environment(args, device)
    if env is None:
        return 2
    print(f"model: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads / {cfg.n_kv_heads} kv, ffn {cfg.ffn_dim}, "
          f"vocab {cfg.vocab_size}, {'tied' if cfg.tie_embeddings else 'untied'}, rope theta {cfg.rope_theta:g}; "
          f"{n_params / 1e6:.1f}M params; {args.micro} x {args.batch} x {args.seq} = {tokens_per_step} tokens/step; "
          f"{args.precision}; {fpt / 1e9:.3f} GFLOP/token; transformers attention: {args.hf_attn}")
    print(f"device: {env['device']}, torch {env['torch']}, transformers {env['transformers']}; peak "
          f"{peak if peak else 'unknown'} TFLOP/s ({args.precision}, dense)", flush=True)

    plan = implementations(args, cfg, model, init, device)
    outcome = run_all(args, plan, make_batches(cfg, args, device), init, device, tokens_per_step)
    if outcome is None:
        return 1
    results, skipped = outcome
    summary = report(results, "ours" if args.compile else "ours-eager", fpt, peak)
    if args.json:
        args.json.write_text(json.dumps(summary | {
            "env": env, "init_s": init_s, "skipped": skipped,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"}
            | {"params": n_params, "tokens_per_step": tokens_per_step},
            "results": results,
        }, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
