"""Pipeline schedules on CPU: measured step time against the simulator's prediction and
against one process training the same model.

Same run, same model (Llama, fp32), same batches:

  one-process   make_train_step on one rank (1 thread): the reference
  two-at-once   two independent one-process runs at the same time: what this machine
                gives two busy ranks (two vCPUs may share a physical core)
  <schedule>    make_pipeline_step on pp=2 gloo ranks (1 thread each, one per core)

For each schedule the ranks record the host time of every compute action (F, B, I, W)
while they run. The simulator (meshtrain/pipeline/simulate.py) then runs the schedule's
IR with those per-stage costs (communication free) and predicts the step time and the
bubble, to which the measured time of the step's end (tied-gradient exchange, norm,
optimizer) is added. Both bubbles are the idle share of 2 ranks x the step time without
that end: measured, 1 - (both ranks' compute time) / (2 x that time).
Every schedule must reproduce one process's losses (rtol 1e-5) before its time counts.
Reported: median step time over --steps timed steps (after --warmup), the ratio to the
prediction, both bubbles, the closed form, and the speed-up over one process.

Then 1F1B and zero-bubble again with compiled stages (`--compile`, inductor by default;
zero-bubble's backward graphs split in input and weight halves), in the same run: each
one's step time against its eager row's, and both builds' peak memory per rank over one
more step's forward and backward (meshtrain.train.peak_memory, up to the optimizer).

    python bench/pipeline_cpu.py                  # ~3 min on 2 cores
    python bench/pipeline_cpu.py --tiny --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshtrain import MeshSpec, Rules, TrainState, build, make_plan, make_train_step  # noqa: E402
from meshtrain.models.llama import LlamaConfig  # noqa: E402
from meshtrain.models.spec import init_slice  # noqa: E402
from meshtrain.pipeline import partition, simulate  # noqa: E402
from meshtrain.pipeline.schedule import build_pipeline_schedule  # noqa: E402
from meshtrain.testing import run_ranks  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2))


def _config(tiny: bool) -> tuple[LlamaConfig, int, int, int]:
    """(model, seq_len, micro_batch, micro-batches per step)."""
    if tiny:
        return LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=172, vocab_size=256,
                           max_seq_len=64), 32, 2, 4
    return LlamaConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=688, vocab_size=512,
                       max_seq_len=256), 256, 2, 8


def _batches(cfg: LlamaConfig, seq: int, micro: int, m: int, n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(0, cfg.vocab_size, (m, micro, seq + 1), generator=g)
        out.append({"tokens": t[..., :-1], "targets": t[..., 1:]})
    return out


def _pipelined(cfg, seq, micro, m, name, v, warmup, steps, compile=False):
    torch.set_num_threads(1)
    from meshtrain.train.peak_memory import peak_cpu_bytes
    from meshtrain.train.pipeline_step import local_stage_layout, make_pipeline_step

    model = build("llama", cfg)
    plan = make_plan(model.specs, Rules.default(), MeshSpec(pp=2), world=2)
    mesh = plan.mesh.build()
    stages = partition(model, 2, v, seq_len=seq, micro_batch=micro)
    names, _, _ = local_stage_layout(plan, mesh, stages)
    params = {n: init_slice(model.specs[n], n, seed=0).requires_grad_() for n in names}
    step = make_pipeline_step(model, stages, build_pipeline_schedule(name, 2, m, v), plan, mesh, record_timings=True,
                              compile=compile)
    state = TrainState.create(params)
    times, losses, timings = [], [], []
    *batches, extra = _batches(cfg, seq, micro, m, warmup + steps + 1)
    for i, batch in enumerate(batches):
        torch.distributed.barrier()
        start = time.perf_counter()
        metrics = step(state, batch)
        losses.append(metrics["loss"])
        if i >= warmup:
            times.append(time.perf_counter() - start)
            timings.append(metrics["timings"])
    _, peak = peak_cpu_bytes(step, state, extra, before="optimizer")
    return times, losses, timings, peak


def _stage_costs(results, n_stages: int) -> dict[int, dict[str, float]]:
    """Median seconds per action kind and stage over every rank's timed steps, in the
    simulator's terms: F, B (a full backward; for split ones I + W) and W."""
    seen: dict[tuple[str, int], list[float]] = {}
    for _, _, steps, _ in results:
        for actions in steps:
            for kind, stage, seconds in actions:
                if kind != "update":
                    seen.setdefault((kind, stage), []).append(seconds)
    med = {k: statistics.median(v) for k, v in seen.items()}
    out = {}
    for s in range(n_stages):
        if ("BI", s) in med:
            w = med.get(("BW", s), 0.0)
            out[s] = {"F": med[("F", s)], "B": med[("BI", s)] + w, "W": w}
        else:
            out[s] = {"F": med[("F", s)], "B": med[("B", s)]}
    return out


def _concurrent(cfg, seq, micro, m, warmup, steps):
    return one_process(cfg, seq, micro, m, warmup, steps)[0]


