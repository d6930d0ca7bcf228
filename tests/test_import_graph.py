"""The shape of the code, read from the source with `ast` (nothing is imported): no import cycle between
modules, dependencies pointing one way (telemetry <- controller <- engine, docs/architecture.md), and no
module or function too long to read at once.

Every import counts, wherever it sits: at the top, inside a function (a lazy import is still a dependency)
or under `if TYPE_CHECKING:` (a cycle there still means the two modules cannot be understood apart). An
import of `a.b.c` is an edge to that module only, not to the packages above it: Python runs their
`__init__` too, but a package that imports its own modules would otherwise form a cycle with each of them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "controller", "telemetry")
EXEMPT = ("tests", "bench")  # test and benchmark code may run long: each file is one scenario
OURS = {*PACKAGES, "bench", "tests"}
ALLOWED = {"telemetry": {"telemetry"}, "controller": {"controller", "telemetry"}}  # of ours, by package
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imported_names(name: str, path: Path, tree: ast.Module) -> Iterator[str]:
    """Every module name `tree` imports, absolute, with `from x import y` as `x.y` (a module or not)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> our modules it imports, module -> the top-level names of everything it imports)."""
    modules = our_modules()
    edges: dict[str, set[str]] = {}
    tops: dict[str, set[str]] = {}
    for name, path in modules.items():
        names = set(imported_names(name, path, ast.parse(path.read_text(), str(path))))
        edges[name] = {n for n in names if n in modules and n != name}
        tops[name] = {n.split(".")[0] for n in names if n}
    return edges, tops


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules() -> None:
    edges, _ = import_graph()
    found = cycles(edges)
    described = [
        " <-> ".join(c) + " (" + "; ".join(f"{v} -> {sorted(edges[v] & set(c))}" for v in c) + ")" for c in found
    ]
    assert not found, "import cycles:\n" + "\n".join(described)


def test_dependencies_point_one_way() -> None:
    """telemetry imports nothing of ours; controller only telemetry, and never torch."""
    _, tops = import_graph()
    wrong = []
    for name, imported in sorted(tops.items()):
        package = name.split(".")[0]
        if package in ALLOWED:
            wrong += [f"{name} imports {top}" for top in sorted(imported & OURS - ALLOWED[package])]
    wrong += [
        f"{name} imports torch"
        for name, imported in tops.items()
        if name.startswith("controller") and "torch" in imported
    ]
    assert not wrong, "\n".join(wrong)


def functions(tree: ast.Module, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualified name, lines from its `def` to its last line) of every function and method, nested too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            qualified = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield qualified, node.end_lineno - node.lineno + 1
            yield from functions(node, qualified + ".")


def test_no_module_or_function_is_too_long() -> None:
    sources = [p for p in sorted(ROOT.rglob("*.py")) if _checked(p)]
    long_modules, long_functions = [], []
    for path in sources:
        text = path.read_text()
        where = path.relative_to(ROOT)
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            long_modules.append(f"{where} ({lines} lines)")
        long_functions += [
            f"{where}:{name} ({n} lines)" for name, n in functions(ast.parse(text, str(path))) if n > MAX_FUNCTION_LINES
        ]
    assert not long_modules + long_functions, (
        f"modules over {MAX_MODULE_LINES} lines: {long_modules}\nfunctions over {MAX_FUNCTION_LINES} lines: "
        f"{long_functions}"
    )


def _checked(path: Path) -> bool:
    """Ours and not exempt: no virtual environment, build output or hidden directory."""
    parts = path.relative_to(ROOT).parts
    return parts[0] not in EXEMPT and not any(p.startswith(".") or p.endswith(".egg-info") for p in parts)
