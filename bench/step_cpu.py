"""Tokens/s of meshtrain's single-process training step against a plain PyTorch reference.

Four implementations of the same Llama training step (fp32, one process, CPU), measured
in the same run from the same initial parameters on the same batches:

  ours-compiled   meshtrain make_train_step(compile=True): loss and update each in
                  torch.compile(fullgraph=True), inductor
  ours-eager      meshtrain make_train_step(compile=False)
  ref-eager       bench/reference_llama.py: an nn.Module Llama, torch.optim.AdamW(foreach=True),
                  torch.nn.utils.clip_grad_norm_  (the baseline of the headline ratio)
  ref-compiled    the same nn.Module wrapped in torch.compile (optimizer and clipping eager)

Order of work: build all four; run --warmup steps of each (this includes the inductor
compile, timed and reported separately, never counted in tokens/s) and compare every
warm-up step's loss (rtol 1e-5), grad norm before clipping (rtol 2e-6) and the parameters
afterwards (per-tensor update, rtol 1e-3) against ref-eager: if anything differs the bench
refuses to report speed and exits 1. The clip (--grad-clip: 1.0, 0.25 with --tiny) sits
below the natural grad norm (~2.3, tiny ~0.77), so it engages in every warm-up step (the
JSON's clipped_steps). Then
--rounds measurement rounds, each timing --steps steps of every implementation, the
order alternating (ABCD, DCBA, ...) so drift in machine load hits all of them alike.
Reported: median tokens/s over rounds, min-max, ratio to ref-eager, load average.

    python bench/step_cpu.py                        # defaults: dim 256, 4 layers, 8 x 128 tokens
    python bench/step_cpu.py --json out.json --profile
    python bench/step_cpu.py --tiny --json out.json   # CI: seconds (plus one inductor compile)
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reference_llama import (ReferenceLlama, load_meshtrain_params, make_optimizer,  # noqa: E402
                             make_reference_step, meshtrain_name)

from meshtrain import AdamW, TrainState, build, make_train_step  # noqa: E402
from meshtrain.models import llama  # noqa: E402
from meshtrain.models.spec import init_slice  # noqa: E402

BASELINE = "ref-eager"
LOSS_RTOL = 1e-5
# Every warm-up step's grad norm (before clipping). Measured: 7.8e-8 (tiny), 2.1e-7 (full,
# aot_eager and inductor); about 10x the larger.
GRAD_NORM_RTOL = 2e-6
# Parameters after the warm-up: per tensor, |p - p_ref| / |p_ref - p_init| (Frobenius norms). fp32
# rounding gives 1e-5 to 1e-4 (tiny 1.3e-5 to 1.9e-5; full 3.3e-5 eager, 4.1e-5 inductor; ~1e-4
# in earlier runs: Adam's first steps are sign-like, so a tiny gradient's rounding moves its
# element by up to lr); 10x the largest. Adam hides a constant gradient scale, so a clip that
# is not applied shows only through the ratio of the steps' clip factors: 1.1e-2 on the tiny
# config (7.4e-3 in bench/mfu.py's), 7x past 1e-3, while 1e-2 (used before) let mfu's pass. A
# wrong update rule (e.g. decay on the norm scales) gives > 1e-1.
UPDATE_RTOL = 1e-3

# grad_clip: below each config's natural grad norm (full ~2.3, tiny ~0.77), so every warm-up
# step is clipped and the clip is part of what the check compares.
FULL = dict(dim=256, layers=4, heads=8, kv_heads=4, ffn=688, vocab=512, batch=8, seq=128, micro=1,
            warmup=3, steps=5, rounds=10, grad_clip=1.0)
TINY = dict(dim=64, layers=2, heads=4, kv_heads=2, ffn=176, vocab=256, batch=4, seq=64, micro=1,
            warmup=2, steps=2, rounds=2, grad_clip=0.25)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--tiny", action="store_true", help="a small config for CI (seconds; ref-compiled skipped)")
    m = p.add_argument_group("model and batch (defaults below; --tiny: dim 64, 2 layers, 4 x 64 tokens)")
    for flag in ("dim", "layers", "heads", "kv-heads", "ffn", "vocab"):
        m.add_argument(f"--{flag}", type=int, default=None, help=f"default {FULL[flag.replace('-', '_')]}")
    m.add_argument("--batch", type=int, default=None, help="sequences per step (global batch; default 8)")
    m.add_argument("--seq", type=int, default=None, help="default 128")
    m.add_argument("--micro", type=int, default=None, help="micro-batches per step (gradient accumulation; default 1)")
    r = p.add_argument_group("measurement")
    r.add_argument("--grad-clip", type=float, default=None, help="global grad-norm clip (default 1.0, --tiny 0.25: "
                   "below the natural norm, so clipping engages)")
    r.add_argument("--warmup", type=int, default=None, help="untimed steps per implementation (compile + loss check; "
                   "default 3)")
    r.add_argument("--steps", type=int, default=None, help="timed steps per implementation per round (default 5)")
    r.add_argument("--rounds", type=int, default=None, help="measurement rounds, the order alternating (default 10)")
    r.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    r.add_argument("--no-ref-compile", action="store_true", help="skip ref-compiled (saves its compile time)")
    r.add_argument("--backend", default="inductor",
                   help="torch.compile backend of the compiled runs (aot_eager: a smoke test without codegen)")
    r.add_argument("--no-ours-eager", action="store_true", help="skip ours-eager")
    r.add_argument("--profile", action="store_true",
                   help="after measuring, profile 3 steps of each and print where the time goes")
    r.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    for k, v in (TINY if args.tiny else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.tiny:
        args.no_ref_compile = True
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--warmup, --steps and --rounds must be >= 1")
    if args.batch % args.micro:
        p.error("--batch must be divisible by --micro")
    return args


def make_batches(cfg, batch: int, seq: int, micro: int, n: int = 4, seed: int = 1234) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).reshape(micro, batch // micro, seq + 1)
        out.append({"tokens": t[..., :-1].contiguous(), "targets": t[..., 1:].contiguous()})
    return out


class Runner:
    """One implementation: `step()` trains on the next batch of a shared cycle."""

    def __init__(self, name, step_fn, params_fn, batches):
        self.name, self._step, self.params, self.batches = name, step_fn, params_fn, batches
        self.i = 0

    def step(self) -> dict:
        out = self._step(self.batches[self.i % len(self.batches)])
        self.i += 1
        return out


def build_runners(args, cfg, init, batches, optimizer) -> dict[str, Runner]:
    model = build("llama", cfg)
    runners = {}

    def ours(name, compile):
        params = {n: v.clone().requires_grad_() for n, v in init.items()}
        state = TrainState.create(params)
        step = make_train_step(model, optimizer=optimizer, grad_clip=args.grad_clip, compile=compile)
        runners[name] = Runner(name, lambda b: step(state, b), lambda: params, batches)

    def ref(name, compile):
        module = ReferenceLlama.from_config(cfg)
        load_meshtrain_params(module, init)
        opt = make_optimizer(module, optimizer.lr, optimizer.betas, optimizer.eps, optimizer.weight_decay)
        forward = torch.compile(module, backend=args.backend) if compile else module
        step = make_reference_step(module, opt, grad_clip=args.grad_clip, forward=forward)
        runners[name] = Runner(name, step, lambda: {meshtrain_name(n): p for n, p in module.named_parameters()},
                               batches)

    ours("ours-compiled", True if args.backend == "inductor" else args.backend)
    if not args.no_ours_eager:
        ours("ours-eager", False)
    ref(BASELINE, False)
    if not args.no_ref_compile:
        ref("ref-compiled", True)
    return runners


def warmup_and_check(runners, n_steps, init, grad_clip: float) -> tuple[dict, list[str]]:
    """Run the warm-up steps (timing them: compile included), compare with the baseline."""
    info, errors = {}, []
    for name, r in runners.items():
        t0 = time.perf_counter()
        metrics = [r.step() for _ in range(n_steps)]
        info[name] = {"warmup_s": time.perf_counter() - t0, "losses": [m["loss"] for m in metrics],
                      "grad_norms": [m["grad_norm"] for m in metrics],
                      "clipped_steps": sum(m["grad_norm"] > grad_clip for m in metrics)}
    base = info[BASELINE]
    base_params = runners[BASELINE].params()
    for name, r in runners.items():
        if name == BASELINE:
            continue
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(info[name]["losses"], base["losses"]))
        gn_rel = max(abs(a - b) / abs(b) for a, b in zip(info[name]["grad_norms"], base["grad_norms"]))
        params = r.params()
        p_diff = max((params[n].detach() - base_params[n].detach()).abs().max().item() for n in base_params)
        upd = {n: ((params[n].detach() - base_params[n].detach()).norm()
                   / (base_params[n].detach() - init[n]).norm().clamp_min(1e-30)).item() for n in base_params}
        worst = max(upd, key=upd.get)
        info[name].update(loss_max_rel_diff=loss_rel, grad_norm_max_rel_diff=gn_rel, param_max_abs_diff=p_diff,
                          update_max_rel_diff=upd[worst], update_worst_param=worst)
        if loss_rel > LOSS_RTOL:
            errors.append(f"{name}: loss differs from {BASELINE} by rel {loss_rel:.2e} > {LOSS_RTOL:g} "
                          f"({info[name]['losses']} vs {base['losses']})")
        if gn_rel > GRAD_NORM_RTOL:
            errors.append(f"{name}: grad norms differ from {BASELINE} by rel {gn_rel:.2e} > {GRAD_NORM_RTOL:g} "
                          f"({info[name]['grad_norms']} vs {base['grad_norms']})")
        if upd[worst] > UPDATE_RTOL:
            errors.append(f"{name}: after {n_steps} steps the update of {worst} differs from {BASELINE}'s "
                          f"by rel {upd[worst]:.2e} > {UPDATE_RTOL:g}")
    return info, errors


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def measure(runners, rounds, steps, tokens_per_step) -> tuple[dict, list]:
    names = list(runners)
    per = {n: [] for n in names}
    loads = []
    for rnd in range(rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        loads.append(os.getloadavg()[0])
        for n in order:
            gc.collect()
            t0 = time.perf_counter()
            for _ in range(steps):
                runners[n].step()
            per[n].append(steps * tokens_per_step / (time.perf_counter() - t0))
        print(f"  round {rnd + 1}/{rounds} (load {loads[-1]:.2f}): "
              + "  ".join(f"{n} {per[n][-1]:,.0f}" for n in names), flush=True)
    loads.append(os.getloadavg()[0])
    return per, loads


def profile(runners, n_steps=3) -> tuple[dict, dict]:
    """Self CPU time per step by category: matmul, attention kernels, inductor-generated
    kernels, everything else (eager elementwise, optimizer, copies, framework); and the
    costliest inductor kernels of each compiled implementation (named when the kernels
    were compiled with inductor's cpp.enable_kernel_profile, which --profile turns on)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out, kernels = {}, {}
    for name, r in runners.items():
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n_steps):
                r.step()
        cats = {"matmul": 0.0, "attention": 0.0, "inductor kernels": 0.0, "other": 0.0}
        named = []
        for e in prof.key_averages():
            us = e.self_cpu_time_total
            if "cpp_fused" in e.key:
                named.append((us / n_steps / 1e3, e.count // n_steps, e.key))
            if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"):
                cats["matmul"] += us
            elif "scaled_dot_product" in e.key or "flash_attention" in e.key:
                cats["attention"] += us
            elif "CompiledFxGraph" in e.key or "cpp_fused" in e.key:
                cats["inductor kernels"] += us
            else:
                cats["other"] += us
        out[name] = {k: v / n_steps / 1e3 for k, v in cats.items()}  # ms per step
        out[name]["total"] = sum(cats.values()) / n_steps / 1e3
        if named:
            kernels[name] = sorted(named, reverse=True)[:6]
    return out, kernels


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = llama.LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                            ffn_dim=args.ffn, vocab_size=args.vocab, max_seq_len=args.seq)
    optimizer = AdamW(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    model = build("llama", cfg)
    init = {n: init_slice(s, n, seed=0) for n, s in model.specs.items()}
    n_params = sum(v.numel() for v in init.values())
    batches = make_batches(cfg, args.batch, args.seq, args.micro)
    tokens_per_step = args.batch * args.seq
    env = {"torch": torch.__version__, "python": platform.python_version(), "cpu": _cpu_name(),
           "cores": os.cpu_count(), "threads": torch.get_num_threads()}
    print(f"model: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads / {cfg.n_kv_heads} kv, ffn {cfg.ffn_dim}, "
          f"vocab {cfg.vocab_size}, {n_params / 1e6:.2f}M params; batch {args.batch} x seq {args.seq} "
          f"({args.micro} micro) = {tokens_per_step} tokens/step, fp32")
    print(f"machine: {env['cpu']}, {env['cores']} cores, torch {env['torch']}, {env['threads']} threads; "
          f"load average {os.getloadavg()[0]:.2f}")

    if args.profile:  # name each inductor kernel in the profile (a small per-kernel cost)
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    runners = build_runners(args, cfg, init, batches, optimizer)
    print(f"warm-up: {args.warmup} steps each (compile included), checking losses against {BASELINE} ...", flush=True)
    check, errors = warmup_and_check(runners, args.warmup, init, args.grad_clip)
    _print_warmup(check, args)
    if errors:
        print("REFUSING TO REPORT: the implementations do not compute the same step:", file=sys.stderr)
        for e in errors:
            print("  " + e, file=sys.stderr)
        return 1

    graphs_before = dynamo_graphs()
    print(f"measuring: {args.rounds} rounds x {args.steps} steps each, order alternating ...", flush=True)
    per, loads = measure(runners, args.rounds, args.steps, tokens_per_step)
    recompiled = dynamo_graphs() - graphs_before

    rows = _rows(runners, per, check, tokens_per_step)
    _print_rows(rows)
    print(f"load average (1 min) over the measurement: {min(loads):.2f} - {max(loads):.2f} "
          f"(median {statistics.median(loads):.2f}); {env['cores']} cores")
    ours = next(r for r in rows if r["impl"] == "ours-compiled")
    ratio, paired = ours["ratio_vs_ref_eager"], ours["paired_ratio_vs_ref_eager"]
    print(f"ratio ours-compiled / {BASELINE}: {ratio:.2f} (ratio of medians); "
          f"{paired:.2f} (median of same-round ratios)")
    if max(loads) > 3:
        print("warning: load average above 3 during the measurement: other work shared the cores")
    if recompiled:
        print(f"warning: dynamo compiled {recompiled} new graph(s) during the measurement (recompilation)")

    prof = kernels = None
    if args.profile:
        prof, kernels = profile(runners)
        _print_profile(prof, kernels)

    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "env": env,
            "config": {k: v for k, v in vars(args).items() if k != "json"} | {"params": n_params,
                                                                             "tokens_per_step": tokens_per_step},
            "check": check, "results": rows, "ratio": ratio, "ratio_ours_compiled_vs_ref_eager": ratio,
            "paired_ratio_ours_compiled_vs_ref_eager": paired,
            "loadavg_1min": loads, "recompiled_graphs_during_measurement": recompiled, "profile_ms_per_step": prof,
            "profile_top_kernels": kernels,
        }, indent=2))
        print(f"wrote {args.json}")
    return 0


