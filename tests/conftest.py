"""Shared fixtures: the real default model, resolved once per session (downloaded into the user cache), and the
reference models built from it, loaded once per session and shared by every module that compares with them.

Nothing is loaded or built at session start: the fixtures load on first use, and the fused kernels are built
before the first `mp` test; a test that starts an engine process without the `mp` marker fails."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest


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


@pytest.fixture(scope="session")
def hf_reference(model_path: str) -> tuple[Any, Any]:
    """HF transformers' tokenizer and fp32 `LlamaForCausalLM` loaded from the same GGUF file (read-only, shared:
    the parity tests use both, the embedding tests its `.model`, the same weights as `AutoModel` would load)."""
    transformers = pytest.importorskip("transformers")
    import torch

    path = pathlib.Path(model_path)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return tok, ref.eval()


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
