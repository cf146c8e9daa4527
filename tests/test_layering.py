"""The packages of meshtrain form layers whose imports only point down.

Read from the source (every import statement, module level or inside a function), not
from what happens to be imported at run time, so a function-local import cannot hide a
cycle. docs/architecture.md draws the same layers.

The tests stand alone the same way: a test module imports meshtrain and the helpers
package tests/support/, never another test module (nor does the helpers package).
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
from support.source import PACKAGE, module_name

# Bottom first: a unit may import only units before it in this list (or itself).
LAYERS = ["errors", "lazy", "files", "pools", "models", "data", "layout", "parallel", "pipeline", "train", "checkpoint", "interop", "config",
          "estimate", "run", "generate", "plot", "testing", "cli_errors", "cli", "meshtrain"]

# Imports that still point up, with what removes them; the test fails when one goes away
# unannounced too, so this list only shrinks.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def unit(module: str) -> str:
    """meshtrain.train.step -> train; meshtrain.cli -> cli; meshtrain -> meshtrain."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports(path: Path, root: Path = PACKAGE) -> set[str]:
    """Every meshtrain module (or package) that `path` imports, at any depth of the code."""
    name, is_package = module_name(path, root), path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "meshtrain"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "meshtrain":
                continue
            if node.module is None or target == "meshtrain":  # from .. import checkpoint: the names are modules
                found |= {f"{target}.{a.name}" for a in node.names}
            else:
                found.add(target)
    return found


def unit_graph(root: Path = PACKAGE) -> dict[tuple[str, str], set[str]]:
    """(importer unit, imported unit) -> the importing modules."""
    edges: dict[tuple[str, str], set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        src = unit(module_name(path, root))
        for target in imports(path, root):
            dst = unit(target)
            if dst != src:
                edges.setdefault((src, dst), set()).add(module_name(path, root))
    return edges


def upward(edges) -> dict[tuple[str, str], set[str]]:
    return {e: m for e, m in edges.items() if LAYERS.index(e[1]) > LAYERS.index(e[0])}


def test_every_unit_has_a_layer():
    units = {unit(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert units <= set(LAYERS), f"give {sorted(units - set(LAYERS))} a place in LAYERS (and docs/architecture.md)"


def test_imports_only_point_down():
    found = upward(unit_graph())
    new = {e: sorted(m) for e, m in found.items() if e not in KNOWN_UPWARD}
    assert not new, "imports that point up a layer (importer unit, imported unit): modules\n" + "\n".join(
        f"  {a} -> {b}: {', '.join(m)}" for (a, b), m in sorted(new.items()))
    gone = set(KNOWN_UPWARD) - set(found)
    assert not gone, f"{sorted(gone)} no longer point up: remove them from KNOWN_UPWARD"


@pytest.mark.parametrize("planted, points_to", [("from ..run.fit import fit", "run"),
                                                 ("from meshtrain.cli import main", "cli"),
                                                 ("from .. import estimate", "estimate")])
def test_a_planted_upward_import_is_seen(tmp_path, planted, points_to):
    """The same check on a copy of the package with one upward import planted inside a
    function of models/ (the bottom), as a cycle-dodging local import would be."""
    copy = tmp_path / "meshtrain"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "models" / "spec.py"
    target.write_text(target.read_text() + f"\n\ndef _planted():\n    {planted}\n")
    assert ("models", points_to) not in upward(unit_graph())
    assert upward(unit_graph(copy))[("models", points_to)] == {"meshtrain.models.spec"}


def test_the_python_api_resolves_and_importing_it_is_cheap():
    import subprocess
    import sys

    import meshtrain

    missing = [name for name in meshtrain.__all__ if getattr(meshtrain, name, None) is None]
    assert not missing
    code = "import sys, meshtrain, meshtrain.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", "importing meshtrain or its config must not import torch"


# --- tests that stand alone ------------------------------------------------------------

TESTS = Path(__file__).resolve().parent


def imports_of_test_modules(root: Path = TESTS) -> dict[str, set[str]]:
    """File (relative to `root`) -> the test modules it imports, at any depth of the code.
    A test module is any module directly in `root` (test_*.py, conftest.py, the scripts);
    `tests.` names count too (a second copy of a module under another name). The
    helpers package (root/support/, imported as `support`) is what they share instead."""
    modules = {p.stem for p in root.glob("*.py")}
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        package = list(path.relative_to(root).parent.parts)  # [] in tests/, ["support"] in tests/support/
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name.split(".") for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level > len(package) + 1:  # above tests/: never a helper
                    targets = [["tests", *(node.module or "").split(".")]]
                else:
                    base = package[:len(package) - node.level + 1] if node.level else []
                    module = node.module.split(".") if node.module else []
                    targets = [base + module] if node.module else [base + [a.name] for a in node.names]
            else:
                continue
            for target in targets:
                if target[0] in modules or target[0] == "tests":
                    found.setdefault(path.relative_to(root).as_posix(), set()).add(".".join(target))
    return found


def test_no_test_module_imports_another():
    found = imports_of_test_modules()
    assert not found, "test modules imported by other test files (move the helper to tests/support/):\n" + \
        "\n".join(f"  {f}: {', '.join(sorted(m))}" for f, m in sorted(found.items()))


@pytest.mark.parametrize("file, planted, imported", [
    ("test_equivalence.py", "def _planted():\n    from test_cli import ROOT\n", "test_cli"),
    ("test_layering.py", "import test_fit as fit_helpers\n", "test_fit"),
    ("support/cli.py", "def _planted():\n    from .. import test_dryrun\n", "test_dryrun"),
    ("support/equivalence.py", "from tests.support.cli import ROOT\n", "tests.support.cli"),
], ids=["function-local", "module-level", "relative-from-support", "tests-package"])
def test_a_planted_test_module_import_is_seen(tmp_path, file, planted, imported):
    """The same check on a copy of tests/ with one import of a test module planted (inside
    a function, at module level, relatively from the helpers package, through `tests.`)."""
    copy = tmp_path / "tests"
    shutil.copytree(TESTS, copy, ignore=shutil.ignore_patterns("__pycache__", "golden"))
    target = copy / file
    target.write_text(target.read_text() + "\n\n" + planted)
    assert file not in imports_of_test_modules()
    assert imports_of_test_modules(copy) == {file: {imported}}
