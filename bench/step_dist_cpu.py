"""Step time of bucketed parameter traffic (issue 22) on gloo CPU ranks: bucket `param`
against `block`, and block's prefetch on against off.

Two layouts of one small Llama (fp32, eager, untied embeddings), each on its own set of
gloo ranks (one thread per rank) launched by meshtrain.testing.run_ranks:

  fsdp2xtp2-sp   4 ranks, mesh fsdp 2 x tp 2, sequence parallel
  fsdp2          2 ranks, mesh fsdp 2

and, in the same processes, three builds of the same make_train_step (all from the same
initial parameters, on the same batches):

  param             bucket="param": one collective per parameter tensor (the reference)
  block             bucket="block", prefetch=1: one gather per block per pass, one
                    reduce-scatter per block, the next block's gather issued ahead
  block-prefetch0   bucket="block", prefetch=0: the same buckets, each gathered when used

Order of work, per layout: --warmup steps of each variant (the last one under a dispatch
mode that counts the collectives issued, bench/comm.py's recorder), then every variant's
warm-up losses must equal param's (rtol 1e-5) on every rank, or the bench refuses to time
anything and exits 1. Then --rounds rounds: in each, every variant runs --steps steps
(order alternating: ABC, CBA, ...) between barriers; a variant's round time is the
slowest rank's. Reported per layout: the median ms/step over rounds (min-max), the time
ratios block/param and prefetch on/off (ratio of medians, and the median of same-round
ratios: the steadier one when the machine's load drifts), collective calls per step, the
1-minute load average before and after, torch version, cores. Last, in the same ranks,
the cost of one collective apart from its bytes: a blocking all-gather of 256 fp32 over
the fsdp group, times the calls block saves: the part of the saving that per-call
latency alone explains (the framework work around each call in param mode is not in it).

    python bench/step_dist_cpu.py --json out.json          # dim 256, 4 layers, 8 x 64 tokens
    python bench/step_dist_cpu.py --tiny --json out.json   # CI: seconds
"""

from __future__ import annotations

import argparse
import datetime
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from comm_record import CollectiveRecorder  # noqa: E402

from meshtrain import AdamW, MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step  # noqa: E402
from meshtrain.models.llama import LlamaConfig  # noqa: E402
from meshtrain.testing import run_ranks  # noqa: E402

LOSS_RTOL = 1e-5
BASELINE = "param"
# name -> make_train_step's bucket and prefetch
VARIANTS = {"param": ("param", 1), "block": ("block", 1), "block-prefetch0": ("block", 0)}
# name -> (mesh sizes, sequence parallel)
LAYOUTS = {"fsdp2xtp2-sp": ({"fsdp": 2, "tp": 2}, True), "fsdp2": ({"fsdp": 2}, False)}

FULL = dict(dim=256, layers=4, heads=8, kv_heads=4, ffn=688, vocab=512, batch=8, seq=64, warmup=3, steps=3,
            rounds=10)
