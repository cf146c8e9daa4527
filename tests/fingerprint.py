"""The behaviour of a fixed set of training runs, to the last bit: record it before a change
that must not change behaviour (a reshaping, a rename), check it after. Not a test itself
(pytest does not collect it): the runs take a few minutes.

    python tests/fingerprint.py --write tests/golden/fingerprint.json   # before
    python tests/fingerprint.py --check tests/golden/fingerprint.json   # after: exit 1 on any change

Each run goes through the public CLI (`meshtrain fit`) for STEPS steps with the clip below the natural gradient norm, so clipping engages; its
fingerprint is the loss and gradient norm of every step (JSON floats: exact) and the
SHA-256 of every tensor of the final checkpoint (parameters and optimizer state). Only meaningful on one machine
with one torch build: float results differ across CPUs and builds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6
COMMON = ["--train.steps", str(STEPS), "--train.warmup_steps", "2", "--train.grad_clip", "0.5",
          "--train.global_batch", "8", "--checkpoint.every", "0"]

RUNS = {  # name -> (config, extra flags)
    "one_process": ("configs/tiny.yaml", []),
    "fsdp2_tp2_sp": ("configs/tiny-4proc.yaml", []),
    "pp2_1f1b": ("configs/tiny-pp2.yaml", []),
    "cp2_ring": ("configs/tiny-cp2.yaml", []),
    "ep2_moe": ("configs/tiny-moe.yaml", []),
    "compiled_one_process": ("configs/tiny.yaml", ["--train.compile", "true"]),
}


def state_hashes(checkpoint: Path, tmp: Path) -> dict[str, str]:
    """SHA-256 of every tensor (parameters and optimizer state, gathered whole) of a checkpoint."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, tmp / "state.pt")
    out = {}

    def walk(tree, prefix):
        for key, value in sorted(tree.items()):
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif isinstance(value, torch.Tensor):
                out[prefix + key] = hashlib.sha256(value.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            else:
                out[prefix + key] = repr(value)

    walk(torch.load(tmp / "state.pt", weights_only=False), "")
    return out


def fingerprint(name: str, config: str, extra: list[str], tmp: Path) -> dict:
    run_dir = tmp / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "meshtrain.cli", "fit", "--config", config, *COMMON, *extra,
           "--run_dir", str(run_dir)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "grad_norm" in r]
    return {"config": config, "flags": extra,
            "loss": [r["loss"] for r in steps], "grad_norm": [r["grad_norm"] for r in steps],
            "state_sha256": state_hashes(run_dir / "checkpoints" / f"step_{STEPS:08d}", run_dir)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", help="Record the fingerprints to this JSON file.")
    group.add_argument("--check", help="Compare with the fingerprints in this JSON file.")
    parser.add_argument("--only", nargs="*", help="Run names (default: all).")
    args = parser.parse_args()
    names = [n for n in RUNS if not args.only or n in args.only]
    with tempfile.TemporaryDirectory(prefix="fingerprint-") as tmp:
        got = {}
        for name in names:
            got[name] = fingerprint(name, *RUNS[name], Path(tmp))
            print(f"{name}: loss {got[name]['loss'][-1]!r} grad_norm {got[name]['grad_norm'][-1]!r}", flush=True)
    if args.write:
        Path(args.write).write_text(json.dumps({"steps": STEPS, "common_flags": COMMON, "runs": got}, indent=1) + "\n")
        return 0
    want = json.loads(Path(args.check).read_text())["runs"]
    changed = [n for n in names if got[n] != want.get(n)]
    for n in changed:
        for key in ("loss", "grad_norm", "state_sha256"):
            if got[n][key] != want.get(n, {}).get(key):
                print(f"CHANGED {n}: {key}")
    print("bit-identical" if not changed else f"{len(changed)} of {len(names)} runs changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
