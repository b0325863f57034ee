"""The one engine factory of the integration tests, and the helpers every file shares.

`make_llm(**overrides)` builds a real `AsyncLLM` from `ENGINE_DEFAULTS` (the default SmolLM2 model, 128 KV blocks)
with `EngineArgs` overrides, and shuts every engine it made down at the test's end, passed or failed. `llm` is
the engine a module's tests share, one per mode ("thread": the engine core in a background thread; "process":
its own process), built by the same factory once per module with the module's `llm_overrides`; a module that
runs one mode only overrides `mode`.

Async tests are `async def` tests run by pytest-asyncio (the project's plugin, auto mode). A test that must also
run on trio takes `backend` ("asyncio" or "trio") and runs a plain `async def` body with `run(backend, body, ...)`
(`anyio.run`): pytest-asyncio would claim every `async def` test for asyncio, so the backend is chosen here. One
`AsyncLLM` serves every loop of a module in turn (it rebinds when a loop has ended), which is itself part of the
contract under test.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import anyio
import pytest

from asyncllm import AsyncLLM, EngineArgs, RequestOutput, RequestOutputKind, SamplingParams
from asyncllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from asyncllm.engine.client import EngineCoreClient
from asyncllm.messages.engine import SchedulerStats

MODES = ["thread", pytest.param("process", marks=pytest.mark.mp)]  # a process engine: `mp` (pyproject)
BACKENDS = ["asyncio", "trio"]
FAKE_CONFIG = EngineConfig(ModelConfig("fake", "fake"), CacheConfig(), SchedulerConfig(), ParallelConfig())
HELPERS = "tests.integration.engine_helpers"
# What `make_llm` and `llm` build unless overridden. float32 weights (`quantization=None`), not the default "auto"
# (the file's own Q4_1 blocks for the default model): the tests compare with float32 references (HF, `reference_model`).
ENGINE_DEFAULTS: dict[str, Any] = {"num_kv_blocks": 128, "quantization": None}


def greedy(max_tokens: int, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, **kw: Any) -> SamplingParams:
    """Greedy sampling of `max_tokens` tokens with the given output kind."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind=kind, **kw)


async def collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    """Every output of a stream, in order."""
    return [out async for out in stream]


async def wait_until_idle(llm: AsyncLLM, within: float = 30.0) -> SchedulerStats:
    """Wait until the engine runs nothing and every KV block is free (cached blocks no one holds count as free);
    returns the stats then. Fails after `within` seconds (generous: a loaded machine may lag by seconds)."""
    deadline = time.monotonic() + within
    while True:
        stats = await llm.get_scheduler_stats()
        idle = stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
        if idle and stats.num_free_blocks == stats.num_total_blocks:
            return stats
        assert time.monotonic() < deadline, f"engine not idle after {within} s: {stats}"
        await anyio.sleep(0.02)


def run(backend: str, body: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Run `body(*args)` in a fresh event loop of `backend`."""
    return anyio.run(functools.partial(body, *args), backend=backend)


def fake_llm(tokenizer: Any, mode: str, factory: str = "make_fake_core") -> AsyncLLM:
    """An `AsyncLLM` on a scripted core (no model) in `mode`, over the real client and sockets."""
    client = EngineCoreClient(FAKE_CONFIG, in_thread=mode == "thread", core_factory=f"{HELPERS}:{factory}")
    return AsyncLLM(FAKE_CONFIG, tokenizer, client)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The event loop a test body runs on."""
    return str(request.param)


@pytest.fixture(scope="module", params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """Where the engine core runs."""
    return str(request.param)


class EngineFactory:
    """Builds real engines from `ENGINE_DEFAULTS` plus overrides and shuts down every one it built (`close`).

    Args:
        model_path: the default model (`model_path` fixture); an override `model=` replaces it.
    """

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.engines: list[AsyncLLM] = []

    def __call__(self, **overrides: Any) -> AsyncLLM:
        """A started `AsyncLLM` of `EngineArgs(model=model_path, **ENGINE_DEFAULTS, **overrides)` (blocks for the
        start-up, seconds). Raises what `AsyncLLM.from_engine_args` raises (nothing is then kept)."""
        args = EngineArgs(**{"model": self.model_path, **ENGINE_DEFAULTS, **overrides})
        engine = AsyncLLM.from_engine_args(args)
        self.engines.append(engine)
        return engine

    def close(self) -> None:
        """Shut down every engine built here, newest first (synchronously: called outside any event loop)."""
        with contextlib.ExitStack() as stack:  # every engine stops even when an earlier shutdown raises
            for engine in self.engines:
                stack.callback(engine.shutdown)
        self.engines.clear()


@pytest.fixture
def make_llm(model_path: str) -> Iterator[EngineFactory]:
    """`make_llm(**overrides)`: a real engine for this test (`EngineFactory`), shut down at its end."""
    factory = EngineFactory(model_path)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def llm_overrides() -> dict[str, Any]:
    """`EngineArgs` overrides of a module's shared `llm` (a module overrides this fixture); none by default."""
    return {}


@pytest.fixture(scope="module")
def llm(mode: str, model_path: str, llm_overrides: dict[str, Any]) -> Iterator[AsyncLLM]:
    """A real SmolLM2 engine in `mode` (`ENGINE_DEFAULTS` with the module's `llm_overrides`), shared by a
    module's tests."""
    factory = EngineFactory(model_path)
    yield factory(engine_process=mode == "process", **llm_overrides)
    factory.close()


@pytest.fixture(scope="session")
def uni_ids(model_path: str) -> list[list[int]]:
    """Greedy token ids of the executor tests' prompts from a `uni` engine (thread mode, TP=1): the reference
    the `mp` and `ray` executor tests compare with, computed once per session."""
    from tests.integration.executor_helpers import PROMPTS, engine_args, greedy_ids

    async def body() -> list[list[int]]:
        async with AsyncLLM.from_engine_args(engine_args(model_path, engine_process=False)) as llm:
            return await greedy_ids(llm, PROMPTS)

    return anyio.run(body)


@pytest.fixture(scope="session")
def tokenizer(model_path: str) -> Any:
    """The real SmolLM2 tokenizer (no engine)."""
    from asyncllm.model.loading.tokenizer import Tokenizer

    return Tokenizer.load(model_path)


@pytest.fixture(scope="session")
def gemma_path() -> str:
    """Local path of Gemma 3 270M's GGUF (`gemma-3-270m`, fetched once into ~/.cache/asyncllm)."""
    from asyncllm.model.loading.resolve import resolve_model_path

    return str(resolve_model_path("gemma-3-270m"))


@pytest.fixture(scope="session")
def gemma_model(gemma_path: str) -> Any:
    """Our dense fp32 Gemma 3 270M (`load_model`, no engine), loaded once per session for the modules that compare
    with it (a load is seconds of dequantizing); read-only."""
    from asyncllm.model.loading.loader import load_model

    return load_model(ModelConfig(model=gemma_path, model_path=gemma_path))
