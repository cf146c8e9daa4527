"""The step-time model against published H100 throughput (issue 44, item 5): each published
layout planned with `meshtrain plan`'s model on the built-in h100, its tokens/s per GPU
beside the figure published. Reported, not asserted: the runs are other frameworks'
(Megatron-Core's fused kernels, TE's fp8 recipes, TorchTitan on 500 W H100s), and the
h100 built-in's achieved-matmul and latency figures are assumptions (hardware_builtins.py).

Layouts are mapped onto our knobs: Megatron's data parallelism with its distributed
optimizer is parallel.zero 1 (pp_keep_gathered under pp), its virtual pipeline stages
the interleaved schedule; TorchTitan's FSDP is fsdp with reshard_after_forward. Sources
are in docs/performance.md.

    python bench/step_time_published.py [--json published.json]    # seconds, no GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshtrain.config import RunConfig  # noqa: E402
from meshtrain.errors import ConfigError  # noqa: E402
from meshtrain.estimate.dryrun import dry_run  # noqa: E402

MEGATRON = {"zero": 1, "dp": 1, "fsdp": -1}
# (name, preset, world, parallel overrides, train overrides, published tokens/s per GPU, source)
CASES = [
    ("Llama3-8B, NeMo 24.07, CP 2, fp8", "llama3-8b", 8, {**MEGATRON, "cp": 2},
     {"precision": "fp8", "global_batch": 128, "activation_checkpointing": "none"}, 12273, "NeMo"),
    ("Llama3-70B, Megatron-LM, TP 4 PP 8 VP 5, fp8", "llama3-70b", 64,
     {"tp": 4, "sp": True, "pp": 8, "pp_schedule": "interleaved", "pp_virtual": 5, "pp_keep_gathered": True,
      "dp": 1, "fsdp": -1, "pp_layout": [2] * 40},  # Megatron's 2 layers per virtual stage
     {"precision": "fp8", "global_batch": 128, "activation_checkpointing": "none"}, 1621, "MLM"),
    ("Llama3-405B, Megatron-LM, TP 8 PP 8 CP 2 VP 8, fp8", "llama3-405b", 1024,
     {"tp": 8, "sp": True, "pp": 8, "cp": 2, "pp_schedule": "interleaved", "pp_virtual": 8,
      "pp_keep_gathered": True, "dp": 1, "fsdp": -1},
     {"precision": "fp8", "global_batch": 512, "activation_checkpointing": "none"}, 315, "MLM"),
    ("Llama3.1-8B, TorchTitan, FSDP 8, bf16, compile, SAC", "llama3-8b", 8, {"fsdp": -1},
     {"precision": "bf16", "compile": True, "global_batch": 16, "micro_batch": 2,
      "activation_checkpointing": "selective"}, 6667, "TT-a"),
    # Eager: our compiled steps refuse full checkpointing on more than one rank (torch 2.13).
    ("Llama3.1-70B, TorchTitan, FSDP 32 TP 8, fp8, full AC (eager here)", "llama3-70b", 256, {"tp": 8, "sp": True},
     {"precision": "fp8", "compile": False, "global_batch": 512, "micro_batch": 16,
      "activation_checkpointing": "full"}, 829, "TT-a"),
    ("Llama3.1-405B, TorchTitan, FSDP 8 TP 8 PP 8 interleaved, fp8, full AC", "llama3-405b", 512,
     {"tp": 8, "sp": True, "pp": 8, "pp_schedule": "interleaved", "pp_virtual": 2},
     {"precision": "fp8", "compile": False, "global_batch": 256, "micro_batch": 4,  # 8 micro-batches of the 32
      "activation_checkpointing": "full"}, 128, "TT-a"),
    ("DeepSeek-V3, Megatron Bridge 25.09, TP 2 PP 8 EP 64 VP 4, fp8", "deepseek-v3-671b", 1024,
     {"tp": 2, "sp": True, "pp": 8, "ep": 64, "pp_schedule": "interleaved", "pp_virtual": 4, "pp_keep_gathered": True,
      "dp": 1, "fsdp": -1}, {"precision": "fp8", "global_batch": 8192, "seq_len": 4096}, 1297, "MB-25.09"),
]


def config(preset: str, parallel: dict, train: dict) -> RunConfig:
    cfg = RunConfig.from_dict(yaml.safe_load((ROOT / "configs" / f"{preset}.yaml").read_text()))
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel),
                              train=dataclasses.replace(cfg.train, **train))
    return cfg.validate()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    for name, preset, world, parallel, train, published, source in CASES:
        try:
            run = dry_run(config(preset, parallel, train), world, "h100")
        except ConfigError as e:
            rows.append({"case": name, "error": str(e)})
            print(f"{name}: cannot plan: {e}")
            continue
        t = run.time
        rows.append({"case": name, "world": world, "published": published, "source": source,
                     "predicted": t["tokens_per_s_per_gpu"], "ratio": t["tokens_per_s_per_gpu"] / published,
                     "mfu": t["mfu"], "fits": run.fits, "breakdown": t["breakdown"]})
        print(f"{name:70s} world {world:5d}  published {published:7,d}  predicted {t['tokens_per_s_per_gpu']:9,.0f}  "
              f"ratio {rows[-1]['ratio']:.2f}  MFU {t['mfu']:.0%}  {'fits' if run.fits else 'OVER memory'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
