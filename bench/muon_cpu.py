"""Step time of Muon against AdamW on gloo CPU ranks (issue 43), and the share of Muon's
gathered Newton-Schulz in it.

One small Llama (fp32, eager) on one process and on fsdp 2 x tp 2 + sp (4 gloo ranks,
one thread each), the same initial parameters and batches for both optimizers
(train.optimizer adamw and muon). Per layout: --warmup untimed steps of each, then
--rounds rounds in which each optimizer runs --steps steps (the order alternating)
between barriers; a round's time is the slowest rank's. Reported: the median ms/step of
each, the ratio muon / adamw (of medians), and the median ms per step spent in Muon's
orthogonal steps (`train/muon.py:orthogonal_steps`: each matrix's update gathered whole,
Newton-Schulz, this rank's slice applied). Muon runs twice: `assemble="gather"` (every
rank of a matrix's mesh gathers it whole and orthogonalises it) and `assemble="owner"`
(the matrices of one shape and layout stacked and spread by all-to-alls, each
orthogonalised on one rank, the result sent back); the ratio owner / gather of the step
and of the orthogonal steps alone.

    python bench/muon_cpu.py --json out.json          # dim 256, 4 layers, 8 x 64 tokens
    python bench/muon_cpu.py --tiny                   # seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshtrain import AdamW, LRSchedule, MeshSpec, Muon, Rules, TrainState, build, init_params  # noqa: E402
from meshtrain import make_plan, make_train_step  # noqa: E402
from meshtrain.models.llama import LlamaConfig  # noqa: E402
from meshtrain.models.spec import init_slice  # noqa: E402
from meshtrain.testing import run_ranks  # noqa: E402
import meshtrain.train.muon as muon_module  # noqa: E402

FULL = dict(dim=256, layers=4, heads=8, kv_heads=4, ffn=688, vocab=512, batch=8, seq=64, warmup=2, steps=3, rounds=5)
TINY = dict(dim=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=64, batch=4, seq=16, warmup=1, steps=1, rounds=2)
LAYOUTS = {"one_process": None, "fsdp2xtp2-sp": ({"fsdp": 2, "tp": 2}, True)}
OPTIMIZERS = ("adamw", "muon", "muon_owner")


def _optimizer(name: str):
    adamw = AdamW(lr=3e-4, weight_decay=0.1)
    return adamw if name == "adamw" else Muon(adamw, assemble="owner" if name == "muon_owner" else "gather")


def _batches(a, n=4):
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        t = torch.randint(0, a["vocab"], (1, a["batch"], a["seq"] + 1), generator=g)
        out.append({"tokens": t[..., :-1].contiguous(), "targets": t[..., 1:].contiguous()})
    return out


class _Timed:
    """orthogonal_steps and owner_steps wrapped: the seconds of the outermost call summed."""

    def __init__(self):
        self.seconds, self.depth = 0.0, 0
        for name in ("orthogonal_steps", "owner_steps"):
            setattr(muon_module, name, self.wrap(getattr(muon_module, name)))

    def wrap(self, inner):
        def timed(*args):
            start = time.perf_counter()
            self.depth += 1
            try:
                inner(*args)
            finally:
                self.depth -= 1
            if not self.depth:
                self.seconds += time.perf_counter() - start

        return timed


def measure(a: dict, layout: str) -> dict:
    """Runs on every rank of `layout` (or the one process)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    ranked = dist.is_available() and dist.is_initialized()
    cfg = LlamaConfig(dim=a["dim"], n_layers=a["layers"], n_heads=a["heads"], n_kv_heads=a["kv_heads"],
                      ffn_dim=a["ffn"], vocab_size=a["vocab"], max_seq_len=a["seq"])
    model, timed, batches = build("llama", cfg), _Timed(), _batches(a)
    runs = {}
    for name in OPTIMIZERS:
        opt, schedule = _optimizer(name), LRSchedule(lr=3e-4, kind="constant")
        if LAYOUTS[layout] is None:
            params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
            step = make_train_step(model, optimizer=opt, lr_schedule=schedule)
        else:
            sizes, sp = LAYOUTS[layout]
            plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**sizes), world=dist.get_world_size())
            mesh = plan.mesh.build()
            params = init_params(plan, mesh, seed=0)
            step = make_train_step(model, plan, mesh, optimizer=opt, lr_schedule=schedule)
        runs[name] = step, TrainState.create(params, opt)
    times = {name: [] for name in OPTIMIZERS}
    ortho = {name: [] for name in OPTIMIZERS[1:]}
    for i in range(a["warmup"]):
        for name, (step, state) in runs.items():
            step(state, batches[i % len(batches)])
    for r in range(a["rounds"]):
        order = OPTIMIZERS if r % 2 == 0 else OPTIMIZERS[::-1]
        for name in order:
            step, state = runs[name]
            if ranked:
                dist.barrier()
            before, start = timed.seconds, time.perf_counter()
            for i in range(a["steps"]):
                step(state, batches[i % len(batches)])
            seconds = [time.perf_counter() - start, timed.seconds - before]
            if ranked:
                t = torch.tensor(seconds, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                seconds = t.tolist()
            times[name].append(1000 * seconds[0] / a["steps"])
            if name in ortho:
                ortho[name].append(1000 * seconds[1] / a["steps"])
    out = {name: statistics.median(v) for name, v in times.items()}
    for name, v in ortho.items():
        out[f"{name}_orthogonal"] = statistics.median(v)
    out["ratio"] = out["muon_owner"] / out["adamw"]  # the default against AdamW
    out["gather_ratio"] = out["muon"] / out["adamw"]
    out["owner_ratio"] = out["muon_owner"] / out["muon"]
    out["orthogonal_owner_ratio"] = out["muon_owner_orthogonal"] / out["muon_orthogonal"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a small model (seconds)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    a = TINY if args.tiny else FULL
    results = {}
    for layout, spec in LAYOUTS.items():
        results[layout] = measure(a, layout) if spec is None else run_ranks(measure, 4, a, layout)[0]
        r = results[layout]
        print(f"{layout:14s} ms/step: adamw {r['adamw']:.1f}, muon (gather) {r['muon']:.1f}, muon (owner) "
              f"{r['muon_owner']:.1f}; muon / adamw {r['ratio']:.2f} (gather {r['gather_ratio']:.2f}); owner / gather: "
              f"step {r['owner_ratio']:.2f}, "
              f"orthogonal steps {r['orthogonal_owner_ratio']:.2f} ({r['muon_owner_orthogonal']:.1f} / "
              f"{r['muon_orthogonal']:.1f} ms)")
    if args.json:
        args.json.write_text(json.dumps({"model": a, "torch": torch.__version__, "layouts": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
