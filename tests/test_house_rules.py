"""House rules of meshtrain's source, read with `ast` (tests/support/source.py):

- no module over 400 lines, no function over 100: a file or a function longer than that
  does more than one job;
- no import inside a function body, except those listed in FUNCTION_LOCAL_IMPORTS with
  their reason, and the CLI's by rule. A function-local import hides a module's
  dependencies and a cycle; it is for what a module must not load up front.

Each rule has a test that plants a violation in a copy of the package and sees it.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
from support.source import PACKAGE, function_local_imports, functions, imported_names, modules

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 100

# The CLI defers every command's imports to the command, so that `meshtrain --help` and
# a config error answer without loading torch: its modules may import anywhere.
CLI_MODULES = {"meshtrain.cli", "meshtrain.cli_errors"}

# The reasons a function may import, and where it does. The list only shrinks: the test
# fails on an import not listed, and on a listed one that is gone (remove it here).
TORCH_FREE_CONFIG = ("the run config and its sections stay torch-free (`import meshtrain.config` must not "
                     "import torch, test_layering checks it), and this module pulls torch in")
TORCH_FREE_MESH = ("layout/mesh.py is torch-free, the pure part of a layout that config/ and layout/rules.py "
                   "read: torch only where a DeviceMesh is built or DTensor's caches are cleared")
OPTIONAL = "an optional dependency (an extra in pyproject.toml): meshtrain imports and runs without it"
COMPILER = "torch's compiler stack (inductor, dynamo: seconds to import) only where a step is compiled"
CONSOLE = "rich's drawing only where something is drawn (rank 0's console, a terminal, a printed plan)"
LAUNCHER = "the elastic agent only in the process that launches ranks (every rank imports run/launch.py)"
PRIVATE_TORCH = ("a private torch name (underscored, moves between releases) on one path: a torch that "
                 "moved it breaks that path, not every import of the module")
INDIRECT = "PyYAML comes with jsonargparse, not as a dependency of ours: only where a config is written"

FUNCTION_LOCAL_IMPORTS: dict[tuple[str, str], str] = {
    **dict.fromkeys([
        ("meshtrain.config.schema", "meshtrain.config.assemble"),
        ("meshtrain.config.schema", "meshtrain.models.moe.MoeConfig"),
        ("meshtrain.models.config", "meshtrain.models.FAMILIES"),
        ("meshtrain.models.config", "meshtrain.models.get_family"),
        ("meshtrain.models.config", "meshtrain.models.moe.MoeConfig"),
        ("meshtrain.models.config", "meshtrain.models.mla.MlaConfig"),
        ("meshtrain.models.config", "meshtrain.models.mtp.MtpConfig"),
        ("meshtrain.train.config", "meshtrain.models.fp8.RECIPES"),
        ("meshtrain.train.config", "meshtrain.models.policy.ACTIVATION_MODES"),
        ("meshtrain.train.config", "meshtrain.models.policy.PRECISIONS"),
    ], TORCH_FREE_CONFIG),
    **dict.fromkeys([
        ("meshtrain.layout.mesh", "torch"),
        ("meshtrain.layout.mesh", "torch.distributed.device_mesh.DeviceMesh"),
        ("meshtrain.layout.mesh", "torch.distributed.device_mesh.init_device_mesh"),
        ("meshtrain.layout.mesh", "torch.distributed.tensor.DTensor"),
    ], TORCH_FREE_MESH),
    **dict.fromkeys([
        ("meshtrain.data.tokenizer", "tokenizers.Tokenizer"),
        ("meshtrain.plot", "matplotlib"),
        ("meshtrain.plot", "matplotlib.backends.backend_agg.FigureCanvasAgg"),
        ("meshtrain.plot", "matplotlib.figure.Figure"),
        ("meshtrain.plot", "matplotlib.lines.Line2D"),
        ("meshtrain.plot", "matplotlib.ticker.EngFormatter"),
        ("meshtrain.plot", "matplotlib.ticker.MaxNLocator"),
        ("meshtrain.run.report", "torch.utils.tensorboard.SummaryWriter"),
    ], OPTIONAL),
    **dict.fromkeys([
        ("meshtrain.parallel.overlap", "torch._dynamo.backends.debugging.aot_eager"),
        ("meshtrain.parallel.overlap", "torch._dynamo.backends.debugging.boxed_nop"),
        ("meshtrain.parallel.overlap", "torch._inductor.custom_graph_pass.CustomGraphPass"),
        ("meshtrain.parallel.overlap", "torch._inductor.custom_graph_pass.get_hash_for_files"),
        ("meshtrain.train.split_backward", "torch._dynamo.backends.debugging.aot_eager"),
        ("meshtrain.train.split_backward", "torch._dynamo.backends.debugging.boxed_nop"),
        ("meshtrain.train.split_backward", "torch._inductor.compile_fx.compile_fx"),
        ("meshtrain.train.split_backward", "torch._inductor.compile_fx.compile_fx_inner"),
    ], COMPILER),
    **dict.fromkeys([
        ("meshtrain.layout.plan", "meshtrain.layout.plan_table.plan_table"),
        ("meshtrain.layout.plan", "meshtrain.layout.plan_table.render"),
        ("meshtrain.run.report", "rich.console.Console"),
        ("meshtrain.run.report", "rich.live.Live"),
        ("meshtrain.run.report", "rich.progress_bar.ProgressBar"),
        ("meshtrain.run.report", "rich.table.Table"),
    ], CONSOLE),
    **dict.fromkeys([
        ("meshtrain.run.launch", "torch.distributed.elastic.multiprocessing.api.SignalException"),
        ("meshtrain.run.launch", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"),
        ("meshtrain.run.launch", "torch.distributed.launcher.api.LaunchConfig"),
        ("meshtrain.run.launch", "torch.distributed.launcher.api.elastic_launch"),
    ], LAUNCHER),
    **dict.fromkeys([
        ("meshtrain.interop.load", "torch._prims_common.make_contiguous_strides_for"),
        ("meshtrain.interop.load", "torch.distributed.tensor.placement_types._StridedShard"),
        ("meshtrain.parallel.bound_params", "torch.utils._python_dispatch._get_current_dispatch_mode"),
        ("meshtrain.parallel.bound_params", "torch.utils._python_dispatch._pop_mode_temporarily"),
        ("meshtrain.parallel.bound_params", "torch.utils.checkpoint._CachedTorchDispatchMode"),
        ("meshtrain.parallel.bound_params", "torch.utils.checkpoint._CachingTorchDispatchMode"),
        ("meshtrain.parallel.cp_attention", "torch.distributed.distributed_c10d._resolve_process_group"),
        ("meshtrain.train.optim", "torch.distributed._functional_collectives"),
        ("meshtrain.train.peak_memory", "torch._C._profiler._EventType"),
    ], PRIVATE_TORCH),
    ("meshtrain.config.schema", "yaml"): INDIRECT,
}


def long_modules(root: Path = PACKAGE) -> dict[str, int]:
    """Module -> its line count, for each over MAX_MODULE_LINES."""
    counts = {name: len(path.read_text().splitlines()) for name, path in modules(root).items()}
    return {name: n for name, n in counts.items() if n > MAX_MODULE_LINES}


def long_functions(root: Path = PACKAGE) -> dict[str, int]:
    """module:function -> its line count, for each over MAX_FUNCTION_LINES."""
    found = {}
    for name, path in modules(root).items():
        for function, node in functions(ast.parse(path.read_text())):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                found[f"{name}:{function}"] = n
    return found


def local_imports(root: Path = PACKAGE) -> dict[tuple[str, str], set[str]]:
    """(module, imported name) -> the functions importing it, outside the CLI's modules."""
    found: dict[tuple[str, str], set[str]] = {}
    for name, path in modules(root).items():
        if name in CLI_MODULES:
            continue
        for function, node in function_local_imports(ast.parse(path.read_text())):
            for imported in imported_names(node, name, path.name == "__init__.py"):
                found.setdefault((name, imported), set()).add(function)
    return found


