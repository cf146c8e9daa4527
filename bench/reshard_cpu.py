"""Peak memory of forward and backward with and without resharding (ZeRO-3), eager and
compiled, on gloo CPU ranks: what `parallel.reshard_after_forward` saves.

One small Llama (fp32, untied) at fsdp N (N gloo ranks, one thread each), one sequence
per rank so the weights, not the activations, decide the peak. In the same processes,
four builds of make_train_step from the same initial parameters on the same batch:

  eager           buckets (block), prefetch 1, reshard_after_forward true (the default)
  eager-keep      the same with reshard_after_forward false
  compiled        train.compile (aot_eager backend), reshard_after_forward true
  compiled-keep   the same with reshard_after_forward false

Each runs two steps, then five under torch's allocation profiler
(meshtrain.train.peak_memory, up to the optimizer's region); a rank's figure is the least
of the five. On gloo a collective's buffers are freed by the backend's own thread once it
lets go of the work, and on a busy machine that comes late: a step's peak rose by up to 40%
that way (a late free can only raise it), so the least is the step's own peak. With three
a CI run (two busy workers) once had every compiled step of a rank raised: reshard saved
1.4 MB against keep where it saves ~5.9. The losses and gradient norms of the four must agree (rtol 1e-5) or nothing is
reported (exit 1). Printed: the slowest rank's peak per build, the ratios compiled / eager and reshard / keep, and the
gathered block weights (what keeping them costs at most).

    python bench/reshard_cpu.py                # fsdp 2 and 4, dim 256, 8 blocks
    python bench/reshard_cpu.py --world 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshtrain import AdamW, MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step  # noqa: E402
from meshtrain.models.llama import LlamaConfig  # noqa: E402
from meshtrain.testing import run_ranks  # noqa: E402
from meshtrain.train.peak_memory import peak_cpu_bytes  # noqa: E402

BUILDS = {"eager": (False, True), "eager-keep": (False, False), "compiled": ("aot_eager", True),
          "compiled-keep": ("aot_eager", False)}
RTOL = 1e-5
MEASURED = 5  # profiled steps per build


def rank_main(world: int, dim: int, layers: int, seq: int, builds: tuple[str, ...] = tuple(BUILDS)) -> dict:
    torch.set_num_threads(1)
    cfg = LlamaConfig(dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=dim * 8 // 3 // 8 * 8,
                      vocab_size=256, max_seq_len=seq)
    model = build("llama", cfg)
    plan = make_plan(model.specs, Rules.default(), MeshSpec(fsdp=world), world=world)
    mesh = plan.mesh.build()
    t = torch.randint(0, cfg.vocab_size, (1, world, seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": t[..., :-1].contiguous(), "targets": t[..., 1:].contiguous()}
    out = {}
    for name in builds:
        compile, reshard = BUILDS[name]
        torch._dynamo.reset()  # each build compiles afresh, within dynamo's recompile limit
        step = make_train_step(model, plan, mesh, optimizer=AdamW(lr=1e-3), compile=compile,
                               reshard_after_forward=reshard)
        state = TrainState.create(init_params(plan, mesh, seed=0))
        metrics = [step(state, batch) for _ in range(2)]
        peaks = []
        for _ in range(MEASURED):
            last, peak = peak_cpu_bytes(step, state, batch, before="optimizer")
            metrics.append(last)
            peaks.append(peak)
        out[name] = {"peak": min(peaks), "peaks": peaks, "loss": [m["loss"] for m in metrics],
                     "grad_norm": [m["grad_norm"] for m in metrics]}
    out["gathered_blocks"] = sum(4 * math.prod(p.spec.shape) * (world - 1) // world
                                 for n, p in plan.params.items() if n.startswith("layers."))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--world", type=int, nargs="*", default=[2, 4], help="fsdp sizes (default 2 4)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    report = {"torch": torch.__version__, "cores": os.cpu_count(), "worlds": {}}
    for world in args.world:
        ranks = run_ranks(rank_main, world, world, args.dim, args.layers, args.seq, start="spawn")
        for r in ranks:
            for name in BUILDS:
                for key in ("loss", "grad_norm"):
                    if not all(math.isclose(a, b, rel_tol=RTOL) for a, b in zip(r[name][key], r["eager"][key])):
                        print(f"fsdp {world}: {name} {key} {r[name][key]} differs from eager {r['eager'][key]}")
                        return 1
        peak = {name: max(r[name]["peak"] for r in ranks) for name in BUILDS}
        blocks = ranks[0]["gathered_blocks"]
        report["worlds"][world] = {"peak_bytes": peak, "gathered_blocks_bytes": blocks}
        mb = lambda b: f"{b / 2**20:7.2f} MiB"  # noqa: E731
        print(f"fsdp {world} (dim {args.dim}, {args.layers} blocks, {args.seq} tokens per rank; "
              f"gathered block weights {mb(blocks)}), forward+backward peak, slowest rank:")
        for name in BUILDS:
            print(f"  {name:14s} {mb(peak[name])}")
        print(f"  compiled / eager            {peak['compiled'] / peak['eager']:.3f}")
        print(f"  compiled reshard / keep     {peak['compiled'] / peak['compiled-keep']:.3f}")
        print(f"  eager reshard / keep        {peak['eager'] / peak['eager-keep']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
