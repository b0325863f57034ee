"""Shared fixtures: the real default model, resolved once per session (downloaded into the user cache), and the
reference models built from it, loaded once per session and shared by every module that compares with them.

Nothing is loaded or built at session start: the fixtures load on first use, and the fused kernels are built
before the first `mp` test; a test that starts an engine process without the `mp` marker fails.

Under pytest-xdist (`make test` runs `-n 2 --dist loadfile`), each test file runs whole on one worker (its module
engines and fixtures are built once), the Ray files (`_ray` in the file name) share one worker (one local Ray
instance at a time; `FileScheduling`), and the controller builds the kernels and fetches the default model before
the workers start, so two workers never build into the same directory or download the same file at once. Each
worker's engines get the worker's share of the cores (`OMP_NUM_THREADS`: one thread each with two workers on two
cores; a test that needs more threads sets them itself)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
from typing import Any

import pytest


def _threads_per_xdist_worker() -> int | None:
    """Torch threads for this pytest-xdist worker: the machine's CPUs split between the workers, or None outside
    xdist (or when OMP_NUM_THREADS is already set)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // max(1, int(workers)))


# Under xdist, each worker's engines (threads, engine processes and `mp` workers inherit the environment) get their
# share of the cores: two workers with two-thread engines on two cores oversubscribe them, and each engine's parallel
# regions then wait on a descheduled thread. Measured on a 2-core host at load 13: a real-model engine test took
# 74.7 s wall / 28.5 s CPU at 2 threads against 21.3 s / 17.7 s at 1. Set before anything imports torch.
_WORKER_THREADS = _threads_per_xdist_worker()
if _WORKER_THREADS is not None:
    os.environ["OMP_NUM_THREADS"] = str(_WORKER_THREADS)


@pytest.fixture(scope="session")
def model_path() -> str:
    """Local path of the default SmolLM2-135M-Instruct GGUF (fetched once into ~/.cache/asyncllm)."""
    from asyncllm.config import DEFAULT_MODEL
    from asyncllm.model.loading.resolve import resolve_model_path

    return str(resolve_model_path(DEFAULT_MODEL))


@pytest.fixture(scope="session")
def reference_model(model_path: str) -> Any:
    """Our dense fp32 SmolLM2 (`load_model`, TP=1, no engine): greedy margins and logits for many modules.

    Shared by the whole session, so read-only: a test that changes weights works on a `copy.deepcopy` of it.
    """
    from asyncllm.config import ModelConfig
    from asyncllm.model.loading.loader import load_model

    return load_model(ModelConfig(model=model_path, model_path=model_path))


def load_hf_reference(gguf_path: str) -> tuple[Any, Any]:
    """HF transformers' tokenizer and fp32 causal LM read from a GGUF file by transformers' own GGUF loader (our
    reference: none of our loading code runs). Transformers parses the file's header once for the tokenizer, once for
    the config and once for the weights (`gguf.GGUFReader`, in pure Python: 22 s each for Gemma 3's 262,144-token
    vocabulary on a 2-core AMD EPYC); here the three share one parse, read-only, dropped when both are loaded."""
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    import torch

    path = pathlib.Path(gguf_path)
    parse = gguf.GGUFReader
    parsed: dict[tuple[str, str], Any] = {}

    def parse_once(file: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.fspath(file), mode)
        if key not in parsed:
            parsed[key] = parse(file, mode)
        return parsed[key]

    gguf.GGUFReader = parse_once
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    finally:
        gguf.GGUFReader = parse
    return tok, ref.eval()


@pytest.fixture(scope="session")
def hf_reference(model_path: str) -> tuple[Any, Any]:
    """HF transformers' tokenizer and fp32 `LlamaForCausalLM` loaded from the same GGUF file (read-only, shared:
    the parity tests use both, the embedding tests its `.model`, the same weights as `AutoModel` would load)."""
    return load_hf_reference(model_path)


RAY_SCOPE = "ray"  # the xdist work unit of every Ray test file: one local Ray instance at a time


def ray_file(path: str) -> bool:
    """Whether the test file at `path` runs Ray tests: `_ray` ends its name or comes before a `_` in it
    (`test_executors_ray.py`, `test_executors_ray_local.py`); only such files may hold tests marked `ray`."""
    stem = pathlib.PurePath(path).stem
    return stem.endswith("_ray") or "_ray_" in stem


