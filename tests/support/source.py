"""Reading meshtrain's source as syntax trees, for the tests of its structure
(tests/test_layering.py, tests/test_house_rules.py): each takes the package root, so a
test can run the same check on a copy with a violation planted in it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent.parent / "meshtrain"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the package at `root`."""
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute dotted names an import statement in `module` binds: `import a.b` ->
    a.b; `from ..x import y` -> meshtrain.x.y (a module or a name in one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(parts[:len(parts) - node.level + 1])
    source = ".".join(p for p in (base, node.module or "") if p)
    return [f"{source}.{a.name}" for a in node.names]


def functions(tree: ast.AST):
    """(qualified name, node) of every function and method, nested ones included."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    yield name, child
                yield from walk(child, name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def function_local_imports(tree: ast.AST) -> list[tuple[str, ast.Import | ast.ImportFrom]]:
    """(qualified name of the innermost function, statement) of every import statement
    inside a function body, at any depth (under an if, a try, a class in the function)."""
    found = []
    for name, function in functions(tree):
        def walk(node, name=name):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue  # counted under its own name
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    found.append((name, child))
                walk(child)

        walk(function)
    return found
