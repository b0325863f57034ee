"""The package's import graph, read with the standard-library `ast` (no module is imported).

`messages/` is the floor: it imports nothing else from asyncllm except the leaf value type modules
`asyncllm.sampling_params` (which imports only `asyncllm.errors` and the structured-outputs params),
`asyncllm.pooling_params` and `asyncllm.lora.request` (which import only `asyncllm.errors`). And no two modules
import each other, at module level or inside functions.
"""

from __future__ import annotations

import ast
import itertools
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
LEAVES_MESSAGES_MAY_USE = {
    "asyncllm.sampling_params": {"asyncllm.errors", "asyncllm.structured_outputs.params"},
    "asyncllm.lora.request": {"asyncllm.errors"},
    "asyncllm.structured_outputs.params": {"asyncllm.errors"},
    "asyncllm.pooling_params": {"asyncllm.errors"},
    "asyncllm.errors": set(),
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path, known: set[str]) -> set[str]:
    """asyncllm modules `path` imports anywhere in its body (`from x import y` counts x, and x.y if a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in known}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in (SRC / "asyncllm").rglob("*.py")}
    known = set(paths)
    return {name: imported_modules(path, known) - {name} for name, path in paths.items()}


def test_graph_sees_the_package():
    graph = import_graph()
    assert "asyncllm.messages.engine" in graph
    assert "asyncllm.messages.engine" in graph["asyncllm.engine.core"]


def test_messages_import_nothing_else_from_the_package():
    graph = import_graph()
    for name, imports in graph.items():
        if not name.startswith("asyncllm.messages"):
            continue
        outside = {i for i in imports if not i.startswith("asyncllm.messages") and i != "asyncllm"}
        assert outside <= set(LEAVES_MESSAGES_MAY_USE), f"{name} imports {sorted(outside)}"
    for leaf, allowed in LEAVES_MESSAGES_MAY_USE.items():
        assert graph[leaf] - {"asyncllm"} <= allowed, f"{leaf} is no longer a leaf: {sorted(graph[leaf])}"


def test_no_two_modules_import_each_other():
    graph = import_graph()
    cycles = [(a, b) for a, b in itertools.combinations(sorted(graph), 2) if b in graph[a] and a in graph[b]]
    assert cycles == []
