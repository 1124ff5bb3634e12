"""The package's modules import one another in one direction: no cycle among pdpfast's modules.

Reads every module's source (no import is executed), collects its imports of pdpfast modules —
module-level and inside functions alike, relative ones resolved — and looks for a cycle in that
graph. A lazy import inside a function still counts: it hides a cycle from Python's import
machinery, not from a reader. Lazy imports of optional dependencies (triton, transformers, flwr)
are outside the package and do not matter here.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pdpfast"

# Modules whose cycles are known and being removed elsewhere; a cycle is reported unless one of its
# modules is exempt. Empty: the whole package is checked (pdpfast.accounting included).
EXEMPT_PREFIXES: set[str] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    """{dotted name: source path} of every module of pdpfast (``kernels/`` is installed as
    ``pdpfast.kernels`` and only imports from pdpfast, so it cannot close a cycle inside it)."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The pdpfast modules that module ``name`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub when there is one, else a name of pkg
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:   # `import pdpfast.nn.linear.x` → the module it names
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    known = set(modules)
    return {name: imported_modules(name, path, known) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def exempt(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in EXEMPT_PREFIXES)


def test_the_graph_sees_relative_and_function_level_imports():
    graph = import_graph()
    assert "pdpfast.loop" in graph["pdpfast.train"]            # from .loop import ... (module level)
    assert "pdpfast.pdp_sgd" in graph["pdpfast.train"]         # from .pdp_sgd import PDPSGD (in a function)
    assert "pdpfast.engine" in graph["pdpfast.fl.client"]      # from ..engine import ... (in a function)
    assert "pdpfast.nn.convert" in graph["pdpfast.engine"]     # from .nn.convert import ...
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_pdpfast_modules():
    graph = import_graph()
    # exempt modules drop out of the graph: a cycle through them is theirs to remove
    graph = {m: {t for t in targets if not exempt(t)} for m, targets in graph.items() if not exempt(m)}
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (each line: modules that import one another, directly or not):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_leaf_modules_import_nothing_of_the_package():
    graph = import_graph()
    for leaf in ("pdpfast._checks", "pdpfast._private", "pdpfast.accounting.sgm", "pdpfast.accounting.roots",
                 "pdpfast.accounting.calibration.problem"):
        assert graph[leaf] == set(), f"{leaf} imports {sorted(graph[leaf])}"


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or not."""
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_epsilon_math_sits_below_calibration():
    """ε functions and their inversions are what calibration solves with: none of them reaches the
    calibration package, directly or not (``pld`` used to hold the PLD methods and import the registry)."""
    graph = import_graph()
    calibration = "pdpfast.accounting.calibration"
    for module in ("sgm", "roots", "_grid", "orders", "rdp", "pld"):
        name = f"pdpfast.accounting.{module}"
        above = sorted(m for m in reachable(graph, name) if m == calibration or m.startswith(calibration + "."))
        assert not above, f"{name} imports {above}"
