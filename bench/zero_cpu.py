"""parallel.zero 1, 2 and 3, and Muon against AdamW, on CPU: one run, fsdp 2 on two gloo
ranks (one thread each), the same model and batches in every mode.

Modes (rows): zero 3 / 2 / 1 with AdamW, then zero 3 and zero 1 with Muon. Reported per mode:

  step_s        median over --steps timed steps (the slower rank's); `ratio` is over
                zero 3 with AdamW, today's default, in the same run
  peak_bytes    measured: the most bytes live in torch's CPU allocator during one step's
                forward and backward (gathers and reductions included, up to the
                optimizer), above the level before the step, on rank 0 alone on the fake
                process group (meshtrain.train.peak_memory)
  planned       `meshtrain plan`'s peak for the same rank less what exists before the step
                (parameters, optimizer state)
  gathers, reduce_scatters, param_bytes   the fsdp parameter collectives of one step, from
                the planner (tests/test_zero.py checks them against recorded steps)
  state_bytes   the planner's parameters + optimizer state (Muon: one buffer per matrix)

The zero stages must train the same model (losses rtol 1e-5), and so must Muon's two, else
the bench refuses to report. On gloo over shared memory the traffic is nearly free: the
times show each mode's own cost, not the saving on a network.

    python bench/zero_cpu.py --json zero.json     # about a minute on 2 cores
    python bench/zero_cpu.py --tiny               # seconds, for CI
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

from meshtrain import MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step  # noqa: E402
from meshtrain.estimate.comms import step_collectives  # noqa: E402
from meshtrain.estimate.memory import per_rank_memory  # noqa: E402
from meshtrain.layout.traffic import Traffic  # noqa: E402
from meshtrain.models.llama import LlamaConfig  # noqa: E402
from meshtrain.testing import run_ranks  # noqa: E402
from meshtrain.train.muon import Muon  # noqa: E402
from meshtrain.train.optim import AdamW  # noqa: E402

MODES = (("zero3_adamw", 3, "adamw"), ("zero2_adamw", 2, "adamw"), ("zero1_adamw", 1, "adamw"),
         ("zero3_muon", 3, "muon"), ("zero1_muon", 1, "muon"))
SIZES = {  # model, sequence, rows per micro-batch (over both ranks), micro-batches per step
    "default": (LlamaConfig(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1376, vocab_size=2048,
                            max_seq_len=64), 64, 4, 4),
    "tiny": (LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172, vocab_size=256,
                         max_seq_len=32), 16, 4, 2),
}
WORLD = 2


def _traffic(zero: int) -> Traffic:
    return Traffic(keep_gathered=zero < 3, zero=zero)


def _optimizer(name: str):
    adamw = AdamW(lr=3e-4)
    return adamw if name == "adamw" else Muon(adamw=adamw)


def _batches(cfg, seq, rows, m, n):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(0, cfg.vocab_size, (m, rows, seq + 1), generator=g)
        out.append({"tokens": t[..., :-1], "targets": t[..., 1:]})
    return out


def _step(cfg, zero: int, optimizer: str):
    model = build("llama", cfg)
    plan = make_plan(model.specs, Rules.default(), MeshSpec(fsdp=WORLD), world=WORLD)
    mesh = plan.mesh.build()
    opt = _optimizer(optimizer)
    step = make_train_step(model, plan, mesh, optimizer=opt, traffic=_traffic(zero))
    return step, TrainState.create(init_params(plan, mesh, seed=0), opt)


def _run(cfg, seq, rows, m, zero, optimizer, warmup, steps):
    """On gloo ranks: losses and step times."""
    torch.set_num_threads(1)
    step, state = _step(cfg, zero, optimizer)
    times, losses = [], []
    for i, batch in enumerate(_batches(cfg, seq, rows, m, warmup + steps)):
        torch.distributed.barrier()
        start = time.perf_counter()
        losses.append(step(state, batch)["loss"])
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, losses


def _peak(cfg, seq, rows, m, zero, optimizer) -> int:
    """Rank 0 alone on the fake process group: one step's peak bytes after a first step."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshtrain.train.peak_memory import peak_cpu_bytes

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        step, state = _step(cfg, zero, optimizer)
        first, second = _batches(cfg, seq, rows, m, 2)
        step(state, first)
        return peak_cpu_bytes(step, state, second, before="optimizer")[1]
    finally:
        dist.destroy_process_group()


