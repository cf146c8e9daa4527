"""The GPU checks in one go (bench/gpu.sh runs this after installing the carried wheels).

On one CUDA device, in this order, each step a subprocess with its own time limit inside
one overall deadline (`--budget`, default 570 s, so the whole kit fits a 10-minute lease):

  env                 torch version, device name, capability
  gpu_check           bench/gpu_check.py: each CUDA-only branch once (the background save's
                      staging synchronize, pinned staging, fp8 _scaled_mm, grouped GEMM)
  fit_bf16            `meshtrain fit` on configs/llama3-1b.yaml, one process, bf16, compiled,
                      the embedded corpus (no data on the machine), ending with a checkpoint
  fit_fp8_tensorwise  the same in fp8, tensorwise scales
  fit_fp8_rowwise     the same, rowwise scales
  mfu_bf16            bench/mfu.py: ours against transformers compiled (the llama3-1b shape)
  mfu_fp8_tensorwise  bench/mfu.py fp8 (ours only; the ratio to transformers is taken
  mfu_fp8_rowwise     against mfu_bf16's transformers figure, same machine)
  grouped_gemm        bench/moe.py: the grouped expert GEMM against a per-expert loop
  cp_attention        bench/cp_attention_gpu_check.py: fused context-parallel attention

and writes one JSON (`--out`/results.json): per step its exit code, seconds, log file and
what it measured (the fit runs' last logged loss and median tokens/s and MFU of the steps
after the first; each bench's own JSON), plus `skipped` for steps the deadline left out.
A step that fails does not stop the others.

    bash bench/gpu.sh                   # on the GPU machine: $OUT/results.json
    python bench/gpu_kit.py --smoke     # the same wiring on a CPU, tiny shapes (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def fit_step(run_dir: Path, precision: str, recipe: str | None, smoke: bool) -> list[str]:
    if smoke:  # the tiny config on a CPU: the CLI, the data and the checkpoint, eager
        options = ["--config", "configs/tiny.yaml", "--train.steps", "3", "--train.precision", precision]
    else:
        options = ["--config", "configs/llama3-1b.yaml", "--parallel.nproc_per_node", "1",
                   "--data.paths", "builtin", "--data.tokenizer", "bytes", "--train.steps", "12",
                   "--train.global_batch", "2", "--train.micro_batch", "2", "--train.seq_len", "4096",
                   "--train.warmup_steps", "2", "--train.log_every", "1", "--train.eval_every", "0",
                   "--train.precision", precision]
    if recipe:
        options += ["--train.fp8_recipe", recipe]
    return [PY, "-m", "meshtrain.cli", "fit", *options, "--run_dir", str(run_dir)]


def steps(out: Path, scratch: Path, smoke: bool) -> list[tuple[str, list[str], int]]:
    """(name, command, its own time limit in seconds)."""
    env = [PY, "-c", "import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': "
           "torch.__version__, 'cuda': torch.version.cuda, 'device': torch.cuda.get_device_name() if c else 'cpu', "
           "'capability': list(torch.cuda.get_device_capability()) if c else None}))"]
    tiny = ["--tiny"] if smoke else []
    out_steps = [("env", env, 60),
                 ("gpu_check", [PY, "bench/gpu_check.py", *(["--smoke"] if smoke else []),
                                "--json", str(out / "gpu_check.json")], 120)]
    for precision, recipe in (("bf16", None), ("fp8", "tensorwise"), ("fp8", "rowwise")):
        name = f"fit_{precision}" + (f"_{recipe}" if recipe else "")
        out_steps.append((name, fit_step(scratch / name, precision, recipe, smoke), 170))
    out_steps.append(("mfu_bf16", [PY, "bench/mfu.py", *tiny, "--ref", "eager" if smoke else "compiled",
                                   "--json", str(out / "mfu_bf16.json")], 200))
    for recipe in ("tensorwise", "rowwise"):
        out_steps.append((f"mfu_fp8_{recipe}", [PY, "bench/mfu.py", *tiny, "--precision", "fp8", "--fp8-recipe",
                                                recipe, "--ref", "none", "--warmup", "2", "--steps", "5",
                                                "--rounds", "2", "--json", str(out / f"mfu_fp8_{recipe}.json")],
                          120))
    out_steps.append(("grouped_gemm", [PY, "bench/moe.py", *tiny, "--json", str(out / "grouped_gemm.json")], 90))
    if not smoke:  # CUDA kernels only
        out_steps.append(("cp_attention", [PY, "bench/cp_attention_gpu_check.py"], 120))
    return out_steps


def fit_figures(run_dir: Path) -> dict:
    """The last logged loss and, over the steps after the first (compile), the median
    tokens/s and MFU, from the run's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r and r.get("step")]
    timed = [r for r in rows[1:] if r.get("tokens_per_s")]
    out = {"steps": len(rows), "last_loss": rows[-1]["loss"] if rows else None,
           "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
           if (run_dir / "checkpoints").exists() else []}
    if timed:
        out["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in timed)
        mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
        out["mfu"] = statistics.median(mfus) if mfus else None
    return out


def summary(done: dict) -> dict:
    """The ratios the kit exists for: fp8 against bf16 (ours) and against transformers
    (mfu_bf16's reference, same machine), and the fit runs' throughput."""
    out = {}
    bf16 = done.get("mfu_bf16", {}).get("result", {})
    for recipe in ("tensorwise", "rowwise"):
        fp8 = done.get(f"mfu_fp8_{recipe}", {}).get("result", {})
        if fp8.get("tokens_per_s") and bf16.get("tokens_per_s"):
            out[f"fp8_{recipe}_over_bf16"] = fp8["tokens_per_s"] / bf16["tokens_per_s"]
        if fp8.get("tokens_per_s") and bf16.get("reference_tokens_per_s"):
            out[f"fp8_{recipe}_over_transformers"] = fp8["tokens_per_s"] / bf16["reference_tokens_per_s"]
    if bf16.get("ratio"):
        out["bf16_over_transformers"] = bf16["ratio"]
    check = done.get("gpu_check", {}).get("result", {})
    if "passed" in check:
        out["gpu_check_passed"] = check["passed"]
    for name, step in done.items():
        if name.startswith("fit_") and step.get("tokens_per_s"):
            out[f"{name}_tokens_per_s"] = step["tokens_per_s"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-kit-out")))
    p.add_argument("--budget", type=float, default=570.0, help="seconds for the whole kit")
    p.add_argument("--smoke", action="store_true", help="CPU wiring check with tiny shapes")
    p.add_argument("--only", nargs="*", help="run only these steps")
    args = p.parse_args(argv)
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    # Fit runs write multi-GB checkpoints: outside $OUT (which comes back), removed after.
    scratch = Path(tempfile.mkdtemp(prefix="meshtrain-gpu-kit-"))
    results = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "smoke": args.smoke,
               "budget_s": args.budget, "steps": {}, "skipped": []}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    try:
        for name, cmd, limit in steps(args.out, scratch, args.smoke):
            if args.only and name not in args.only:
                continue
            left = args.budget - (time.monotonic() - start) - 10  # 10 s to write the results
            if left < min(limit, 45):
                results["skipped"].append(name)
                continue
            t0 = time.monotonic()
            log = logs / f"{name}.log"
            with open(log, "w") as f:
                try:
                    rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                        timeout=min(limit, left)).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            step = {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "log": str(log.relative_to(args.out))}
            if name == "env" and rc == 0:
                step.update(json.loads(log.read_text().strip().splitlines()[-1]))
            elif name.startswith("fit_"):
                step.update(fit_figures(scratch / name))
                shutil.rmtree(scratch / name, ignore_errors=True)
            elif (args.out / f"{name}.json").exists():
                step["result"] = json.loads((args.out / f"{name}.json").read_text())
            results["steps"][name] = step
            print(f"{name:<20} rc {rc!s:<8} {step['seconds']:7.1f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["summary"] = summary(results["steps"])
    results["seconds"] = round(time.monotonic() - start, 1)
    results["failed"] = [n for n, s in results["steps"].items() if s["rc"] != 0]
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"results: {args.out / 'results.json'} ({results['seconds']} s; failed: {results['failed'] or 'none'}; "
          f"skipped: {results['skipped'] or 'none'})")
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
