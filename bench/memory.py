"""Peak memory of one training step under each activation-checkpointing mode, measured.

One single-process training step (forward, backward, clip, AdamW) of a small Llama, in
fp32 on the CPU, from the same initial parameters and batch, for
train.activation_checkpointing none, selective and full. Reported per mode:

  peak_bytes   the peak of bytes live in torch's CPU allocator during the step, above the
               level before it (meshtrain.train.peak_memory: torch.profiler's allocation
               events walked in time order). Parameters and optimizer state exist before
               the step and are not in it; the gradients, the activations saved for
               backward and the temporaries are.
  ratio        peak_bytes / the `none` run's peak (below 1: memory saved)
  loss         the step's loss, which must equal the `none` run's (rtol 1e-5), else the
               bench prints REFUSING TO REPORT and exits 1
  step_s       the median of 3 unprofiled steps after a warm-up (the price of recomputation)

The figures are of this model and shape on this allocator; on a GPU the same policy saves
the same tensors, but the caching allocator's peak differs.

    python bench/memory.py --json memory.json   # dim 256, 4 layers, batch 4 x seq 512
    python bench/memory.py --tiny --json out.json  # seconds, for CI
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshtrain.models import build, llama  # noqa: E402
from meshtrain.models.spec import init_slice  # noqa: E402
from meshtrain.train.optim import AdamW  # noqa: E402
from meshtrain.train.peak_memory import peak_cpu_bytes  # noqa: E402
from meshtrain.train.step import TrainState, make_train_step  # noqa: E402

MODES = ("none", "selective", "full")
SIZES = {
    "default": dict(model=dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, vocab_size=2048,
                               max_seq_len=512), batch=4, seq=512),
    "tiny": dict(model=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172, vocab_size=256,
                            max_seq_len=128), batch=2, seq=128),
}


def measure(cfg: llama.LlamaConfig, batch: dict, mode: str, precision: str) -> dict:
    model = build("llama", cfg)

    def fresh():
        params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
        step = make_train_step(model, optimizer=AdamW(lr=3e-4), precision=precision, activation_checkpointing=mode)
        return step, TrainState.create(params)

    step, state = fresh()
    metrics, peak = peak_cpu_bytes(step, state, batch)
    step, state = fresh()
    step(state, batch)  # warm-up
    times = []
    for _ in range(3):
        start = time.perf_counter()
        step(state, batch)
        times.append(time.perf_counter() - start)
    return {"mode": mode, "peak_bytes": peak, "loss": metrics["loss"], "step_s": sorted(times)[1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a seconds-long run for CI")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    size = SIZES["tiny" if args.tiny else "default"]
    cfg = llama.LlamaConfig(**size["model"])
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, cfg.vocab_size, (1, size["batch"], size["seq"] + 1), generator=g)
    batch = {"tokens": t[..., :-1], "targets": t[..., 1:]}

    rows = [measure(cfg, batch, mode, args.precision) for mode in MODES]
    base = rows[0]
    for r in rows:
        r["ratio"] = r["peak_bytes"] / base["peak_bytes"]
        if abs(r["loss"] - base["loss"]) > 1e-5 * abs(base["loss"]):
            print(f"REFUSING TO REPORT: {r['mode']} loss {r['loss']} != none's {base['loss']}")
            return 1
    print(f"one training step, {args.precision}, dim {cfg.dim}, {cfg.n_layers} layers, batch {size['batch']} x "
          f"seq {size['seq']}, vocab {cfg.vocab_size}")
    print(f"{'mode':<10} {'peak MiB':>9} {'ratio':>6} {'step s':>7}  loss")
    for r in rows:
        print(f"{r['mode']:<10} {r['peak_bytes'] / 2**20:9.1f} {r['ratio']:6.3f} {r['step_s']:7.3f}  {r['loss']:.6f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"modes": rows, "precision": args.precision, "model": size["model"], "batch": size["batch"],
                       "seq": size["seq"], "command": "python " + " ".join(sys.argv),
                       "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch "
                                  f"{torch.__version__}",
                       "date": datetime.date.today().isoformat()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