def test_no_module_is_over_400_lines():
    assert not long_modules(), f"modules over {MAX_MODULE_LINES} lines (split each by its jobs):\n" + "\n".join(
        f"  {m}: {n}" for m, n in sorted(long_modules().items()))


def test_no_function_is_over_100_lines():
    assert not long_functions(), f"functions over {MAX_FUNCTION_LINES} lines (split each by its jobs):\n" + \
        "\n".join(f"  {f}: {n}" for f, n in sorted(long_functions().items()))


def test_function_local_imports_are_the_listed_ones():
    found = local_imports()
    new = {k: sorted(v) for k, v in found.items() if k not in FUNCTION_LOCAL_IMPORTS}
    assert not new, "imports inside functions (move each to the top of its module, or list it with its reason " \
        "in FUNCTION_LOCAL_IMPORTS):\n" + "\n".join(f"  {m}: {i} in {', '.join(f)}" for (m, i), f in sorted(new.items()))
    gone = sorted(set(FUNCTION_LOCAL_IMPORTS) - set(found))
    assert not gone, f"{gone} are no longer imported inside a function: remove them from FUNCTION_LOCAL_IMPORTS"


def test_every_listed_import_has_a_known_reason():
    reasons = {TORCH_FREE_CONFIG, TORCH_FREE_MESH, OPTIONAL, COMPILER, CONSOLE, LAUNCHER, PRIVATE_TORCH, INDIRECT}
    assert set(FUNCTION_LOCAL_IMPORTS.values()) <= reasons


