"""Faults while streams are open: an exception inside the model forward, a frozen (SIGSTOPped) engine process,
and a long step that must not be mistaken for a frozen one. Every open stream ends with an error within 5 s of
the fault, none hangs, and `shutdown()` returns within 10 s.

Elsewhere (not repeated here): a killed engine process (`test_engine_process.py`), a killed mp worker
(`test_executors_mp.py`), a killed Ray actor (`test_executors_ray.py`).
"""

from __future__ import annotations

import os
import signal
import time

import anyio
import pytest

from asyncllm import AsyncLLM, EngineArgs, EngineDeadError, SamplingParams
from asyncllm.engine.client import EngineCoreClient
from tests.integration.conftest import FAKE_CONFIG, HELPERS, MODES, greedy
from tests.integration.custom_executor import FaultyForwardExecutor
from tests.integration.executor_helpers import PROMPTS, pid_alive, wait_gone

FAULT_TO_ERROR_S = 5.0
SHUTDOWN_S = 10.0
HANG_GUARD_S = 120.0  # a stream that never ends fails the test here instead of hanging the suite


async def drain_until_error(stream, raised_at: list[float], errors: list[BaseException]) -> None:
    """Read `stream` to its end; record when (and with what) it raised."""
    try:
        async for _ in stream:
            pass
    except Exception as e:
        errors.append(e)
        raised_at.append(time.monotonic())


async def shut_down_timed(llm: AsyncLLM) -> float:
    started = time.monotonic()
    await llm.shutdown()
    return time.monotonic() - started


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
async def test_exception_in_the_model_forward_fails_every_open_stream(model_path: str, mode: str) -> None:
    executor = "tests.integration.custom_executor:FaultyForwardExecutor"
    args = EngineArgs(
        model=model_path, engine_process=mode == "process", num_kv_blocks=64, distributed_executor_backend=executor
    )

    llm = AsyncLLM.from_engine_args(args)
    last_output_at = [time.monotonic()]
    raised_at: list[float] = []
    errors: list[BaseException] = []
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def watch(prompt: str) -> None:
        try:
            async for _ in llm.generate(prompt, params):
                last_output_at[0] = time.monotonic()
        except Exception as e:
            errors.append(e)
            raised_at.append(time.monotonic())

    try:
        with anyio.fail_after(HANG_GUARD_S):
            async with anyio.create_task_group() as tg:
                for prompt in PROMPTS:
                    tg.start_soon(watch, prompt)
    finally:
        took = await shut_down_timed(llm)
    assert len(errors) == len(PROMPTS), errors
    assert all(isinstance(e, EngineDeadError) for e in errors), errors
    assert all(FaultyForwardExecutor.MESSAGE in str(e) for e in errors), errors
    # the fault happens in the step after the last output: every stream raised within 5 s of it
    assert max(raised_at) - last_output_at[0] < FAULT_TO_ERROR_S
    assert llm.errored
    assert took < SHUTDOWN_S


@pytest.mark.slow
@pytest.mark.mp
def test_a_sigstopped_engine_is_reported_unresponsive(model_path: str) -> None:
    """`engine_timeout=2`: the frozen process sends no heartbeat; open streams fail, shutdown kills it."""
    args = EngineArgs(model=model_path, engine_process=True, num_kv_blocks=64, engine_timeout=2.0)

    async def body() -> tuple[int, str]:
        llm = AsyncLLM.from_engine_args(args)
        client = llm._client
        assert isinstance(client, EngineCoreClient)
        assert client.process is not None
        pid = client.process.pid
        raised_at: list[float] = []
        errors: list[BaseException] = []
        streams = [llm.generate(p, SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
        try:
            for stream in streams:
                first = await stream.__anext__()
                assert not first.finished
            with anyio.fail_after(HANG_GUARD_S):
                async with anyio.create_task_group() as tg:
                    for stream in streams:
                        tg.start_soon(drain_until_error, stream, raised_at, errors)
                    await anyio.sleep(0.5)  # the streams are being read when the engine freezes
                    os.kill(pid, signal.SIGSTOP)
                    stopped_at = time.monotonic()
        finally:
            took = await shut_down_timed(llm)
        assert len(errors) == len(PROMPTS), errors
        assert all(isinstance(e, EngineDeadError) and "unresponsive" in str(e) for e in errors), errors
        assert max(raised_at) - stopped_at < FAULT_TO_ERROR_S, f"{max(raised_at) - stopped_at:.1f} s"
        assert took < SHUTDOWN_S, f"shutdown took {took:.1f} s"
        return pid, client.ipc_dir

    pid, ipc_dir = anyio.run(body)
    assert wait_gone([pid], within=5.0) == []
    assert not os.path.exists(ipc_dir)


@pytest.mark.parametrize("mode", MODES)
def test_a_long_step_is_not_mistaken_for_an_unresponsive_engine(tokenizer, mode: str) -> None:
    """A 3 s CPU-bound step with `engine_timeout=1`: the heartbeat thread keeps beating; the request completes."""
    from asyncllm.config import EngineConfig, ParallelConfig

    config = EngineConfig(
        FAKE_CONFIG.model,
        FAKE_CONFIG.cache,
        FAKE_CONFIG.scheduler,
        ParallelConfig(engine_process=mode == "process", engine_timeout=1.0),
    )
    client = EngineCoreClient(config, core_factory=f"{HELPERS}:make_busy_core")
    llm = AsyncLLM(config, tokenizer, client)

    async def body() -> None:
        try:
            started = time.monotonic()
            final = await llm.generate({"prompt_token_ids": [1, 2]}, greedy(6, ignore_eos=True)).collect()
            assert time.monotonic() - started >= 3.0  # the long step really happened while we waited
            assert len(final.outputs[0].token_ids) == 6
            assert not llm.errored
        finally:
            await llm.shutdown()

    anyio.run(body)
    if client.process is not None:
        assert not pid_alive(client.process.pid)


def test_engine_timeout_is_range_checked() -> None:
    from asyncllm.errors import ConfigError

    for bad in (0, -1.0, "5", True):
        with pytest.raises(ConfigError, match="engine_timeout"):
            EngineArgs(engine_timeout=bad).validate()  # type: ignore[arg-type]
    EngineArgs(engine_timeout=0.5).validate()