def _print_warmup(check: dict, args) -> None:
    for name, c in check.items():
        extra = "" if name == BASELINE else (f"  loss rel {c['loss_max_rel_diff']:.1e}, grad-norm rel "
                                             f"{c['grad_norm_max_rel_diff']:.1e}, update rel "
                                             f"{c['update_max_rel_diff']:.1e}")
        print(f"  {name:14s} {c['warmup_s']:7.1f} s  losses {', '.join(f'{x:.6f}' for x in c['losses'])}, grad norms "
              f"{', '.join(f'{x:.4f}' for x in c['grad_norms'])} (clip {args.grad_clip:g} engaged in "
              f"{c['clipped_steps']} of {args.warmup}){extra}")


def _rows(runners, per: dict, check: dict, tokens_per_step: int) -> list[dict]:
    """One result row per implementation, its speed against the baseline's."""
    base = statistics.median(per[BASELINE])
    rows = []
    for name in runners:
        med = statistics.median(per[name])
        # Same-round ratios: neighbours in time share the machine's state, so this is the
        # steadier estimate when the load drifts.
        paired = statistics.median(a / b for a, b in zip(per[name], per[BASELINE]))
        rows.append({"impl": name, "warmup_s": check[name]["warmup_s"], "tokens_per_s_median": med,
                     "tokens_per_s_min": min(per[name]), "tokens_per_s_max": max(per[name]),
                     "ms_per_step_median": 1e3 * tokens_per_step / med, "ratio_vs_ref_eager": med / base,
                     "paired_ratio_vs_ref_eager": paired,
                     "tokens_per_s_rounds": per[name]})
    return rows


