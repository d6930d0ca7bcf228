"""Only engine/core writes engine state, read from the source with `ast` (nothing is imported), as
tests/test_import_graph.py reads the import graph.

The scheduler, the allocator and the step loop keep a request's tokens, its KV blocks and the step count
consistent with each other; a second writer elsewhere (a benchmark's own decode loop, a backend's warm-up) has
to repeat their rules exactly, and the deterministic twin results depend on it doing so. Outside engine/core,
code drives the engine through its API (`LLMEngine.step`, `decode_burst`, `stats`, ...) and reads frozen
records. The same holds for the backend contract: a wrapper delegates method by method (engine/core/backend.py),
never everything at once with `__getattr__`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("engine", "bench")
CORE = ROOT / "engine" / "core"
# A Sequence's state that the scheduler and the step loop keep consistent with the allocator and the step count.
SEQUENCE_STATE = frozenset(
    {
        "output_ids",
        "output_logprobs",
        "prompt_logprobs",
        "token_times",
        "num_computed",
        "block_table",
        "block_hashes",
        "num_cached_blocks",
        "swapped_tokens",
        "first_scheduled_time",
        "first_token_time",
    }
)
LIST_WRITES = frozenset({"append", "extend", "insert", "pop", "clear", "remove", "sort", "reverse"})
ALLOCATOR_WRITES = frozenset({"allocate", "allocate_slots", "free", "cache", "share", "apply"})
ENGINE_COUNTERS = frozenset({"step_id"})


def _is_allocator(node: ast.expr) -> bool:
    """`x.allocator`, or a name that holds one (`alloc`, `allocator`)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "allocator"
    return isinstance(node, ast.Name) and "alloc" in node.id


def _stored(target: ast.expr) -> Iterator[ast.Attribute]:
    """The attributes an assignment target writes: `a.x = `, `a.x[i] = `, and each of a tuple's."""
    if isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from _stored(element)
    elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute):
        yield target.value
    elif isinstance(target, ast.Attribute):
        yield target


def violations(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, what) for every write to engine state in `tree`."""
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for attr in (a for t in targets for a in _stored(t)):
            if attr.attr in SEQUENCE_STATE:
                yield node.lineno, f"stores to a sequence's `{attr.attr}`"
            elif attr.attr in ENGINE_COUNTERS:
                yield node.lineno, f"assigns the engine's `{attr.attr}`"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, owner = node.func.attr, node.func.value
            if method in LIST_WRITES and isinstance(owner, ast.Attribute) and owner.attr in SEQUENCE_STATE:
                yield node.lineno, f"calls `{owner.attr}.{method}`"
            elif method in ALLOCATOR_WRITES and _is_allocator(owner):
                yield node.lineno, f"calls the allocator's `{method}`"


def capability_probes(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, what) for every `__getattr__` that forwards whatever is asked, and every getattr/hasattr that asks
    a backend or a probe whether it has a capability: the contract declares them (engine/core/backend.py)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            yield node.lineno, "forwards attributes with `__getattr__` (delegate explicitly)"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            subject = ast.unparse(node.args[0]) if node.args else ""
            if "backend" in subject or "probe" in subject:
                yield node.lineno, f"asks `{subject}` with {node.func.id} (declare it in the Backend protocol)"


def modules(package: str) -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted((ROOT / package).rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def imports_the_engine(tree: ast.Module) -> bool:
    """Whether a module can hold an engine's objects at all (bench/harness/ talks to a server over HTTP only)."""
    return any(
        isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine.") for node in ast.walk(tree)
    )


def test_the_scan_finds_each_kind_of_write() -> None:
    source = """
seq.output_ids.append(token)
s.token_times += [now]
s.num_computed = pos + 1
seq.block_table[0] = 3
a.output_ids, b.x = [], 1
engine.step_id += done
alloc.allocate_slots(s, 1)
engine.allocator.free(blocks)
class Wrapper:
    def __getattr__(self, name): ...
"""
    assert sorted({line for line, _ in violations(ast.parse(source))}) == list(range(2, 10))
    harmless = "n = len(seq.output_ids)\nrecord.step_id\nout.free()\nsession.free(shared=True)\nids.append(1)\n"
    assert not list(violations(ast.parse(harmless)))
    probes = "getattr(self.backend, 'prepare', None)\nhasattr(self.probe, 'idle_bytes')\ngetattr(args, 'x')\n"
    assert [line for line, _ in capability_probes(ast.parse(source + probes))] == [11, 12, 13]


def test_only_engine_core_writes_engine_state() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for package in SCANNED
        for path, tree in modules(package)
        if CORE not in path.parents and imports_the_engine(tree)
        for line, what in sorted(violations(tree))
    ]
    assert not found, "engine state written outside engine/core (use the engine's API):\n" + "\n".join(found)


def test_the_backend_contract_is_declared_not_probed() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path, tree in modules("engine")
        for line, what in sorted(capability_probes(tree))
    ]
    assert not found, "\n".join(found)
