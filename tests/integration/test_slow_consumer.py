"""Bounded memory for a consumer that stops reading: while it sleeps, its request's DELTA outputs merge into the
one output its collector holds (`RequestOutputCollector`), never a queue of one output per token."""

from __future__ import annotations

import anyio
import pytest

from asyncllm import AsyncLLM, RequestOutputKind
from tests.integration.conftest import greedy
from tests.state_probes import internal_ids_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUM_TOKENS = 200


async def stall_one_consumer(llm: AsyncLLM) -> None:
    stalled = llm.generate(
        "Write a very long story about a river.", greedy(NUM_TOKENS, RequestOutputKind.DELTA, ignore_eos=True)
    )
    busy = llm.generate(
        "Count from one to a thousand.", greedy(NUM_TOKENS + 100, RequestOutputKind.DELTA, ignore_eos=True)
    )
    first = await stalled.__anext__()  # the stalled consumer reads one output, then stops reading
    num_first = len(first.outputs[0].token_ids)
    states = llm._output_processor._states
    (internal_id,) = internal_ids_of(llm._output_processor, stalled.request_id)  # the engine's key of the request
    collector = stalled._collector
    num_busy_outputs = 0
    async for _ in busy:  # another stream keeps the outputs flowing (it drives the output handler)
        num_busy_outputs += 1
        held = collector._output
        assert held is None or len(held.outputs) == 1  # one merged output, never a list of pending ones
        if internal_id not in states:
            break  # the stalled request finished in the engine while nobody read it
    assert internal_id not in states, "the stalled request did not finish while the other one ran"
    held = collector._output
    assert held is not None
    assert held.finished
    assert len(held.outputs[0].token_ids) == NUM_TOKENS - num_first  # every token since, in that one output
    assert num_busy_outputs >= 50  # many engine steps passed while the consumer slept
    rest = [out async for out in stalled]  # waking up: one merged output, then the end
    assert len(rest) == 1
    assert rest[0].finished
    assert len(first.outputs[0].token_ids) + len(rest[0].outputs[0].token_ids) == NUM_TOKENS
    await busy.aclose()


def test_a_consumer_that_stops_reading_holds_one_merged_output(llm: AsyncLLM) -> None:
    anyio.run(stall_one_consumer, llm)