if importlib.util.find_spec("xdist") is not None:
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        """pytest-xdist's `--dist loadfile` (a test file runs whole on one worker, so its module engines are built
        once), with the Ray files (`ray_file`) as one work unit.

        Why not `--dist loadgroup` with an `xdist_group` mark per file: with pytest 9.2 and pytest-xdist 3.8 the
        marks are silently ignored and every file's tests are spread over both workers, each building the module's
        engines (pytest-xdist issue #1386: loadgroup's node-id suffix no longer reaches the scheduler). This scope
        is computed on the controller from the node id alone."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return RAY_SCOPE if ray_file(path) else path

    class FileSchedulingPlugin:
        """Registered only where pytest-xdist runs (`pytest_configure`): under `-p no:xdist` pytest would refuse
        this hook as unknown."""

        @pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which answers for every `--dist`
        def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> FileScheduling | None:
            """`--dist loadfile` gets `FileScheduling`; any other `--dist` keeps pytest-xdist's own scheduler."""
            return FileScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


def _xdist_workers(config: pytest.Config) -> int:
    """Worker processes pytest-xdist runs (0 without `-n`, or without pytest-xdist)."""
    return int(getattr(config.option, "numprocesses", 0) or 0)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """In an xdist controller (before it starts the workers): build the fused kernels and fetch the default model
    once, instead of in two workers at once (the kernel build's lock and the download are per process)."""
    config = session.config
    if _xdist_workers(config) == 0 or hasattr(config, "workerinput"):
        return
    from asyncllm.config import DEFAULT_MODEL
    from asyncllm.model.kernels.row_kernels import load_kernels
    from asyncllm.model.loading.resolve import resolve_model_path

    load_kernels()
    resolve_model_path(DEFAULT_MODEL)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a test marked `ray` outside a Ray file (`ray_file`): xdist would then run it beside the Ray files'
    worker, with a second local Ray instance at once.

    Raises:
        pytest.UsageError: naming the misplaced tests.
    """
    misplaced = [i.nodeid for i in items if i.get_closest_marker("ray") and not ray_file(i.nodeid.split("::")[0])]
    if misplaced:
        raise pytest.UsageError(f"tests marked `ray` outside a file with `_ray` in its name: {misplaced[:5]}")


_CHILDREN = {"started": 0}  # engine and worker processes asyncllm started in this pytest process
_CHILDREN_BEFORE = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    """Count the engine and `mp` worker processes asyncllm starts (every one is a `ChildProcess`), so a test that
    starts one without the `mp` marker fails (`pytest_runtest_teardown`): `-m "not mp"` then truly starts none."""
    from asyncllm.utils.process import ChildProcess

    started = ChildProcess.__init__

    def counted(self: ChildProcess, *args: Any, **kwargs: Any) -> None:
        _CHILDREN["started"] += 1
        started(self, *args, **kwargs)

    ChildProcess.__init__ = counted  # type: ignore[method-assign]
    if config.pluginmanager.has_plugin("xdist"):
        config.pluginmanager.register(FileSchedulingPlugin(), "asyncllm-file-scheduling")
    if _WORKER_THREADS is not None:
        import torch

        torch.set_num_threads(_WORKER_THREADS)  # in case a plugin imported torch before OMP_NUM_THREADS was set


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a test that starts engine processes (`mp`): build the fused kernels (`model/kernels/row_kernels.py`, ~20 s
    once per machine) in the pytest process, so no engine process that a test stops mid-start holds the build
    lock. Only there: a session of unit tests (`make test-fast`) builds nothing at its start."""
    item.stash[_CHILDREN_BEFORE] = _CHILDREN["started"]
    if item.get_closest_marker("mp") is not None:
        from asyncllm.model.kernels.row_kernels import load_kernels

        load_kernels()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """After the test's fixtures are torn down: fail a test that started an engine or worker process (counting its
    setup, where module fixtures start engines) without the `mp` marker."""
    result = yield
    started = _CHILDREN["started"] - item.stash.get(_CHILDREN_BEFORE, _CHILDREN["started"])
    if started and item.get_closest_marker("mp") is None:
        pytest.fail(
            f"{item.nodeid} started {started} engine/worker process(es) but is not marked `mp` (pyproject markers); "
            'mark it, or its process parameter: pytest.param("process", marks=pytest.mark.mp)'
        )
    return result
