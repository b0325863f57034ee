"""One behaviour suite, four ways: engine core in a thread or a process, frontend on asyncio or trio.

Real model (SmolLM2) for streaming, merging, cancellation, abort and utilities; scripted cores (no model, same
client, sockets and engine loop) for death, shutdown and load, where only the boundary matters.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import anyio
import anyio.lowlevel
import pytest

from asyncllm import (
    AsyncLLM,
    EngineDeadError,
    EngineGenerateError,
    EventLoopError,
    RequestOutputKind,
    StreamBusyError,
)
from tests.integration.conftest import MODES, EngineFactory, collect, fake_llm, greedy, run, wait_until_idle
from tests.integration.engine_helpers import FAKE_TOKENS

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
PARIS_ANSWER = "The capital of France is Paris."
STORY = "Write a long story about the sea."


def test_streaming_gives_the_greedy_answer_and_one_final_output(llm: AsyncLLM, backend: str) -> None:
    async def body() -> None:
        outputs = await collect(llm.generate(PARIS, greedy(32)))
        assert outputs[-1].outputs[0].text == PARIS_ANSWER
        assert [o.finished for o in outputs].count(True) == 1
        assert outputs[-1].finished
        assert len(outputs) > 1

    run(backend, body)


def test_delta_outputs_merge_under_a_slow_consumer_to_the_cumulative_text(llm: AsyncLLM, backend: str) -> None:
    async def body() -> None:
        cumulative = (await collect(llm.generate(STORY, greedy(40, ignore_eos=True))))[-1].outputs[0]
        stream = llm.generate(STORY, greedy(40, RequestOutputKind.DELTA, ignore_eos=True))
        deltas = [await stream.__anext__()]
        with anyio.fail_after(120):  # lag until the engine finished the request: the rest merges into one slot
            while (await llm.get_scheduler_stats()).num_running_reqs > 0:  # noqa: ASYNC110 (polls the engine)
                await anyio.sleep(0.05)
        deltas += await collect(stream)
        assert "".join(d.outputs[0].text for d in deltas) == cumulative.text
        assert [t for d in deltas for t in d.outputs[0].token_ids] == cumulative.token_ids
        assert len(deltas) <= 3

    run(backend, body)


def test_leaving_the_loop_aborts_the_request(llm: AsyncLLM, backend: str) -> None:
    async def body() -> None:
        async for out in llm.generate(STORY, greedy(500, ignore_eos=True)):
            if len(out.outputs[0].token_ids) >= 3:
                break
        await wait_until_idle(llm)

    run(backend, body)


def test_a_cancel_scope_around_the_loop_aborts_the_request(llm: AsyncLLM, backend: str) -> None:
    async def body() -> None:
        seen = []
        with anyio.CancelScope() as scope:
            async for out in llm.generate(STORY, greedy(500, ignore_eos=True)):
                seen.append(out)
                if len(seen) == 3:
                    scope.cancel()
        assert scope.cancelled_caught
        assert len(seen) == 3
        await wait_until_idle(llm)

    run(backend, body)


def test_abort_ends_the_stream_with_finish_reason_abort(llm: AsyncLLM, backend: str) -> None:
    async def body() -> None:
        stream = llm.generate(STORY, greedy(500, ignore_eos=True), request_id="to-abort")
        first = await stream.__anext__()
        assert not first.finished
        await llm.abort("to-abort")
        rest = await collect(stream)
        assert rest[-1].finished
        assert rest[-1].outputs[0].finish_reason == "abort"
        await wait_until_idle(llm)

    run(backend, body)


def test_utility_results_have_one_type_and_value_in_every_mode(llm: AsyncLLM, backend: str) -> None:
    async def body() -> None:
        info = await llm.collective_rpc("get_model_info")
        assert info == [[8192, 49152]]
        assert type(info[0]) is list
        with pytest.raises(EngineGenerateError, match="unknown utility method 'no_such_utility'"):
            await llm._client.call_utility_async("no_such_utility")
        with pytest.raises(EngineGenerateError, match="failed in no_such_method"):
            await llm.collective_rpc("no_such_method")
        assert await llm.reset_prefix_cache() is True
        stats = await llm.get_scheduler_stats()
        assert stats.num_total_blocks == 128

    run(backend, body)


def test_a_second_task_iterating_one_stream_gets_a_clear_error_at_once(llm: AsyncLLM, backend: str) -> None:
    async def body() -> None:
        stream = llm.generate(STORY, greedy(8, ignore_eos=True))
        errors: list[BaseException] = []

        async def second_reader() -> None:
            try:
                await stream.__anext__()
            except StreamBusyError as e:
                errors.append(e)

        async with anyio.create_task_group() as tg:
            tg.start_soon(collect, stream)
            with anyio.fail_after(30):
                while not stream.statistics().reading:  # noqa: ASYNC110 (until the first reader waits in it)
                    await anyio.sleep(0.001)
            with anyio.fail_after(1):
                await second_reader()
        assert len(errors) == 1
        assert "another task" in str(errors[0])

    run(backend, body)


# ---- scripted cores: the boundary alone --------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_engine_death_raises_engine_dead_in_every_stream_within_5s(tokenizer, mode: str, backend: str) -> None:
    llm = fake_llm(tokenizer, mode, "make_failing_core")

    async def body() -> None:
        streams = [llm.generate({"prompt_token_ids": [1]}, greedy(60, ignore_eos=True)) for _ in range(2)]
        started = time.monotonic()
        for stream in streams:
            with pytest.raises(EngineDeadError, match="the engine core died: RuntimeError: scripted engine failure"):
                await collect(stream)
        assert time.monotonic() - started < 5
        assert llm.errored
        with pytest.raises(EngineDeadError):
            llm.generate("Hello", greedy(2))
        await llm.shutdown()

    run(backend, body)


@pytest.mark.parametrize("mode", MODES)
def test_shutdown_with_open_streams_ends_them_with_engine_dead(tokenizer, mode: str, backend: str) -> None:
    llm = fake_llm(tokenizer, mode, "make_long_core")

    async def body() -> None:
        streams = [llm.generate({"prompt_token_ids": [1]}, greedy(10_000, ignore_eos=True)) for _ in range(2)]
        first = await streams[0].__anext__()
        assert first.outputs[0].token_ids[:2] == FAKE_TOKENS[:2][: len(first.outputs[0].token_ids)]
        await llm.shutdown()
        for stream in streams:
            with pytest.raises(EngineDeadError, match="shut down"):
                await collect(stream)
        await llm.shutdown()  # idempotent

    run(backend, body)


@pytest.mark.parametrize("mode", MODES)
def test_many_streams_under_load_lose_no_wake_up(tokenizer, mode: str, backend: str) -> None:
    """64 concurrent streams of 200 tokens: every token of every stream arrives (an edge-triggered fd read
    without re-checking zmq.EVENTS would strand a message and hang here)."""
    llm = fake_llm(tokenizer, mode, "make_long_core")

    async def body() -> None:
        results: dict[int, int] = {}

        async def one(i: int) -> None:
            outputs = await collect(llm.generate({"prompt_token_ids": [1]}, greedy(200, ignore_eos=True)))
            results[i] = len(outputs[-1].outputs[0].token_ids)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(64):
                    tg.start_soon(one, i)
                    if i % 8 == 0:
                        await anyio.lowlevel.checkpoint()
            for _ in range(50):  # utility calls interleaved with nothing else in flight
                assert (await llm._client.call_utility_async("echo", 1)) == [1]
        assert results == {i: 200 for i in range(64)}
        await llm.shutdown()

    run(backend, body)


def test_two_live_loops_in_two_threads_the_second_gets_a_clear_error_at_once(tokenizer, backend: str) -> None:
    llm = fake_llm(tokenizer, "thread")
    first_loop_ready, release = threading.Event(), threading.Event()

    async def first_loop() -> None:
        stream = llm.generate({"prompt_token_ids": [1]}, greedy(3, ignore_eos=True))
        await stream.__anext__()
        first_loop_ready.set()
        await anyio.to_thread.run_sync(release.wait, 30)
        await collect(stream)

    thread = threading.Thread(target=run, args=("asyncio", first_loop))
    thread.start()
    try:
        assert first_loop_ready.wait(30)

        async def second_loop() -> None:
            with pytest.raises(EventLoopError, match="in use by an event loop running in thread"):
                llm.generate({"prompt_token_ids": [1]}, greedy(3))

        run(backend, second_loop)
    finally:
        release.set()
        thread.join(30)
    run(backend, llm.shutdown)


@pytest.mark.mp
def test_sigkilled_engine_process_raises_engine_dead_within_5s(tokenizer, backend: str) -> None:
    llm = fake_llm(tokenizer, "process", "make_long_core")

    async def body() -> None:
        stream = llm.generate({"prompt_token_ids": [1]}, greedy(10_000, ignore_eos=True))
        await stream.__anext__()
        assert llm._client.process is not None
        os.kill(llm._client.process.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            await collect(stream)
        assert time.monotonic() - started < 5
        await llm.shutdown()

    run(backend, body)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
async def test_an_executor_class_as_backend_runs_in_the_engine_in_both_modes(
    make_llm: EngineFactory, mode: str
) -> None:
    from tests.integration.custom_executor import TaggedExecutor

    llm = make_llm(engine_process=mode == "process", distributed_executor_backend=TaggedExecutor, num_kv_blocks=64)
    assert await llm.collective_rpc("get_model_info") == [[8192, 49152, "tagged"]]
    outputs = await collect(llm.generate(PARIS, greedy(32)))
    assert outputs[-1].outputs[0].text == PARIS_ANSWER
