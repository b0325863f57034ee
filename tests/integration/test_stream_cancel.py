"""Which ways of leaving a stream cancel its request, on the real engine (its own process).

Always, at once: leaving `async with llm.generate(...) as stream:` (break, return, exception), `aclose()`,
cancelling the consuming task, `llm.abort(id)`. Leaving `async for` with `break` only when the stream object is
garbage-collected: at once if nothing else holds it, not while a variable still does.
After a cancel the request is no longer in flight (its id can be reused at once) and the engine goes idle.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import pytest

from asyncllm import AsyncLLM, RequestOutputKind, SamplingParams
from tests.state_probes import has_user_request

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.mp]
PROMPT = [{"role": "user", "content": "Tell me a long story about the sea."}]
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
SHORT = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mode() -> str:
    """The shared `llm` runs its engine core in its own process."""
    return "process"


@pytest.fixture(scope="module")
def llm_overrides() -> dict[str, Any]:
    """The shared `llm` with 256 KV blocks."""
    return {"num_kv_blocks": 256}


def in_flight(llm: AsyncLLM, request_id: str) -> bool:
    return has_user_request(llm._output_processor, request_id)


async def wait_until_engine_idle(llm: AsyncLLM, within: float = 30.0) -> None:
    """The engine has no running or waiting request (generous deadline: a loaded machine)."""
    deadline = time.monotonic() + within
    while True:
        stats = await llm.get_scheduler_stats()
        if stats.num_running_reqs == stats.num_waiting_reqs == 0:
            return
        assert time.monotonic() < deadline, f"the engine still runs requests after {within} s: {stats}"
        await asyncio.sleep(0.05)


async def assert_cancelled_and_reusable(llm: AsyncLLM, request_id: str) -> None:
    assert not in_flight(llm, request_id)
    await wait_until_engine_idle(llm)
    again = await llm.generate(PROMPT, SHORT, request_id=request_id).collect()  # the id is free again
    assert again.finished
    assert len(again.outputs[0].token_ids) == 3
    await wait_until_engine_idle(llm)


async def test_break_out_of_async_with_cancels(llm: AsyncLLM) -> None:
    async with llm.generate(PROMPT, LONG, request_id="with-break") as stream:
        async for out in stream:
            assert not out.finished
            break
    held = stream  # still referenced: cancelling did not depend on garbage collection
    assert held.closed
    await assert_cancelled_and_reusable(llm, "with-break")


async def test_exception_out_of_async_with_cancels(llm: AsyncLLM) -> None:
    async def consume_then_fail() -> None:
        async with llm.generate(PROMPT, LONG, request_id="with-error") as stream:
            await stream.__anext__()
            raise KeyError("the consumer failed")

    with pytest.raises(KeyError):
        await consume_then_fail()
    await assert_cancelled_and_reusable(llm, "with-error")


async def test_aclose_cancels(llm: AsyncLLM) -> None:
    stream = llm.generate(PROMPT, LONG, request_id="aclose")
    await stream.__anext__()
    await stream.aclose()
    await assert_cancelled_and_reusable(llm, "aclose")


async def test_cancelling_the_consuming_task_cancels(llm: AsyncLLM) -> None:
    stream = llm.generate(PROMPT, LONG, request_id="task-cancel")
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in stream:
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_cancelled_and_reusable(llm, "task-cancel")


async def test_abort_ends_the_stream_with_finish_reason_abort(llm: AsyncLLM) -> None:
    stream = llm.generate(PROMPT, LONG, request_id="abort")
    await stream.__anext__()
    await llm.abort("abort")
    outputs = [out async for out in stream]
    assert outputs[-1].finished
    assert outputs[-1].outputs[0].finish_reason == "abort"
    await assert_cancelled_and_reusable(llm, "abort")


async def test_break_out_of_async_for_on_an_unheld_stream_cancels(llm: AsyncLLM) -> None:
    async for _ in llm.generate(PROMPT, LONG, request_id="unheld"):
        break
    await asyncio.sleep(0)  # the abort is scheduled on the loop by the stream's finalizer
    await assert_cancelled_and_reusable(llm, "unheld")


async def test_break_out_of_async_for_on_a_held_stream_cancels_only_when_dropped(llm: AsyncLLM) -> None:
    stream = llm.generate(PROMPT, LONG, request_id="held")
    async for _ in stream:
        break
    await asyncio.sleep(0.2)
    assert in_flight(llm, "held")  # Python cannot see the break: the request still runs
    assert (await llm.get_scheduler_stats()).num_running_reqs == 1
    del stream
    gc.collect()
    await asyncio.sleep(0)
    await assert_cancelled_and_reusable(llm, "held")