def _planned(cfg, seq, rows, m, zero, optimizer) -> dict:
    model = build("llama", cfg)
    plan = make_plan(model.specs, Rules.default(), MeshSpec(fsdp=WORLD), world=WORLD)
    mem = per_rank_memory(plan, model, micro_batch=rows // WORLD, seq_len=seq, traffic=_traffic(zero),
                          optimizer=optimizer)
    coll = step_collectives(plan, model, micro_batch_rows=rows, seq_len=seq, micro_steps=m, traffic=_traffic(zero),
                            optimizer=optimizer)
    count = lambda op: sum(e["count"] for e in coll if e["op"] == op and e["axis"] == "fsdp" and e["phase"] != "optimizer")  # noqa: E731
    return {"planned": mem["peak"] - mem["params"] - mem["optimizer"], "state_bytes": mem["params"] + mem["optimizer"],
            "gathers": count("all_gather"), "reduce_scatters": count("reduce_scatter_sum"),
            "param_bytes": sum(e["bytes"] for e in coll if e["axis"] == "fsdp" and e["phase"] != "optimizer"
                               and e["op"] in ("all_gather", "reduce_scatter_sum"))}


def _same(losses, reference, what) -> bool:
    if torch.allclose(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=0):
        return True
    print(f"REFUSING TO REPORT: {what} losses {losses} differ from {reference}")
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a model that runs in seconds (CI)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    cfg, seq, rows, m = SIZES["tiny" if a.tiny else "default"]
    print(f"model: dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}; fsdp {WORLD}, {m} micro-batches "
          f"of {rows} x {seq} tokens per step; fp32, gloo, one thread per rank")
    rows_out, reference = [], {}
    for name, zero, optimizer in MODES:
        results = run_ranks(_run, WORLD, cfg, seq, rows, m, zero, optimizer, a.warmup, a.steps)
        losses = results[0][1]
        reference.setdefault(optimizer, losses)
        if not _same(losses, reference[optimizer], name):
            return 1
        step_s = statistics.median(max(r[0][i] for r in results) for i in range(a.steps))
        rows_out.append({"mode": name, "zero": zero, "optimizer": optimizer, "step_s": step_s,
                         "peak_bytes": _peak(cfg, seq, rows, m, zero, optimizer),
                         **_planned(cfg, seq, rows, m, zero, optimizer)})
    base = rows_out[0]["step_s"]
    print(f"{'mode':<13}{'step s':>8}{'ratio':>7}{'peak MiB':>10}{'planned':>9}{'gathers':>9}{'r-s':>5}"
          f"{'param MiB':>11}{'state MiB':>11}")
    for r in rows_out:
        r["ratio"] = r["step_s"] / base
        print(f"{r['mode']:<13}{r['step_s']:>8.3f}{r['ratio']:>7.2f}{r['peak_bytes'] / 2**20:>10.2f}"
              f"{r['planned'] / 2**20:>9.2f}{r['gathers']:>9}{r['reduce_scatters']:>5}{r['param_bytes'] / 2**20:>11.2f}"
              f"{r['state_bytes'] / 2**20:>11.2f}")
    if a.json:
        a.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "model": cfg.__dict__,
                                      "seq_len": seq, "rows": rows, "micro_batches": m, "rows_out": rows_out,
                                      "machine": platform.processor() or platform.machine(),
                                      "cores": os.cpu_count(), "torch": torch.__version__,
                                      "load_average": os.getloadavg()}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
