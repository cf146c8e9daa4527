"""Plant known bugs in a scratch copy of the repository, run the tests meant to catch each,
and report which did and by how many tolerances. Not a test itself (pytest does not
collect it); run it when the suite changes a lot and put the table in docs/mutants.md:

    python tests/mutants.py                      # every mutant, the table on stdout
    python tests/mutants.py --only clip_off      # one
    python tests/mutants.py --out docs/mutants.md

Each mutant replaces one exact snippet of the source: a snippet that no longer exists is
reported as stale (the code moved; update the mutant), never silently skipped. A mutant
is caught when at least one of its tests fails; the margin is the largest ratio of a
difference to its tolerance that torch.testing.assert_close reports in the failure (a
test that fails otherwise, e.g. on an exact comparison, shows as "fails"). Exit status 1
when a mutant survives or is stale.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids (or files) expected to catch it; all run in CI


EQUIVALENCE = ("tests/test_equivalence.py::test_layouts_match_single_process",)
AGAINST_TORCH = ("tests/test_equivalence.py::test_clipped_update_equals_torch_one_process",
                 "tests/test_equivalence.py::test_clipped_update_equals_torch_sharded")
STEP = (*EQUIVALENCE, *AGAINST_TORCH)  # layouts against one process, and the update against torch

MUTANTS = [
    Mutant("grad_1d_x0.5", "every 1-D (norm) gradient halved in the sharded backward",
           "meshtrain/parallel/context.py",
           "        grad = grad.to(ctx.dtype)\n",
           "        grad = grad.to(ctx.dtype) * (0.5 if grad.ndim == 1 else 1.0)\n", STEP),
    Mutant("grad_1d_x2", "every 1-D (norm) gradient doubled in the sharded backward",
           "meshtrain/parallel/context.py",
           "        grad = grad.to(ctx.dtype)\n",
           "        grad = grad.to(ctx.dtype) * (2.0 if grad.ndim == 1 else 1.0)\n", STEP),
    Mutant("clip_off", "gradient clipping removed", "meshtrain/train/step.py",
           "        if clip is not None:\n", "        if False:\n", STEP),
    Mutant("clip_off_sharded", "gradient clipping removed when the parameters are sharded",
           "meshtrain/train/step.py",
           "norm, grad_clip)",
           "norm, None if type(state.params[names[0]]).__name__ == 'DTensor' else grad_clip)", STEP),
    Mutant("norm_no_all_reduce", "the gradient norm without its all-reduce over the world",
           "meshtrain/train/optim.py",
           "    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:\n",
           "    if False:\n", STEP),
    Mutant("no_dp_reduction", "gradients not reduced over the replicated (dp) axis",
           "meshtrain/parallel/context.py",
           "        return grad.redistribute(grad.device_mesh, ctx.placements), None, None\n",
           "        return DTensor.from_local(grad.to_local(), grad.device_mesh, ctx.placements, run_check=False), "
           "None, None\n", STEP),
    Mutant("loss_per_micro_batch", "the loss averaged per micro-batch instead of over the global batch",
           "meshtrain/train/step.py",
           "                loss = lm / n_tokens\n",
           "                loss = lm / count_targets([targets[micro]])\n", STEP),
    Mutant("decay_on_norms", "weight decay applied to 1-D parameters (norm scales, biases)",
           "meshtrain/train/optim.py",
           "        return ndim >= 2 and not any(",
           "        return ndim >= 0 and not any(", STEP),
    Mutant("export_rope_theta", "RoPE theta doubled in the exported config.json", "meshtrain/models/llama/hf.py",
           '"rope_theta": float(cfg.rope_theta)',
           '"rope_theta": 2 * float(cfg.rope_theta)', ("tests/test_hf.py",)),
]

# torch.testing.assert_close's report, and our own asserts that follow its wording
_DIFF = re.compile(r"(?:Greatest (?:absolute|relative) difference:|difference\|) ([0-9.eE+-]+|nan|inf) .*?"
                   r"\(up to ([0-9.eE+-]+) allowed\)")


def scratch_copy(dest: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "*.egg-info", ".pytest_cache")
    for name in ("meshtrain", "tests", "configs", "bench", "docs"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "cli.py"):
        shutil.copy2(ROOT / name, dest / name)


def plant(root: Path, m: Mutant) -> bool:
    path = root / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        return False
    path.write_text(text.replace(m.old, m.new))
    return True


def margins(output: str) -> dict[str, str]:
    """Failed test -> 'x<ratio>' (largest difference over its tolerance) or 'fails'."""
    out = {}
    sections = re.split(r"\n_{3,} (\S+) _{3,}\n", output)
    for name, body in zip(sections[1::2], sections[2::2]):
        ratios = [float(a) / float(b) for a, b in _DIFF.findall(body) if float(b) > 0 and a not in ("nan", "inf")]
        bad = any(a in ("nan", "inf") for a, _ in _DIFF.findall(body))
        out[name] = "x inf" if bad else f"x{max(ratios):.3g}" if ratios else "fails"
    return out


def run(m: Mutant, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        root = Path(tmp)
        scratch_copy(root)
        if not plant(root, m):
            return {"status": "stale", "caught": {}, "seconds": 0.0}
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
                               *m.tests], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        caught = margins(proc.stdout)
        failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
        for node in failed:
            short = node.split("::", 1)[-1]
            caught.setdefault(short, "fails")
        status = "caught" if proc.returncode == 1 and failed else "survived" if proc.returncode == 0 else \
            f"error (pytest exit {proc.returncode})"
        return {"status": status, "caught": caught, "seconds": time.monotonic() - start,
                "tail": proc.stdout[-2000:] if status.startswith("error") else ""}


def table(results: list[tuple[Mutant, dict]]) -> str:
    lines = [f"Mutation check of {datetime.date.today().isoformat()} (`python tests/mutants.py`): each bug planted "
             "alone in a scratch copy, then the tests listed run; margin = the largest difference over its "
             "tolerance in the failure.", "",
             "| mutant | planted in | result | caught by (margin) | seconds |", "|---|---|---|---|---|"]
    for m, r in results:
        caught = "; ".join(f"`{t}` {x}" for t, x in sorted(r["caught"].items())) or "-"
        lines.append(f"| {m.what} | `{m.file}` | {r['status']} | {caught} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="Mutant names to run (default: all).")
    parser.add_argument("--timeout", type=float, default=3600, help="Seconds per mutant.")
    parser.add_argument("--out", help="Also write the table to this file.")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    results = []
    for m in chosen:
        r = run(m, args.timeout)
        print(f"{m.name}: {r['status']} {r['caught']} ({r['seconds']:.0f} s)", flush=True)
        if r.get("tail"):
            print(r["tail"])
        results.append((m, r))
    text = table(results)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all(r["status"] == "caught" for _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
