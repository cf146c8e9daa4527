"""Step time of expert parallelism compiled against eager (issue 23), on 2 gloo CPU ranks.

One MoE Llama (fp32, 8 experts of which each token uses 2, one shared expert, blocks 1..
MoE) on the mesh fsdp 2 folded to ep 2: each rank holds 4 experts, and routed tokens
reach them by the dispatch all-to-all and come back by the combine. Two builds of the
same make_train_step in the same processes, from the same initial parameters, on the
same batches:

  compiled   compile=True (inductor, or --backend): the loss (with both all-to-alls, their
             split sizes read from the exchanged counts inside the graph) and the update
  eager      compile=False

Order of work: the compiled build's warm-up steps first (its trace must come before any
eager MoE step in the process: docs/parallelism.md, Known gap 13), then eager's; both
builds' warm-up losses and gradient norms must agree (rtol 1e-5) on every rank, or the
bench times nothing and exits 1. Then --rounds rounds, each running --steps steps of both
builds in alternating order between barriers; a build's round time is the slowest
rank's. Reported: median ms/step over rounds, the ratio eager / compiled (above 1:
compiled is faster), the first compiled step's seconds (the compile), torch, cores.

    python bench/moe_step_cpu.py --json out.json          # dim 256, 4 layers, 8 x 128 tokens
    python bench/moe_step_cpu.py --tiny --json out.json   # CI-sized shapes (aot_eager)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshtrain import AdamW, MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step  # noqa: E402
from meshtrain.models.llama import LlamaConfig  # noqa: E402
from meshtrain.models.moe import MoeConfig  # noqa: E402
from meshtrain.testing import run_ranks  # noqa: E402
from rank_rounds import alternating_rounds, on_every_rank  # noqa: E402

RTOL = 1e-5
MOE = MoeConfig(num_experts=8, top_k=2, expert_ffn_dim=192, shared_experts=1, layers="1:", z_loss_coef=1e-3)
FULL = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, vocab_size=512, expert_ffn=192, batch=8,
            seq=128)
TINY = dict(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=96, vocab_size=130, expert_ffn=32, batch=8, seq=16)
NOT_MODEL = ("expert_ffn", "batch", "seq")


def rank_main(shape: dict, backend, warmup: int, steps: int, rounds: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    batch, seq = shape["batch"], shape["seq"]
    moe = dataclasses.replace(MOE, expert_ffn_dim=shape["expert_ffn"])
    cfg = LlamaConfig(**{k: v for k, v in shape.items() if k not in NOT_MODEL}, max_seq_len=seq, moe=moe)
    model = build("llama", cfg)
    plan = make_plan(model.specs, Rules.default(), MeshSpec(fsdp=2, ep=2), world=2)
    mesh = plan.mesh.build()
    g = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(4):
        t = torch.randint(0, cfg.vocab_size, (1, batch, seq + 1), generator=g)
        batches.append({"tokens": t[..., :-1], "targets": t[..., 1:]})
    runs = {}
    for name, compile in (("compiled", backend), ("eager", False)):
        step = make_train_step(model, plan, mesh, optimizer=AdamW(lr=1e-3, weight_decay=0.1), grad_clip=1.0,
                               compile=compile)
        runs[name] = [step, TrainState.create(init_params(plan, mesh, seed=0)), 0]

    def one_step(name):
        run = runs[name]
        metrics = run[0](run[1], batches[run[2] % len(batches)])
        run[2] += 1
        return metrics

    out = {"losses": {}, "grad_norms": {}}
    for name in runs:  # compiled first: its trace precedes every eager MoE step
        dist.barrier()
        t0 = time.perf_counter()
        metrics = [one_step(name)]
        out.setdefault("first_step_s", {})[name] = time.perf_counter() - t0
        metrics += [one_step(name) for _ in range(warmup - 1)]
        out["losses"][name] = [m["loss"] for m in metrics]
        out["grad_norms"][name] = [m["grad_norm"] for m in metrics]
    agree = all(math.isclose(a, b, rel_tol=RTOL) for key in ("losses", "grad_norms")
                for a, b in zip(out[key]["compiled"], out[key]["eager"], strict=True))
    out["passed"] = on_every_rank(agree)
    if out["passed"]:
        out["round_s"] = alternating_rounds(one_step, ("compiled", "eager"), rounds, steps)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CI-sized shapes, aot_eager unless --backend")
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor; --tiny: aot_eager)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="steps per build per round (default 3; --tiny 1)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 5; --tiny 2)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    shape = TINY if args.tiny else FULL
    backend = args.backend or ("aot_eager" if args.tiny else "inductor")
    steps = args.steps or (1 if args.tiny else 3)
    rounds = args.rounds or (2 if args.tiny else 5)
    ranks = run_ranks(rank_main, 2, shape, True if backend == "inductor" else backend, args.warmup, steps, rounds,
                      start="spawn" if backend == "inductor" else "forkserver")
    r = ranks[0]
    report = {"torch": torch.__version__, "cores": os.cpu_count(), "tiny": args.tiny, "backend": backend,
              "layout": "fsdp2 x ep2 (2 ranks)", "shape": shape, "moe": dataclasses.asdict(dataclasses.replace(MOE, expert_ffn_dim=shape["expert_ffn"])),
              "passed": r["passed"], "losses": r["losses"], "grad_norms": r["grad_norms"],
              "first_step_s": r["first_step_s"]}
    if not r["passed"]:
        print(f"compiled and eager disagree (rtol {RTOL}): {r['losses']} {r['grad_norms']}; nothing timed")
        return 1
    ms = {n: 1e3 * statistics.median(v) / steps for n, v in r["round_s"].items()}
    report.update(ms_per_step=ms, speedup_compiled_over_eager=ms["eager"] / ms["compiled"],
                  round_ms={n: [1e3 * t / steps for t in v] for n, v in r["round_s"].items()})
    print(f"fsdp2 x ep2, {backend}: compiled {ms['compiled']:.1f} ms/step, eager {ms['eager']:.1f} ms/step, "
          f"eager / compiled {report['speedup_compiled_over_eager']:.2f}x (compile + first step "
          f"{r['first_step_s']['compiled']:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
