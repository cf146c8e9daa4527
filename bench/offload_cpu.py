"""A CPU training step with and without offload (issue 43 item 4): the step time of
train.activation_checkpointing offload, train.optimizer_offload and both, each against
the same step without, in one process, with the losses compared bit for bit.

On a CPU host and device are one memory, so this times only the copies the offloads add
(each saved tensor of a block out and back; the gradient and parameter shards to the
moments and back): what offload costs where nothing is gained. Its point on a GPU (the
device memory saved, the PCIe time) is not measured here.

    python bench/offload_cpu.py [--steps 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshtrain import AdamW, LRSchedule, TrainState, build, make_train_step  # noqa: E402
from meshtrain.models import llama  # noqa: E402
from meshtrain.models.spec import init_slice  # noqa: E402

CFG = llama.LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, vocab_size=512, max_seq_len=256)
CASES = {"none": {}, "activation offload": {"activation_checkpointing": "offload"},
         "optimizer offload": {"optimizer_offload": True},
         "both": {"activation_checkpointing": "offload", "optimizer_offload": True}}


def _step(options: dict):
    model = build("llama", CFG)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    state = TrainState.create(params, options.get("optimizer_offload", False))
    step = make_train_step(model, optimizer=AdamW(lr=3e-4), lr_schedule=LRSchedule(lr=3e-4, kind="constant"),
                           **options)
    return lambda batch: step(state, batch)["loss"]


def run(steps: int) -> dict:
    """{case: (losses, median seconds per step after the first)}; the cases take turns at
    each step, so a busy machine slows them alike."""
    runs = {name: _step(options) for name, options in CASES.items()}
    g = torch.Generator().manual_seed(0)
    losses, times = {name: [] for name in CASES}, {name: [] for name in CASES}
    for _ in range(steps):
        t = torch.randint(0, CFG.vocab_size, (2, 4, 129), generator=g)
        for name, step in runs.items():
            start = time.perf_counter()
            losses[name].append(step({"tokens": t[..., :-1], "targets": t[..., 1:]}))
            times[name].append(time.perf_counter() - start)
    return {name: (losses[name], sorted(times[name][1:])[len(times[name][1:]) // 2]) for name in CASES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = run(args.steps)
    base_losses, base = results["none"]
    out = {}
    for name, (losses, seconds) in results.items():
        out[name] = {"step_s": seconds, "ratio": seconds / base, "bit_identical": losses == base_losses}
        print(f"{name:20s} {seconds * 1e3:8.1f} ms/step  x{seconds / base:.3f} of none  "
              f"losses {'bit-identical' if losses == base_losses else 'DIFFER'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "cases": out}, f, indent=1)


if __name__ == "__main__":
    main()
