"""The floors of the layout (docs/architecture.md): imports only go down, and no two files import
each other, directly or around a loop.

    pallas_kernels  <  model  <  train  <  rl

Every module's AST is read, so function-local imports count, and so do module names given as
strings: `importlib.import_module("...")` arguments and the "module:function" entries of the
implementation tables (`model.ops.tables`). A failure names the offending file and line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FLOORS = {"pallas_kernels": 0, "model": 1, "train": 2, "rl": 3}
TABLE_ENTRY = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+):[A-Za-z_]\w*$")
MAX_LINES = 400
KERNELS = {"pallas_kernels/flash_attention.py", "pallas_kernels/grouped_matmul.py"}


def package_files() -> dict[str, Path]:
    """Module name -> file, for every module of the four packages."""
    files = {}
    for package in FLOORS:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module a dotted name refers to: itself, or its longest module prefix (for
    `from package import submodule_or_attribute` and "module.attribute" strings)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported stepjax module, line) for every import of `path`, at any depth."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from a.b import c` imports a.b, and a.b.c when c is a submodule
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                node.func, "id", None)) == "import_module" and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            entry = TABLE_ENTRY.match(node.value)
            if entry and entry.group(1).split(".")[0] in FLOORS:
                names = [entry.group(1)]
        for name in names:
            target = resolve(name, modules)
            if target is not None and target != module:
                found.append((target, node.lineno))
    return found


def import_graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, int]]]]:
    modules = package_files()
    graph = {}
    for module, path in modules.items():
        edges = {}
        for target, line in imports_of(module, path, modules):
            edges.setdefault(target, line)
        graph[module] = sorted(edges.items())
    return modules, graph


def floor(module: str) -> int:
    return FLOORS[module.split(".")[0]]


def test_imports_only_go_down_the_floors():
    modules, graph = import_graph()
    upward = [f"{modules[m].relative_to(REPO)}:{line} imports {target}"
              for m, edges in graph.items() for target, line in edges
              if floor(target) > floor(m)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycle_between_files():
    """A package's `__init__` re-exporting its own submodules is not a loop between files."""
    modules, graph = import_graph()

    def edges(module):
        return [t for t, _ in graph[module]
                if not (modules[t].name == "__init__.py" and module.startswith(t + "."))]

    state, stack, cycles = {}, [], []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in edges(module):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_every_kind_of_import(tmp_path):
    """The walker finds function-local imports, relative imports, import_module strings and
    table entries (so the two tests above cannot pass by not looking)."""
    source = tmp_path / "probe.py"
    source.write_text(
        "import importlib\n"
        "def f():\n"
        "    from rl import loop\n"
        "    importlib.import_module('train.step')\n"
        "TABLE = {'x': 'pallas_kernels.flash_attention:flash_attention_core'}\n"
        "from . import lm\n")
    modules = package_files()
    found = {t for t, _ in imports_of("model.probe", source, modules)}
    assert {"rl.loop", "train.step", "pallas_kernels.flash_attention", "model.lm"} <= found


@pytest.mark.parametrize("package", [*sorted(FLOORS), "benchmarks", "tests"])
def test_source_files_stay_short(package):
    """Small modules, one concept each: no source file over 400 lines except the kernels."""
    long = [f"{p.relative_to(REPO)} ({n} lines)" for p in sorted((REPO / package).rglob("*.py"))
            if str(p.relative_to(REPO)) not in KERNELS
            and (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, "over 400 lines: " + ", ".join(long)


def test_code_cites_only_files_inside_the_repository():
    """Comments cite docs/architecture.md or the report, never the team's design notes."""
    outside = [f"{p.relative_to(REPO)}:{i}" for package in (*FLOORS, "benchmarks", "tests")
               for p in sorted((REPO / package).rglob("*.py"))
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if "DESIGN.md" in line and p.name != "test_layout.py"]
    assert not outside, "cites DESIGN.md (outside the repository): " + ", ".join(outside)
