"""The package's layout: layers import only downward, no import cycle, no two module names a letter apart."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# lower rank = lower layer; a module may import its own layer or lower ones only
RANKS = {"kernels": 0, "core": 0, "models": 1, "runtime": 2, "training": 3, "eval": 4, "cli": 5}


def package_modules() -> dict[str, Path]:
    """Dotted name -> file of every module of ``curkv_train`` (``kernels/`` ships as ``curkv_train.kernels``)."""
    modules = {}
    for folder, prefix in ((ROOT / "curkv_train", "curkv_train"), (ROOT / "kernels", "curkv_train.kernels")):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([prefix, *parts])] = path
    return modules


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere (deferred imports in functions too), ``TYPE_CHECKING`` aside."""
    found = set()
    skipped = {id(child) for node in ast.walk(ast.parse(path.read_text())) if _type_checking_only(node)
               for child in ast.walk(node)}
    for node in ast.walk(ast.parse(path.read_text())):
        if id(node) in skipped:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found |= {name for name in names if name in known}
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANKS else None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_modules(path, set(modules)) - {name} for name, path in modules.items()}


def test_layers_import_only_downward(graph):
    upward = [f"{module} -> {target}" for module, targets in graph.items() for target in targets
              if layer_of(module) and layer_of(target) and RANKS[layer_of(target)] > RANKS[layer_of(module)]]
    assert not upward, "imports from a layer above: " + "; ".join(sorted(upward))


def test_runtime_never_imports_training(graph):
    assert not [t for m, ts in graph.items() if layer_of(m) == "runtime" for t in ts if layer_of(t) == "training"]


def _package_of(module: str, graph: dict[str, set[str]]) -> bool:
    return any(other.startswith(module + ".") for other in graph)


def test_no_import_cycle(graph):
    # a package's __init__ re-exporting its own modules is not a cycle: edges into a package are left out
    edges = {m: {t for t in ts if not _package_of(t, graph)} for m, ts in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles: " + "; ".join(cycles)


def _one_edit_apart(a: str, b: str) -> bool:
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b)) == 1
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def test_no_two_module_names_a_letter_apart():
    stems = sorted({path.stem for path in package_modules().values() if path.stem != "__init__"})
    close = [f"{a}/{b}" for a, b in itertools.combinations(stems, 2) if _one_edit_apart(a, b)]
    assert not close, "module names one letter apart: " + ", ".join(close)


def test_the_checker_sees_an_upward_import(tmp_path):
    """Negative control: a runtime module importing training is found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from curkv_train.training.system import CurKVModule\n")
    found = imported_modules(module, {"curkv_train.training.system"})
    assert found == {"curkv_train.training.system"}
    assert layer_of("curkv_train.training.system") == "training"