def one_process(cfg, seq, micro, m, warmup, steps) -> tuple[list[float], list[float]]:
    torch.set_num_threads(1)
    model = build("llama", cfg)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    step, state = make_train_step(model), TrainState.create(params)
    times, losses = [], []
    for i, batch in enumerate(_batches(cfg, seq, micro, m, warmup + steps)):
        start = time.perf_counter()
        losses.append(step(state, batch)["loss"])
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a model that runs in seconds (CI)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per schedule (default 5, tiny 2)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--compile", default="inductor", help="backend of the compiled runs (inductor, aot_eager)")
    a = ap.parse_args()
    steps = a.steps or (2 if a.tiny else 5)
    cfg, seq, micro, m = _config(a.tiny)
    torch.set_num_threads(1)
    ref_times, ref_losses = one_process(cfg, seq, micro, m, a.warmup, steps)
    ref = statistics.median(ref_times)
    print(f"model: dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}; {m} micro-batches of {micro} x "
          f"{seq} tokens per step; pp=2 (one thread per rank, {os.cpu_count()} cores); fp32")
    both = run_ranks(_concurrent, 2, cfg, seq, micro, m, a.warmup, steps)  # no communication: just load
    at_once = statistics.median(t for times in both for t in times)
    print(f"one process: {ref:.3f} s/step; two independent ones at once: {at_once:.3f} s/step each, so this "
          f"machine gives two ranks {2 * ref / at_once:.2f}x one rank's throughput (the ceiling of any speed-up)")
    header = f"{'schedule':<14}{'step s':>9}{'predicted s':>13}{'meas/pred':>11}{'bubble':>9}{'predicted':>11}" \
             f"{'closed form':>13}{'speed-up':>10}"
    print(header)
    rows = []
    for name, v in SCHEDULES:
        model = build("llama", cfg)
        stages = partition(model, 2, v, seq_len=seq, micro_batch=micro)
        results = run_ranks(_pipelined, 2, cfg, seq, micro, m, name, v, a.warmup, steps)
        for _, losses, _, _ in results:  # the pipeline must train the same model before its time counts
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        measured = statistics.median(max(r[0][i] for r in results) for i in range(steps))
        # Compute time of the two ranks together, per timed step (the simulator's bubble is
        # the idle share of pp x step time, summed over ranks).
        busy = statistics.median(sum(sum(t for k, _, t in r[2][i] if k != "update") for r in results)
                                 for i in range(steps))
        update = statistics.median(t for r in results for acts in r[2] for k, _, t in acts if k == "update")
        costs = _stage_costs(results, len(stages))
        sched = build_pipeline_schedule(name, 2, m, v)
        simulated = simulate(sched, stage_costs=costs)
        predicted = dataclasses.replace(simulated, step_time=simulated.step_time + update)
        closed = (2 - 1) / (m + 2 - 1) / v if name != "zb" else None
        row = {"schedule": name, "virtual": v, "step_s": measured, "predicted_s": predicted.step_time,
               "update_s": update, "ratio_to_prediction": measured / predicted.step_time,
               "bubble": 1 - busy / (2 * (measured - update)),
               "predicted_bubble": predicted.bubble, "closed_form_bubble": closed, "speedup": ref / measured,
               "stage_costs_s": costs, "peak_bytes": max(r[3] for r in results)}
        rows.append(row)
        print(f"{name + (f' v{v}' if v > 1 else ''):<14}{measured:>9.3f}{predicted.step_time:>13.3f}"
              f"{row['ratio_to_prediction']:>11.2f}{row['bubble']:>9.1%}{predicted.bubble:>11.1%}"
              f"{'-' if closed is None else f'{closed:.1%}':>13}{row['speedup']:>10.2f}")
    compiled = {name: _compiled(name, cfg, seq, micro, m, a.warmup, steps, a.compile, ref_losses,
                                next(r for r in rows if r["schedule"] == name)) for name in ("1f1b", "zb")}
    if a.json:
        a.json.write_text(json.dumps({"compiled": compiled["1f1b"], "compiled_zb": compiled["zb"], "model": {"dim": cfg.dim, "n_layers": cfg.n_layers, "vocab": cfg.vocab_size},
                                      "seq_len": seq, "micro_batch": micro, "micro_batches": m, "pp": 2,
                                      "one_process_s": ref, "two_at_once_s": at_once,
                                      "machine_capacity": 2 * ref / at_once, "schedules": rows, "machine": platform.processor()
                                      or platform.machine(), "cores": os.cpu_count(),
                                      "torch": torch.__version__}, indent=1))
    return 0


def _compiled(name, cfg, seq, micro, m, warmup, steps, backend, ref_losses, eager: dict) -> dict:
    """Schedule `name` with compiled stages against its eager row of the same run: step
    time and peak memory per rank (the most loaded rank's)."""
    results = run_ranks(_pipelined, 2, cfg, seq, micro, m, name, 1, warmup, steps, backend)
    for _, losses, _, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    measured = statistics.median(max(r[0][i] for r in results) for i in range(steps))
    peak = max(r[3] for r in results)
    out = {"backend": backend, "step_s": measured, "eager_step_s": eager["step_s"],
           "speedup_over_eager": eager["step_s"] / measured, "peak_bytes": peak,
           "eager_peak_bytes": eager["peak_bytes"], "peak_ratio": peak / eager["peak_bytes"]}
    print(f"{name} compiled ({backend}): {measured:.3f} s/step, {out['speedup_over_eager']:.2f}x the eager {name}; "
          f"peak {peak / 2**20:.2f} MiB per rank, {out['peak_ratio']:.3f}x eager's "
          f"({eager['peak_bytes'] / 2**20:.2f} MiB)")
    return out


if __name__ == "__main__":
    sys.exit(main())
