"""The step-time model of `meshtrain plan` against `meshtrain fit` on this machine (issue 44,
item 5): calibrate, predict, measure, report each ratio.

1. `meshtrain calibrate --nproc N` writes a hardware file for this machine as a run of N
   ranks uses it (one thread per rank, as `fit` launches them; the N ranks compute at
   once, sharing the cores): N = 1 for the one-process layout, 2 for the others;
2. per layout, `meshtrain plan --hardware FILE --json` gives the modelled `time.step_s`;
3. `meshtrain fit` runs the same config and flags; the measured step is the median
   `step_time_s` of metrics.jsonl after `--warmup` steps;
4. with `--rounds N`, all of it N times: each layout's ratio is the median round's. A
   shared VM's own speed moves between runs (one 2-core box here measured the same fsdp2
   step at 608, 680 and 821 ms in three runs, single steps from 520 to 800 ms), so one
   round's ratio can be off by that much whatever the model.

Layouts (configs/tiny.yaml's Llama, dim 256 x 4 layers, fp32, eager): one process, dp2,
fsdp2, tp2 + sp, cp2 ring, pp2 1F1B over 4 micro-batches, fsdp2 with prefetch 0 and 1.
Every run uses OMP_NUM_THREADS=1 (a 2-core box: one core per rank). The load average
before and after is printed: a busy machine makes every measurement slower, not the model.

    python bench/step_time_cpu.py --rounds 3 --json step_time.json   # about 25 minutes on 2 cores
    python bench/step_time_cpu.py --tiny                  # the smoke of CI (seconds)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny.yaml"
ONE = ["--parallel.fsdp", "1"]
TWO = ["--parallel.nproc_per_node", "2"]
LAYOUTS = {
    "one process": ONE,
    "dp2": TWO + ["--parallel.dp", "2", "--parallel.fsdp", "1"],
    "fsdp2": TWO + ["--parallel.fsdp", "2"],
    "tp2+sp": TWO + ["--parallel.fsdp", "1", "--parallel.tp", "2", "--parallel.sp", "true"],
    "cp2 ring": TWO + ["--parallel.fsdp", "1", "--parallel.cp", "2", "--parallel.cp_comm", "ring"],
    "pp2 1f1b x4": TWO + ["--parallel.fsdp", "1", "--parallel.pp", "2", "--parallel.pp_schedule", "1f1b"],
    "fsdp2 prefetch 0": TWO + ["--parallel.fsdp", "2", "--parallel.prefetch", "0"],
    "fsdp2 prefetch 1": TWO + ["--parallel.fsdp", "2", "--parallel.prefetch", "1"],
}
EXTRA = {  # not in the list: for looking closer (--only)
    "tp2": TWO + ["--parallel.fsdp", "1", "--parallel.tp", "2"],
    "cp2 allgather": TWO + ["--parallel.fsdp", "1", "--parallel.cp", "2", "--parallel.cp_comm", "allgather"],
    # The compiled step's fusion (step_work.COMPILED_BYTES, COMPILED_KERNELS) against inductor on CPU.
    "one process compiled": ONE + ["--train.compile", "true"],
    "fsdp2 compiled": TWO + ["--parallel.fsdp", "2", "--train.compile", "true"],
    # fsdp2's cost over dp2 against the number and kind of its collectives (docs/performance.md).
    "fsdp2 keep": TWO + ["--parallel.fsdp", "2", "--parallel.reshard_after_forward", "false"],
    "fsdp2 zero1": TWO + ["--parallel.fsdp", "2", "--parallel.zero", "1"],
    "fsdp2 4MB": TWO + ["--parallel.fsdp", "2", "--parallel.bucket", "4"],
    "fsdp2 param": TWO + ["--parallel.fsdp", "2", "--parallel.bucket", "param"],
    "dp2 param": TWO + ["--parallel.dp", "2", "--parallel.fsdp", "1", "--parallel.bucket", "param"],
}
# The tiny smoke: a smaller model, fewer steps, one layout; its ratio printed, not judged.
TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_dim", "172"]
WITHIN = 0.20  # the bound on |predicted / measured - 1|


def _meshtrain(*args: str, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "meshtrain.cli", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(args[:3])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


def _world(flags: list[str]) -> int:
    return int(flags[flags.index("--parallel.nproc_per_node") + 1]) if "--parallel.nproc_per_node" in flags else 1


def predict(flags: list[str], hardware: Path, work: Path, env: dict) -> dict:
    out = work / "plan.json"
    _meshtrain("plan", "--config", str(CONFIG), *flags, "--world", str(_world(flags)), "--hardware", str(hardware),
               "--json", str(out), env=env)
    return json.loads(out.read_text())["time"]


def measure(flags: list[str], steps: int, warmup: int, work: Path, env: dict) -> float:
    run = work / "run"
    _meshtrain("fit", "--config", str(CONFIG), *flags, "--run_dir", str(run), "--train.steps", str(steps),
               "--checkpoint.every", "0", env=env)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > warmup]
    return statistics.median(times)


def one_round(layouts: dict, steps: int, warmup: int, args, env: dict) -> list[dict]:
    """Calibrate afresh, then predict and measure each layout: its rows."""
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(args.hardware_dir or tmp)
        hardware = {n: where / f"hardware_{n}.yaml" for n in sorted({_world(f) for f in layouts.values()})}
        for n, path in hardware.items():
            done = _meshtrain("calibrate", "--out", str(path), "--nproc", str(n), *(["--quick"] if args.tiny else []),
                              env=env)
            print(f"--nproc {n}: {done.stdout.strip()}", flush=True)  # the constants vary between calibrations
        rows = []
        for name, flags in layouts.items():
            flags = flags + (TINY if args.tiny else [])
            work = Path(tmp) / name.replace(" ", "_")
            work.mkdir()
            time = predict(flags, hardware[_world(flags)], work, env)
            measured = measure(flags, steps, warmup, work, env)
            rows.append({"layout": name, "predicted_s": time["step_s"], "measured_s": measured,
                         "ratio": time["step_s"] / measured, "breakdown": time["breakdown"]})
            print(f"{name:18s} predicted {time['step_s'] * 1e3:8.1f} ms  measured {measured * 1e3:8.1f} ms  "
                  f"ratio {rows[-1]['ratio']:.2f}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CI smoke: small model, two layouts, quick calibration")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=1, help="calibrate, predict and measure this many times; each "
                    "layout's ratio is the median round's (this box's own speed moves between runs)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--only", nargs="*", help="layouts to run (names as printed)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--hardware-dir", help="keep the calibrations here (hardware_N.yaml for --nproc N; default: "
                                           "a temporary directory)")
    args = ap.parse_args(argv)
    layouts = {k: {**LAYOUTS, **EXTRA}[k] for k in (["fsdp2"] if args.tiny else args.only or LAYOUTS)}
    steps, warmup = (4, 1) if args.tiny else (args.steps, args.warmup)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    load_before = os.getloadavg()
    rounds = [one_round(layouts, steps, warmup, args, env) for _ in range(args.rounds)]
    load_after = os.getloadavg()
    # per layout, the round of the median ratio (the lower middle of an even count)
    rows = [sorted((r[i] for r in rounds), key=lambda row: row["ratio"])[(len(rounds) - 1) // 2]
            for i in range(len(layouts))]
    if len(rounds) > 1:
        for i, row in enumerate(rows):
            each = ", ".join(f"{r[i]['ratio']:.2f}" for r in rounds)
            print(f"{row['layout']:18s} median ratio {row['ratio']:.2f} of {each}")
    within = [abs(r["ratio"] - 1) <= WITHIN for r in rows]
    print(f"{sum(within)} of {len(rows)} within {WITHIN:.0%}; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "load_before": load_before, "load_after": load_after, "tiny": args.tiny,
            "rows": rows, "rounds": rounds}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
