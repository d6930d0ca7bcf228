"""The shape of the code, read from the source with `ast` (nothing is imported): no import cycle between
modules, dependencies pointing one way (telemetry <- controller <- engine <- bench <- headroom, and inside
engine/ down its layers: docs/architecture.md), and no module or function too long to read at once.

Every import counts, wherever it sits: at the top, inside a function (a lazy import is still a dependency)
or under `if TYPE_CHECKING:` (a cycle there still means the two modules cannot be understood apart), and so
does a module loaded by name (`importlib.import_module("bench.cli")`, or from a list of names): a dependency
that only a string spells is still one. An
import of `a.b.c` is an edge to that module only, not to the packages above it: Python runs their
`__init__` too, but a package that imports its own modules would otherwise form a cycle with each of them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "controller", "telemetry")
GRAPHED = (*PACKAGES, "bench", "headroom")  # the import graph's modules; only PACKAGES are held to the lengths
EXEMPT = ("tests", "bench")  # test and benchmark code may run long: each file is one scenario
OURS = {*GRAPHED, "tests"}
ALLOWED = {  # of ours, by package
    "telemetry": {"telemetry"},
    "controller": {"controller", "telemetry"},
    "engine": {"engine", "controller", "telemetry"},
    "bench": {"bench", "engine", "controller", "telemetry", "tests"},  # tests: the tiny model their fixtures build
}
# engine/ from the bottom up: a module imports only from its own layer and those below. The model knows nothing
# of the engine loop; the core (scheduler, KV, the contracts) nothing of the backends that implement them; the
# server sits on top of the offline engine and its flags.
ENGINE_LAYERS = (
    ("engine.config", "engine.cache_dir", "engine.openmp"),
    ("engine.model",),
    ("engine.core",),
    ("engine.baselines", "engine.frontend"),
    ("engine.backends",),
    ("engine.factory",),
    ("engine.llm",),
    ("engine.cli",),
    ("engine.serving",),
    ("engine",),  # the package itself
)
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for package in GRAPHED for p in sorted((ROOT / package).rglob("*.py"))}


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
    yield from loaded_by_name(tree)


def loaded_by_name(tree: ast.Module) -> Iterator[str]:
    """Modules a call to importlib.import_module (or __import__) loads: its argument where it is a string, and
    where it is not (a name from a list), every string in the module, of which our module names are kept."""
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None))
        in ("import_module", "__import__")
    ]
    literal = [c.args[0].value for c in calls if c.args and isinstance(c.args[0], ast.Constant)]
    yield from (name for name in literal if isinstance(name, str))
    if len(literal) < len(calls):
        yield from (n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))


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


def test_a_module_loaded_by_name_is_an_edge() -> None:
    direct = ast.parse("import importlib\nimportlib.import_module('bench.cli')")
    listed = ast.parse("from importlib import import_module\nNAMES = ('bench.cli',)\nfor n in NAMES: import_module(n)")
    assert list(loaded_by_name(direct)) == ["bench.cli"] and "bench.cli" in set(loaded_by_name(listed))


def engine_layer(module: str) -> int:
    """Where `module` sits in ENGINE_LAYERS (the longest matching prefix); -1 outside them."""
    matches = [
        (len(p), i) for i, layer in enumerate(ENGINE_LAYERS) for p in layer if module == p or module.startswith(p + ".")
    ]
    return max(matches)[1] if matches else -1


def test_inside_engine_every_import_points_down_its_layers() -> None:
    edges, _ = import_graph()
    engine = [m for m in edges if m == "engine" or m.startswith("engine.")]
    assert not [m for m in engine if engine_layer(m) < 0], "engine modules in no layer"
    upward = [f"{a} imports {b}" for a in engine for b in edges[a] if engine_layer(b) > engine_layer(a)]
    assert not upward, "\n".join(upward)


def test_dependencies_point_one_way() -> None:
    """telemetry imports nothing of ours; controller only telemetry, and never torch; engine nothing of bench or
    the console script; bench nothing of the console script."""
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
