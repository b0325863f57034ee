"""The package's import graph, read with the standard-library `ast` (no module is imported).

Every import counts: at module level, inside functions, and under `TYPE_CHECKING`.
- `messages/` is the floor: it imports nothing else from asyncllm except the leaf value type modules
  `asyncllm.sampling_params` (which imports only `asyncllm.errors` and the structured-outputs params),
  `asyncllm.pooling_params` and `asyncllm.lora.request` (which import only `asyncllm.errors`).
- Every module belongs to one layer of `LAYERS` (lowest first) and imports only modules of its own layer or
  below: each feature's pieces live on the side that runs them (drafting beside the scheduler, verification in the
  worker, stats sums in `metrics/`, grammar state beside the scheduler), so nothing imports upward.
- No cycle of any length.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
LEAVES_MESSAGES_MAY_USE = {
    "asyncllm.sampling_params": {"asyncllm.errors", "asyncllm.structured_outputs.params"},
    "asyncllm.lora.request": {"asyncllm.errors"},
    "asyncllm.structured_outputs.params": {"asyncllm.errors"},
    "asyncllm.pooling_params": {"asyncllm.errors"},
    "asyncllm.errors": set(),
}


# Lowest first. A module's layer is that of its longest matching prefix (a prefix names a module or a package).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "floor: values, wire messages, frozen configs, utilities",
        (
            "asyncllm.errors",
            "asyncllm.sampling_params",
            "asyncllm.pooling_params",
            "asyncllm.engine_config",
            "asyncllm.model.arch",  # the checkpoint's hyper-parameters: a frozen record, no torch
            "asyncllm.lora.request",
            "asyncllm.structured_outputs.params",
            "asyncllm.messages",
            "asyncllm.outputs",
            "asyncllm.inputs",  # vLLM's prompt TypedDicts
            "asyncllm.utils",
            "asyncllm.processing.prompt_embeds",  # the one request check both the frontend and the engine core run
        ),
    ),
    ("metrics: stats records, sums and loggers", ("asyncllm.metrics",)),
    ("model kernels: linear products, their choice, fused row kernels", ("asyncllm.model.kernels",)),
    ("model layers: attention, K/V mirror, rotary", ("asyncllm.model.layers",)),
    (
        "model definitions, adapters, tensor parallelism",
        ("asyncllm.model", "asyncllm.lora", "asyncllm.distributed"),
    ),
    ("model loading: names, checkpoints, tokenizers", ("asyncllm.model.loading",)),
    ("structured outputs: grammar compiler, bitmask", ("asyncllm.structured_outputs",)),
    ("worker: model runner, sampler, verification of drafts", ("asyncllm.worker",)),
    ("executors", ("asyncllm.executors",)),
    ("scheduler: requests, KV blocks, drafting, grammar state", ("asyncllm.sched",)),
    (
        "engine core",
        ("asyncllm.engine.core", "asyncllm.engine.core_proc", "asyncllm.engine.busy_loop", "asyncllm.engine.heartbeat"),
    ),
    ("engine client", ("asyncllm.engine",)),
    (
        "frontend",
        (
            "asyncllm.config",
            "asyncllm.processing",
            "asyncllm.streams",
            "asyncllm.output_handler",
            "asyncllm.submission",
            "asyncllm.starting",
            "asyncllm.stopping",
            "asyncllm.pausing",
            "asyncllm.async_llm",
            "asyncllm.llm",
        ),
    ),
    ("package re-exports", ("asyncllm",)),
    ("entrypoints", ("asyncllm.entrypoints",)),
]
# Upward imports in files other issues change now; each entry fails the test once its import is gone.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
# Known import cycles (each entry fails the test once its cycle is gone, so it is removed with it).
KNOWN_CYCLES: list[list[str]] = []


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path, known: set[str]) -> set[str]:
    """asyncllm modules `path` imports anywhere in its body (`from x import y` counts x.y if it is a module, and x
    if some imported name is not a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & known
            found.update(submodules)
            if len(submodules) < len(node.names):
                found.add(node.module)
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


def layer_of(name: str) -> int:
    """The index in `LAYERS` of the longest prefix matching module `name` (the root package matches only itself).

    Raises:
        KeyError: no layer names the module (every new package must be given one).
    """
    best: tuple[int, int] | None = None  # (prefix length, layer index)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = name == prefix or (prefix != "asyncllm" and name.startswith(prefix + "."))
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    if best is None:
        raise KeyError(f"{name} is in no layer of LAYERS")
    return best[1]


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs whose imported module sits in a higher layer than the importer."""
    return {(name, dep) for name, deps in graph.items() for dep in deps if layer_of(dep) > layer_of(name)}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted: every import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer():
    for name in import_graph():
        layer_of(name)


def test_no_module_imports_from_a_higher_layer():
    upward = upward_imports(import_graph())
    unexpected = sorted(
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})" for a, b in upward - set(KNOWN_UPWARD)
    )
    assert unexpected == []
    stale = sorted(set(KNOWN_UPWARD) - upward)
    assert stale == [], f"fixed: remove from KNOWN_UPWARD: {stale}"


def test_no_import_cycles_of_any_length():
    found = cycles(import_graph())
    assert [cycle for cycle in found if cycle not in KNOWN_CYCLES] == []
    assert [cycle for cycle in KNOWN_CYCLES if cycle not in found] == [], "fixed: remove from KNOWN_CYCLES"


def test_the_checks_catch_what_they_forbid():
    """The checks themselves, on a made-up graph: an upward import, and a three-module cycle."""
    assert upward_imports({"asyncllm.worker.sampler": {"asyncllm.sched.request"}}) == {
        ("asyncllm.worker.sampler", "asyncllm.sched.request")
    }
    assert upward_imports({"asyncllm.sched.request": {"asyncllm.worker.sampler"}}) == set()
    ring = {
        "asyncllm.a": {"asyncllm.b"},
        "asyncllm.b": {"asyncllm.c"},
        "asyncllm.c": {"asyncllm.a"},
        "asyncllm.d": set(),
    }
    assert cycles(ring) == [["asyncllm.a", "asyncllm.b", "asyncllm.c"]]
    assert cycles({"asyncllm.a": {"asyncllm.b"}, "asyncllm.b": set()}) == []