TINY = dict(dim=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=64, batch=4, seq=16, warmup=2, steps=1, rounds=2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--tiny", action="store_true", help="a small model for CI (seconds)")
    m = p.add_argument_group("model and batch (defaults below; --tiny: dim 32, 2 layers, 4 x 16 tokens)")
    for flag in ("dim", "layers", "heads", "kv-heads", "ffn", "vocab"):
        m.add_argument(f"--{flag}", type=int, default=None, help=f"default {FULL[flag.replace('-', '_')]}")
    m.add_argument("--batch", type=int, default=None, help="sequences per step (global batch; default 8)")
    m.add_argument("--seq", type=int, default=None, help="default 64")
    r = p.add_argument_group("measurement")
    r.add_argument("--warmup", type=int, default=None, help="untimed steps per variant (loss check; default 3)")
    r.add_argument("--steps", type=int, default=None, help="timed steps per variant per round (default 3)")
    r.add_argument("--rounds", type=int, default=None, help="measurement rounds, the order alternating (default 10)")
    r.add_argument("--layouts", nargs="*", metavar="NAME", help=f"a subset of {', '.join(LAYOUTS)}")
    r.add_argument("--skew", metavar="VARIANT", choices=[v for v in VARIANTS if v != BASELINE], default=None,
                   help="(tests the loss check) train VARIANT with 10x the learning rate: the bench must refuse")
    r.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    for k, v in (TINY if args.tiny else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.warmup < 2 or args.steps < 1 or args.rounds < 1:
        p.error("--warmup must be >= 2 (the second step's loss sees the first update), --steps and --rounds >= 1")
    if args.layouts and not set(args.layouts) <= set(LAYOUTS):
        p.error(f"unknown layout in {args.layouts}; choose from {', '.join(LAYOUTS)}")
    return args


def make_batches(vocab: int, batch: int, seq: int, n: int = 4, seed: int = 1234) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (1, batch, seq + 1), generator=g)
        out.append({"tokens": t[..., :-1].contiguous(), "targets": t[..., 1:].contiguous()})
    return out


def _max_over_ranks(x: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _max_rel_diff(values: list[float], ref: list[float]) -> float:
    """max |v - r| / |r| over the steps; NaN where any value is NaN."""
    v, r = torch.tensor(values, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
    return float(((v - r).abs() / r.abs()).max())


def _axes_of_groups(mesh) -> dict[str, str]:
    import torch.distributed as dist

    from meshtrain.parallel.bucket_groups import GROUP_AXES

    out = {dist.group.WORLD.group_name: "world"}
    out.update({mesh.get_group(i).group_name: a for i, a in enumerate(mesh.mesh_dim_names)})
    out.update(GROUP_AXES)  # the bucket traffic's own groups ("fsdp", "fsdp+tp", ...)
    return out


def rank_main(cfg: LlamaConfig, layout: str, batch: int, seq: int, warmup: int, steps: int, rounds: int,
              skew: str | None) -> dict:
    """Runs on every rank of one layout: build the variants, warm up and check, time."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, t_start = dist.get_rank(), time.perf_counter()
    sizes, sp = LAYOUTS[layout]
    model = build("llama", cfg)
    plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**sizes), world=dist.get_world_size())
    mesh = plan.mesh.build()
    batches = make_batches(cfg.vocab_size, batch, seq)
    runs = {}
    for name, (bucket, prefetch) in VARIANTS.items():
        lr = 3e-4 * (10 if name == skew else 1)
        step = make_train_step(model, plan, mesh, optimizer=AdamW(lr=lr, betas=(0.9, 0.95), weight_decay=0.1),
                               precision="fp32", grad_clip=1.0, bucket=bucket, prefetch=prefetch)
        runs[name] = [step, TrainState.create(init_params(plan, mesh, seed=0)), 0]

    def one_step(name):
        run = runs[name]
        metrics = run[0](run[1], batches[run[2] % len(batches)])
        run[2] += 1
        return metrics

    t_built = time.perf_counter()
    # Warm-up, the last step of each variant counting its collectives.
    losses, norms, calls = {}, {}, {}
    for name in runs:
        dist.barrier()
        metrics = [one_step(name) for _ in range(warmup - 1)]
        recorder = CollectiveRecorder(_axes_of_groups(mesh))
        with recorder:
            metrics.append(one_step(name))
        losses[name] = [float(m["loss"]) for m in metrics]
        norms[name] = [float(m["grad_norm"]) for m in metrics]
        tensors = [c for c in recorder.log if c.numel > 1]
        kinds: dict[str, int] = {}
        for c in tensors:
            key = f"{c.phase} {c.op} {c.axis}"
            kinds[key] = kinds.get(key, 0) + 1
        calls[name] = {"collectives": len(tensors), "scalar_collectives": len(recorder.log) - len(tensors),
                       "by_kind": dict(sorted(kinds.items()))}
    rel = {n: _max_rel_diff(v, losses[BASELINE]) for n, v in losses.items()}
    norm_rel = {n: _max_rel_diff(v, norms[BASELINE]) for n, v in norms.items()}
    # Every rank must agree (the loss is reduced, so they should): the worst rank's verdict
    # (written so that a NaN fails).
    passed = _max_over_ranks(0.0 if all(d <= LOSS_RTOL for d in rel.values()) else 1.0) == 0.0
    t_warm = time.perf_counter()
    out = {"rank": rank, "phase_s": {"build": t_built - t_start, "warmup": t_warm - t_built}, "losses": losses,
           "loss_max_rel_diff": rel, "grad_norms": norms, "grad_norm_max_rel_diff": norm_rel, "passed": passed,
           "calls": calls, "round_s": {n: [] for n in runs}}
    if not passed:
        return out

    names = list(runs)
    for rnd in range(rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                one_step(name)
            out["round_s"][name].append(_max_over_ranks(time.perf_counter() - t0))
        if rank == 0:
            print(f"  round {rnd + 1}/{rounds} (load {os.getloadavg()[0]:.2f}): "
                  + "  ".join(f"{n} {1e3 * out['round_s'][n][-1] / steps:.1f} ms" for n in names), flush=True)
    out["phase_s"]["rounds"] = time.perf_counter() - t_warm
    out["small_all_gather_us"] = _call_latency(mesh.get_group("fsdp"))
    return out


def _call_latency(group, n: int = 100, numel: int = 256) -> float:
    """Microseconds per blocking all-gather of `numel` fp32 over `group`, the slowest
    rank's mean of `n`: what one collective costs here apart from its bytes (the unit
    the buckets save)."""
    import torch.distributed as dist

    x = torch.ones(numel)
    out = torch.empty(numel * dist.get_world_size(group))
    for _ in range(5):
        dist.all_gather_single(out, x, group=group)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_gather_single(out, x, group=group)
    return _max_over_ranks((time.perf_counter() - t0) / n * 1e6)


def summarise(result: dict, steps: int) -> dict:
    """Per-variant ms/step figures and the two ratios, from rank 0's round times."""
    ms = {n: [1e3 * s / steps for s in v] for n, v in result["round_s"].items()}
    variants = {}
    for name, (bucket, prefetch) in VARIANTS.items():
        variants[name] = {"bucket": bucket, "prefetch": prefetch, "ms_per_step_median": statistics.median(ms[name]),
                          "ms_per_step_min": min(ms[name]), "ms_per_step_max": max(ms[name]),
                          "ms_per_step_rounds": ms[name], **{k: result["calls"][name][k] for k in
                                                             ("collectives", "scalar_collectives", "by_kind")}}

    def ratio(a, b):
        return {"of_medians": variants[a]["ms_per_step_median"] / variants[b]["ms_per_step_median"],
                "paired": statistics.median(x / y for x, y in zip(ms[a], ms[b]))}

    saved = variants["param"]["collectives"] - variants["block"]["collectives"]
    return {"variants": variants, "small_all_gather_us": result["small_all_gather_us"],
            # What the calls block saves would cost at that latency, per step.
            "saved_calls": saved, "saved_calls_ms_at_small_latency": saved * result["small_all_gather_us"] / 1e3,
            "ratios": {"block/param": ratio("block", "param"),
                       "prefetch1/prefetch0": ratio("block", "block-prefetch0")}}


def main(argv=None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    cfg = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                      ffn_dim=args.ffn, vocab_size=args.vocab, max_seq_len=args.seq)
    n_params = sum(s.numel for s in build("llama", cfg).specs.values())
    env = {"torch": torch.__version__, "python": platform.python_version(), "cores": os.cpu_count(),
           "threads_per_rank": 1, "process_group": "gloo", "device": "cpu"}
    print(f"model: Llama dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads / {cfg.n_kv_heads} kv, ffn "
          f"{cfg.ffn_dim}, vocab {cfg.vocab_size}, {n_params / 1e6:.2f}M params, fp32, eager; batch {args.batch} x "
          f"seq {args.seq} per step")
    print(f"machine: {env['cores']} cores, torch {env['torch']}, gloo ranks with 1 thread each; "
          f"load average (1 min) {load_before:.2f}")
    layouts = [n for n in LAYOUTS if not args.layouts or n in args.layouts]
    rows = []
    for layout in layouts:
        sizes, sp = LAYOUTS[layout]
        world = 1
        for v in sizes.values():
            world *= v
        load0, t0 = os.getloadavg()[0], time.perf_counter()
        print(f"\n{layout}: {world} ranks; warm-up {args.warmup} steps per variant, then {args.rounds} rounds x "
              f"{args.steps} steps, the order alternating ...", flush=True)
        results = run_ranks(rank_main, world, cfg, layout, args.batch, args.seq, args.warmup, args.steps,
                            args.rounds, args.skew)
        load1, wall = os.getloadavg()[0], time.perf_counter() - t0
        r0 = results[0]
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in r0["phase_s"].items())
        print(f"  {world} ranks ran in {wall:.1f} s (rank 0: {phases}; the rest is starting the ranks)")
        for name in VARIANTS:
            print(f"  {name:16s} losses {', '.join(f'{x:.6f}' for x in r0['losses'][name])}  (max rel diff vs "
                  f"{BASELINE} over ranks {max(r['loss_max_rel_diff'][name] for r in results):.1e})")
        if not all(r["passed"] for r in results):
            print(f"REFUSING TO REPORT: {layout}: the variants' losses differ from {BASELINE}'s by more than rtol "
                  f"{LOSS_RTOL:g}, so they do not compute the same step:", file=sys.stderr)
            for r in results:
                for name, diff in r["loss_max_rel_diff"].items():
                    if diff > LOSS_RTOL:
                        print(f"  rank {r['rank']} {name}: {r['losses'][name]} vs {r['losses'][BASELINE]} "
                              f"(rel {diff:.2e})", file=sys.stderr)
            return 1
        row = {"layout": layout, "world": world, "mesh": sizes, "sp": sp, "wall_s": wall, "phase_s": r0["phase_s"],
               "loadavg_1min": {"before": load0, "after": load1},
               "check": {"rtol": LOSS_RTOL, "passed": True, "losses": r0["losses"],
                         "loss_max_rel_diff": {n: max(r["loss_max_rel_diff"][n] for r in results) for n in VARIANTS},
                         "grad_norm_max_rel_diff": {n: max(r["grad_norm_max_rel_diff"][n] for r in results)
                                                    for n in VARIANTS}},
               **summarise(r0, args.steps)}
        rows.append(row)
    load_after = os.getloadavg()[0]

    print(f"\nms per step: median over {args.rounds} rounds of {args.steps} steps (the slowest rank's time), "
          "min - max; calls: tensor collectives per step (scalar ones apart)")
    head = f"{'layout':14s} {'variant':16s} {'ms/step':>9s} {'min - max':>17s} {'calls':>6s} {'scalar':>6s}"
    print(head)
    print("-" * len(head))
    for row in rows:
        for name, v in row["variants"].items():
            print(f"{row['layout']:14s} {name:16s} {v['ms_per_step_median']:9.1f} {v['ms_per_step_min']:8.1f} - "
                  f"{v['ms_per_step_max']:<8.1f}{v['collectives']:6d} {v['scalar_collectives']:6d}")
    print("\ntime ratios (< 1: the first is faster): of the medians, and the median of same-round ratios")
    for row in rows:
        r = row["ratios"]
        print(f"{row['layout']:14s} block/param {r['block/param']['of_medians']:.3f} (paired "
              f"{r['block/param']['paired']:.3f});  prefetch 1/0 {r['prefetch1/prefetch0']['of_medians']:.3f} "
              f"(paired {r['prefetch1/prefetch0']['paired']:.3f});  load {row['loadavg_1min']['before']:.2f} -> "
              f"{row['loadavg_1min']['after']:.2f}")
    print("\nper-call cost: a blocking all-gather of 256 fp32 over the fsdp group, after the rounds")
    for row in rows:
        v = row["variants"]
        print(f"{row['layout']:14s} {row['small_all_gather_us']:8.0f} us/call; block issues {row['saved_calls']} "
              f"fewer calls than param: {row['saved_calls_ms_at_small_latency']:.1f} ms/step at that cost, against "
              f"a measured difference of {v['param']['ms_per_step_median'] - v['block']['ms_per_step_median']:.1f} "
              "ms/step (medians)")
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after; {env['cores']} cores, "
          f"torch {env['torch']}")
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join(["bench/step_dist_cpu.py", *(sys.argv[1:] if argv is None else argv)]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "env": env,
            "config": {k: v for k, v in vars(args).items() if k not in ("json",)} | {"params": n_params,
                                                                                    "precision": "fp32"},
            "loadavg_1min": {"before": load_before, "after": load_after}, "layouts": rows,
        }, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
