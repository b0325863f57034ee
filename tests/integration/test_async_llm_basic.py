"""Frontend behaviour on the real model: stop strings end requests in the engine, validation, stats."""

from __future__ import annotations

import pytest

from asyncllm import AsyncLLM, InvalidRequestError, RequestOutputKind
from tests.integration.conftest import collect, greedy, wait_until_idle

# Every test runs against both clients (the shared `llm`, one per mode): the engine core in its own process and
# in a thread.
pytestmark = pytest.mark.asyncio(loop_scope="module")

PARIS_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


async def test_stop_string_ends_the_request_in_the_engine(llm: AsyncLLM) -> None:
    outputs = await collect(llm.generate(PARIS_QUESTION, greedy(32, RequestOutputKind.DELTA, stop=[" France"])))
    final = outputs[-1].outputs[0]
    assert "".join(o.outputs[0].text for o in outputs) == "The capital of"
    assert (final.finish_reason, final.stop_reason) == ("stop", " France")
    assert [o.finished for o in outputs].count(True) == 1
    await wait_until_idle(llm)


async def test_include_stop_str_in_output(llm: AsyncLLM) -> None:
    params = greedy(32, stop=["France"], include_stop_str_in_output=True)
    outputs = await collect(llm.generate(PARIS_QUESTION, params))
    assert outputs[-1].outputs[0].text == "The capital of France"


async def test_invalid_input_raises_at_once_and_the_engine_keeps_serving(llm: AsyncLLM) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate({"prompt_token_ids": [10**9]}, greedy(4))
    with pytest.raises(InvalidRequestError):
        llm.generate("", greedy(4))
    stream = llm.generate("Hello", greedy(4), request_id="dup")
    twin = llm.generate("Hello", greedy(4), request_id="dup")  # a second request with the same user id
    outputs = await collect(stream)
    assert len(outputs[-1].outputs[0].token_ids) <= 4
    assert (await twin.collect()).outputs[0].token_ids == outputs[-1].outputs[0].token_ids
    await llm.check_health()
    assert llm.is_running
    assert not llm.errored


async def test_scheduler_stats_shape(llm: AsyncLLM) -> None:
    stats = await llm.get_scheduler_stats()
    assert stats.num_total_blocks == 128
    assert 0.0 <= stats.kv_cache_usage <= 1.0
