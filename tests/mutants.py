"""Plant known bugs in a scratch copy of the repository, run the tests meant to catch each,
and report which did and by how many tolerances. Not a test itself (pytest does not
collect it); run it when the suite changes a lot and put the table in docs/mutants.md:

    python tests/mutants.py                      # every mutant, the table on stdout
    python tests/mutants.py --only clip_off      # one
    python tests/mutants.py --out /tmp/mutants.md   # then the table into docs/mutants.md
    python tests/mutants.py --check              # every snippet still in its file (seconds)

The mutants are listed in tests/support/mutant_list.py (and the known survivors, which run only
when named with --only). Each replaces one exact snippet of the source: a snippet that no
longer exists is reported as stale (the code moved; update the mutant), never silently
skipped. A mutant is caught when at least one of its tests fails; the margin is the
largest ratio of a difference to its tolerance that torch.testing.assert_close reports in
the failure (or tests/test_document_switches.py's "x the tolerance"; a test that fails
otherwise, e.g. on an exact comparison, shows as "fails"). Exit status 1 when a mutant
survives or is stale.
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
from pathlib import Path

from support.mutant_list import KNOWN_SURVIVORS, MUTANTS, Mutant

ROOT = Path(__file__).resolve().parent.parent

# torch.testing.assert_close's report, and our own asserts that follow its wording
_DIFF = re.compile(r"(?:Greatest (?:absolute|relative) difference:|difference\|) ([0-9.eE+-]+|nan|inf) .*?"
                   r"\(up to ([0-9.eE+-]+) allowed\)")
# tests/test_document_switches.py's report: "loss: fit X, by hand Y: Z x the tolerance"
_BY_HAND = re.compile(r"by hand \S+: ([0-9.eE+-]+|nan|inf) x the tolerance")


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
    sections = re.split(r"\n_+ (\S+) _+\n", output)  # long names: one "_" each side
    for name, body in zip(sections[1::2], sections[2::2]):
        pairs = _DIFF.findall(body) + [(x, "1") for x in _BY_HAND.findall(body)]
        ratios = [float(a) / float(b) for a, b in pairs if float(b) > 0 and a not in ("nan", "inf")]
        bad = any(a in ("nan", "inf") for a, _ in pairs)
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
        # Failed tests are a catch even where the process then died (a writer thread the
        # mutant left running can abort the interpreter at exit: pytest exit -6).
        status = "caught" if proc.returncode != 0 and failed else "survived" if proc.returncode == 0 else \
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
        lines.append(f"| `{m.name}`: {m.what} | `{m.file}` | {r['status']} | {caught} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="Mutant names to run (default: all).")
    parser.add_argument("--timeout", type=float, default=3600, help="Seconds per mutant.")
    parser.add_argument("--out", help="Also write the table to this file.")
    parser.add_argument("--check", action="store_true",
                        help="Only check that every snippet occurs once in its file (seconds, no tests run).")
    args = parser.parse_args()
    unknown = set(args.only or ()) - {m.name for m in MUTANTS + KNOWN_SURVIVORS}
    if unknown:
        parser.error(f"no mutant named {', '.join(sorted(unknown))}")
    # A known survivor runs only when named.
    chosen = [m for m in MUTANTS + KNOWN_SURVIVORS if m.name in (args.only or ())] if args.only else MUTANTS
    if args.check:
        chosen = chosen if args.only else MUTANTS + KNOWN_SURVIVORS
        stale = [m.name for m in chosen if (ROOT / m.file).read_text().count(m.old) != 1]
        print(f"{len(chosen) - len(stale)} of {len(chosen)} snippets found once" +
              (f"; stale: {', '.join(stale)}" if stale else ""))
        return 1 if stale else 0
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