def _print_rows(rows: list[dict]) -> None:
    print()
    print(f"{'implementation':16s} {'warm-up s':>9s} {'tok/s median':>13s} {'min - max':>17s} "
          f"{'ms/step':>8s} {'vs ' + BASELINE:>13s} {'paired':>7s}")
    for r in rows:
        print(f"{r['impl']:16s} {r['warmup_s']:9.1f} {r['tokens_per_s_median']:13,.0f} "
              f"{r['tokens_per_s_min']:8,.0f} - {r['tokens_per_s_max']:<8,.0f}"
              f"{r['ms_per_step_median']:8.1f} {r['ratio_vs_ref_eager']:12.2f}x "
              f"{r['paired_ratio_vs_ref_eager']:6.2f}x")


def _print_profile(prof: dict, kernels: dict) -> None:
    print("\nself CPU time per step (ms), torch.profiler over 3 steps:")
    cats = ["matmul", "attention", "inductor kernels", "other", "total"]
    print(f"{'implementation':16s}" + "".join(f"{c:>18s}" for c in cats))
    for name, d in prof.items():
        print(f"{name:16s}" + "".join(f"{d[c]:18.1f}" for c in cats))
    for name, ks in kernels.items():
        print(f"costliest inductor kernels of {name} (ms/step, calls/step):")
        for ms, calls, key in ks:
            print(f"  {ms:6.1f} {calls:3d}  {key[:110]}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
