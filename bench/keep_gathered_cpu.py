"""parallel.pp_keep_gathered on CPU: the memory it costs and the traffic it saves, measured
against the planner, pp 2 x fsdp 2 on four gloo ranks (one thread each).

Same model (Llama, fp32), same batches, 1F1B with m micro-batches per step, run twice:

  sharded   today's default: each micro-batch gathers a stage's buckets, gathers them
            again in backward (reshard_after_forward) and reduce-scatters their gradients
  kept      parallel.pp_keep_gathered: each pp rank gathers its weights once per step
            and reduce-scatters the step's summed gradients once

Reported per pp rank and mode:

  peak_bytes    measured: the most bytes live in torch's CPU allocator during one step's
                forward and backward (gathers and reductions included, up to the
                optimizer), above the level before the step (meshtrain.train.peak_memory),
                on one rank of each pp rank run alone on the fake process group (gloo
                frees some buffers on its own threads, which the profiler does not see)
  planned       `meshtrain plan`'s peak for the same rank (estimate/pipeline.py) less
                what exists before the step (parameters, optimizer state)
  gathers, reduce_scatters   the parameter collectives of one step, from the planner
                (tests/test_pipeline_plan.py checks them against a recorded step)
  step_s        median over --steps timed steps (on CPU gloo the traffic is nearly free:
                the time figure shows the cost of the mode, not the saving on a network)

The line `kept - sharded` compares the measured memory trade with the planner's. Both
modes must train the same model (losses rtol 1e-5), else the bench refuses to report.

    python bench/keep_gathered_cpu.py --json keep_gathered.json   # ~1 min on 2 cores
    python bench/keep_gathered_cpu.py --tiny                      # seconds, for CI
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshtrain import MeshSpec, Rules, TrainState, build, init_params, make_plan  # noqa: E402
from meshtrain.estimate.pipeline import pipeline_estimate  # noqa: E402
from meshtrain.layout.traffic import Traffic  # noqa: E402
from meshtrain.models.llama import LlamaConfig  # noqa: E402
from meshtrain.pipeline import partition  # noqa: E402
from meshtrain.pipeline.schedule import build_pipeline_schedule  # noqa: E402
from meshtrain.testing import run_ranks  # noqa: E402

MODES = ("sharded", "kept")
SIZES = {  # model, sequence, rows per micro-batch (over the fsdp ranks), micro-batches per step
    "default": (LlamaConfig(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1376, vocab_size=2048,
                            max_seq_len=64), 32, 2, 8),
    "tiny": (LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=172, vocab_size=256,
                         max_seq_len=32), 16, 2, 4),
}


def _plan(model):
    return make_plan(model.specs, Rules.default(), MeshSpec(pp=2, fsdp=2), world=4)


def _batches(cfg, seq, rows, m, n):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(0, cfg.vocab_size, (m, rows, seq + 1), generator=g)
        out.append({"tokens": t[..., :-1], "targets": t[..., 1:]})
    return out


def _step(cfg, seq, rows, m, kept):
    from meshtrain.train.optim import AdamW
    from meshtrain.train.pipeline_step import local_stage_layout, make_pipeline_step

    model = build("llama", cfg)
    plan = _plan(model)
    mesh = plan.mesh.build()
    stages = partition(model, 2, 1, seq_len=seq, micro_batch=rows // 2)
    names, sub_plan, sub_mesh = local_stage_layout(plan, mesh, stages)
    params = {n: x.requires_grad_() for n, x in init_params(sub_plan, sub_mesh, 0, names=names).items()}
    step = make_pipeline_step(model, stages, build_pipeline_schedule("1f1b", 2, m), plan, mesh,
                              optimizer=AdamW(lr=3e-4), keep_gathered=kept)
    return step, TrainState.create(params)


def _run(cfg, seq, rows, m, kept, warmup, steps):
    """On gloo ranks: losses and step times."""
    torch.set_num_threads(1)
    step, state = _step(cfg, seq, rows, m, kept)
    times, losses = [], []
    for i, batch in enumerate(_batches(cfg, seq, rows, m, warmup + steps)):
        torch.distributed.barrier()
        start = time.perf_counter()
        losses.append(step(state, batch)["loss"])
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, losses


def _peak(cfg, seq, rows, m, kept, rank) -> int:
    """Rank `rank` of the world alone on the fake process group: one step's peak bytes
    after a first step (the optimizer state exists; the gradients are the step's own)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshtrain.train.peak_memory import peak_cpu_bytes

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        step, state = _step(cfg, seq, rows, m, kept)
        first, second = _batches(cfg, seq, rows, m, 2)
        step(state, first)
        for p in state.params.values():
            p.grad = None
        return peak_cpu_bytes(step, state, second, before="optimizer")[1]
    finally:
        dist.destroy_process_group()


def _planned(cfg, seq, rows, m, kept) -> list[dict]:
    model = build("llama", cfg)
    est = pipeline_estimate(_plan(model), model, pp_schedule="1f1b", virtual=1, layout=None, micro_batch=rows // 2,
                            seq_len=seq, micro_steps=m, device="cpu", traffic=Traffic(keep_gathered=kept))
    out = []
    for r in est.ranks:
        mem, coll = r["memory"], r["collectives"]
        count = lambda op: sum(e["count"] for e in coll if e["op"] == op and e["axis"] == "fsdp")  # noqa: E731
        out.append({"planned": mem["peak"] - mem["params"] - mem["optimizer"],
                    "gathers": count("all_gather"), "reduce_scatters": count("reduce_scatter_sum"),
                    "param_bytes": sum(e["bytes"] for e in coll if e["axis"] == "fsdp"
                                       and e["op"] in ("all_gather", "reduce_scatter"))})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a model that runs in seconds (CI)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    cfg, seq, rows, m = SIZES["tiny" if a.tiny else "default"]
    print(f"model: dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}; pp 2 x fsdp 2, 1F1B, {m} "
          f"micro-batches of {rows} x {seq} tokens per step; fp32, gloo, one thread per rank")
    rows_out, ref_losses = [], None
    for mode in MODES:
        results = run_ranks(_run, 4, cfg, seq, rows, m, mode == "kept", a.warmup, a.steps)
        losses = results[0][1]
        if ref_losses is None:
            ref_losses = losses
        elif not torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0):
            print(f"REFUSING TO REPORT: {mode} losses {losses} differ from sharded {ref_losses}")
            return 1
        planned = _planned(cfg, seq, rows, m, mode == "kept")
        step_s = statistics.median(max(r[0][i] for r in results) for i in range(a.steps))
        for pp_rank in range(2):
            peak = _peak(cfg, seq, rows, m, mode == "kept", 2 * pp_rank)  # (its fsdp ranks hold the same)
            rows_out.append({"mode": mode, "pp_rank": pp_rank, "peak_bytes": peak, "step_s": step_s,
                             **planned[pp_rank]})
    print(f"{'mode':<9}{'pp rank':>8}{'peak MiB':>10}{'planned':>9}{'ratio':>7}{'gathers':>9}{'r-s':>5}"
          f"{'param MiB':>11}{'step s':>8}")
    for r in rows_out:
        print(f"{r['mode']:<9}{r['pp_rank']:>8}{r['peak_bytes'] / 2**20:>10.2f}{r['planned'] / 2**20:>9.2f}"
              f"{r['planned'] / r['peak_bytes']:>7.3f}{r['gathers']:>9}{r['reduce_scatters']:>5}"
              f"{r['param_bytes'] / 2**20:>11.2f}{r['step_s']:>8.3f}")
    trade = []
    for pp_rank in range(2):
        s, k = (next(r for r in rows_out if r["mode"] == mode and r["pp_rank"] == pp_rank) for mode in MODES)
        t = {"pp_rank": pp_rank, "measured": k["peak_bytes"] - s["peak_bytes"], "planned": k["planned"] - s["planned"],
             "param_bytes_saved": s["param_bytes"] - k["param_bytes"]}
        trade.append(t)
        print(f"kept - sharded, pp rank {pp_rank}: memory {t['measured'] / 2**20:+.2f} MiB measured, "
              f"{t['planned'] / 2**20:+.2f} MiB planned; parameter traffic {-t['param_bytes_saved'] / 2**20:+.2f} MiB"
              "/step")
    if a.json:
        a.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "model": cfg.__dict__,
                                      "seq_len": seq, "rows": rows, "micro_batches": m, "rows_out": rows_out,
                                      "trade": trade, "machine": platform.processor() or platform.machine(),
                                      "cores": os.cpu_count(), "torch": torch.__version__}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
