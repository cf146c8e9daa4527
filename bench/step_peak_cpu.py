"""A whole training step's peak memory, measured by the allocator, against `meshtrain plan`.

For each layout, one rank of the world runs two micro-steps of a small Llama (dim 512, 4
blocks) on the fake process group (collectives run on the calling thread as no-ops with
real output buffers, so every buffer a collective allocates is seen, and freed, where a
GPU rank would allocate it). Reported per layout:

  measured   the most bytes live in torch's CPU allocator during the step's forward and
             backward (meshtrain.train.peak_memory, up to the optimizer), above the level
             before the step: gradients, activations, gathered weights, the buckets'
             communication buffers, prefetched gathers and reductions in flight
  planned    the planner's peak (estimate/memory.py per_rank_memory) less what exists
             before the step (parameters and optimizer state)
  ratio      planned / measured
  parts      the planner's terms that make it up

Two micro-steps, so the step's gradients exist from the first one (the planner counts them
for the whole step) and the second accumulates into them. The figures are of this
allocator (exact bytes requested, no caching): on a GPU the caching allocator's rounding
and fragmentation come on top (the planner's `allocator_slack`, docs/plan.md).

    python bench/step_peak_cpu.py --json step_peak.json   # ~1 min
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshtrain import MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step  # noqa: E402
from meshtrain.estimate.memory import per_rank_memory  # noqa: E402
from meshtrain.layout.traffic import Traffic  # noqa: E402
from meshtrain.models.llama import LlamaConfig  # noqa: E402
from meshtrain.train.optim import AdamW  # noqa: E402
from meshtrain.train.peak_memory import peak_cpu_bytes  # noqa: E402

CFG = LlamaConfig(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1376, vocab_size=2048, max_seq_len=64)
SEQ, ROWS, MICRO = 32, 2, 2  # rows per data-parallel rank per micro-step
# name: (mesh sizes, sequence parallel, precision, parallel.prefetch, compile backend or None)
LAYOUTS = {
    "one process": ({}, False, "fp32", 1, None),
    "fsdp2": ({"fsdp": 2}, False, "fp32", 1, None),
    "fsdp2 prefetch 0": ({"fsdp": 2}, False, "fp32", 0, None),
    "fsdp2 bf16": ({"fsdp": 2}, False, "bf16", 1, None),
    "fsdp4": ({"fsdp": 4}, False, "fp32", 1, None),
    "dp2": ({"dp": 2}, False, "fp32", 1, None),
    "hsdp 2x2": ({"dp": 2, "fsdp": 2}, False, "fp32", 1, None),
    "tp2 + sp": ({"tp": 2}, True, "fp32", 1, None),
    "fsdp2 x tp2 + sp": ({"fsdp": 2, "tp": 2}, True, "fp32", 1, None),
    "fsdp2 compiled": ({"fsdp": 2}, False, "fp32", 1, "aot_eager"),
}
PARTS = ("grads", "activations", "transient", "comm_buffers")


def measure(sizes: dict, sp: bool, precision: str, prefetch: int, compile: str | None) -> tuple[int, dict]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = 1
    for n in sizes.values():
        world *= n
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        model = build("llama", CFG)
        plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**sizes), world=world)
        mesh = plan.mesh.build()
        params = {n: x.requires_grad_() for n, x in init_params(plan, mesh, 0).items()}
        step = make_train_step(model, plan, mesh, optimizer=AdamW(lr=3e-4), precision=precision, prefetch=prefetch,
                               compile=compile or False)
        state = TrainState.create(params)
        data = plan.mesh.dp * plan.mesh.fsdp
        t = torch.randint(0, CFG.vocab_size, (MICRO, ROWS * data, SEQ + 1), generator=torch.Generator().manual_seed(0))
        batch = {"tokens": t[..., :-1], "targets": t[..., 1:]}
        step(state, batch)  # warm: the optimizer state exists before the measured step
        for p in params.values():
            p.grad = None
        _, peak = peak_cpu_bytes(step, state, batch, before="optimizer")
        mem = per_rank_memory(plan, model, micro_batch=ROWS, seq_len=SEQ, precision=precision,
                              traffic=Traffic(prefetch=prefetch))
        return peak, mem
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="comma-separated layout names")
    a = ap.parse_args()
    torch.set_num_threads(1)
    names = a.only.split(",") if a.only else list(LAYOUTS)
    print(f"Llama dim {CFG.dim}, {CFG.n_layers} blocks, vocab {CFG.vocab_size}; {MICRO} micro-steps of {ROWS} x {SEQ} "
          "tokens per data-parallel rank; fake process group, one rank measured")
    print(f"{'layout':<20}{'measured MiB':>14}{'planned':>9}{'ratio':>7}  " + " ".join(f"{p:>12}" for p in PARTS))
    rows = []
    for name in names:
        peak, mem = measure(*LAYOUTS[name])
        planned = mem["peak"] - mem["params"] - mem["optimizer"]
        rows.append({"layout": name, "measured": peak, "planned": planned, "ratio": planned / peak,
                     **{p: mem.get(p, 0) for p in PARTS}})
        print(f"{name:<20}{peak / 2**20:>14.2f}{planned / 2**20:>9.2f}{planned / peak:>7.3f}  "
              + " ".join(f"{mem.get(p, 0) / 2**20:>12.2f}" for p in PARTS))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "rows": rows, "torch": torch.__version__,
                       "machine": platform.processor() or platform.machine()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