# --- the rules see a violation planted in a copy of the package -----------------------

@pytest.fixture
def copy(tmp_path) -> Path:
    root = tmp_path / "meshtrain"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_a_planted_401_line_module_is_seen(copy):
    (copy / "models" / "long.py").write_text("x = 0\n" * (MAX_MODULE_LINES + 1))
    (copy / "models" / "short.py").write_text("x = 0\n" * MAX_MODULE_LINES)
    assert long_modules(copy).items() - long_modules().items() == {("meshtrain.models.long", 401)}


def test_a_planted_101_line_method_is_seen(copy):
    target = copy / "models" / "spec.py"
    def method(name: str, lines: int) -> str:  # its def line and `lines - 1` statements
        return f"    def {name}(self):\n" + "".join(f"        x{i} = {i}\n" for i in range(lines - 1))

    planted = "\n\nclass _Planted:\n" + method("long", MAX_FUNCTION_LINES + 1) + method("short", MAX_FUNCTION_LINES)
    target.write_text(target.read_text() + planted)
    assert long_functions(copy).items() - long_functions().items() == {
        ("meshtrain.models.spec:_Planted.long", MAX_FUNCTION_LINES + 1)}


@pytest.mark.parametrize("planted, imported", [
    ("def _planted():\n    import json\n", "json"),
    ("def _planted():\n    if True:\n        from .. import data\n", "meshtrain.data"),
    ("def _planted():\n    def inner():\n        from .spec import ParamSpec\n", "meshtrain.models.spec.ParamSpec"),
], ids=["import", "under-an-if", "nested-function"])
def test_a_planted_function_local_import_is_seen(copy, planted, imported):
    target = copy / "models" / "spec.py"
    target.write_text(target.read_text() + "\n\n" + planted)
    new = local_imports(copy).keys() - local_imports().keys()
    assert new == {("meshtrain.models.spec", imported)}


def test_the_clis_imports_are_allowed_by_rule(copy):
    for name in ("cli.py", "cli_errors.py"):
        (copy / name).write_text((copy / name).read_text() + "\n\ndef _planted():\n    import json\n")
    assert local_imports(copy) == local_imports()


def test_a_listed_import_that_is_gone_is_seen(copy):
    """Each listed import removed from a copy (its statement made a `pass`) is seen gone."""
    module, imported = ("meshtrain.plot", "matplotlib.lines.Line2D")
    path = copy / "plot.py"
    lines = path.read_text().splitlines(keepends=True)
    for _, node in function_local_imports(ast.parse("".join(lines))):
        if imported in imported_names(node, module, False):
            indent = lines[node.lineno - 1][:node.col_offset]
            lines[node.lineno - 1:node.end_lineno] = [indent + "pass\n"]
            break
    path.write_text("".join(lines))
    assert set(local_imports()) - set(local_imports(copy)) == {(module, imported)}
