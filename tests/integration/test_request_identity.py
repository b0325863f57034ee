"""Request identity on the real SmolLM2 engine, in both modes (issue 12): every request is keyed inside the
frontend, the client and the engine by an internal id made at submission (vLLM's `request_id` beside
`external_req_id`), so a user's id reused right after its abort, or sent by two callers at once, never
collides; `abort(user_id)` reaches every in-flight request with that id; outputs carry the user's id."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from asyncllm import AsyncLLM, EngineGenerateError, InvalidRequestError, RequestOutput, SamplingParams
from tests.integration.conftest import EngineFactory, collect, greedy, wait_until_idle
from tests.integration.custom_executor import SchedulerFaultExecutor

LONG = "Write a long story about a dragon who learns to bake bread."
SHORT = [{"role": "user", "content": "What is the capital of France?"}]


async def start_long(llm: AsyncLLM, request_id: str) -> Any:
    """A long request with id `request_id`, already streaming (3 outputs read)."""
    stream = llm.generate(LONG, greedy(400, ignore_eos=True), request_id=request_id)
    for _ in range(3):
        await stream.__anext__()
    return stream


async def leave_by_break(llm: AsyncLLM, request_id: str) -> None:
    async for out in llm.generate(LONG, greedy(400, ignore_eos=True), request_id=request_id):
        if len(out.outputs[0].token_ids) >= 3:
            break  # nothing else holds the stream: it is collected and aborts


async def leave_by_aclose(llm: AsyncLLM, request_id: str) -> None:
    stream = await start_long(llm, request_id)
    await stream.aclose()


async def leave_by_cancel(llm: AsyncLLM, request_id: str) -> None:
    started = anyio.Event()

    async def consume() -> None:
        async for out in llm.generate(LONG, greedy(400, ignore_eos=True), request_id=request_id):
            if len(out.outputs[0].token_ids) >= 3:
                started.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await started.wait()
        tg.cancel_scope.cancel()


async def leave_by_abort(llm: AsyncLLM, request_id: str) -> None:
    stream = await start_long(llm, request_id)
    await llm.abort(request_id)
    outs = await collect(stream)
    assert outs[-1].outputs[0].finish_reason == "abort"


WAYS: dict[str, Callable[[AsyncLLM, str], Awaitable[None]]] = {
    "break": leave_by_break,
    "aclose": leave_by_aclose,
    "cancel": leave_by_cancel,
    "abort": leave_by_abort,
}


@pytest.mark.slow
@pytest.mark.parametrize("way", list(WAYS))
async def test_an_id_reused_right_after_its_abort_gets_only_its_own_output(llm: AsyncLLM, way: str) -> None:
    alone = await llm.generate(SHORT, greedy(12)).collect()
    for _ in range(3):  # the old request's last step is often still on its way when the id is reused
        await WAYS[way](llm, "same")
        reused = await llm.generate(SHORT, greedy(12), request_id="same").collect()
        assert reused.request_id == "same"
        assert reused.outputs[0].token_ids == alone.outputs[0].token_ids
        assert reused.outputs[0].text == alone.outputs[0].text
    await wait_until_idle(llm, within=30.0)


async def test_two_callers_with_one_id_each_get_their_own_output(llm: AsyncLLM) -> None:
    story = await llm.generate(LONG, greedy(10)).collect()
    paris = await llm.generate(SHORT, greedy(8)).collect()
    results: dict[str, RequestOutput] = {}

    async def one(name: str, prompt: Any, params: SamplingParams) -> None:
        results[name] = await llm.generate(prompt, params, request_id="twice").collect()

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "story", LONG, greedy(10))
        tg.start_soon(one, "paris", SHORT, greedy(8))
        tg.start_soon(one, "pair", SHORT, SamplingParams(n=2, max_tokens=8, temperature=0.0))
    assert {out.request_id for out in results.values()} == {"twice"}
    assert results["story"].outputs[0].token_ids == story.outputs[0].token_ids
    assert results["paris"].outputs[0].token_ids == paris.outputs[0].token_ids
    pair = sorted(results["pair"].outputs, key=lambda c: c.index)
    assert [c.index for c in pair] == [0, 1]
    assert all(c.token_ids == paris.outputs[0].token_ids for c in pair)
    await wait_until_idle(llm)


async def test_abort_of_a_user_id_reaches_every_request_with_it(llm: AsyncLLM) -> None:
    first = await start_long(llm, "both")
    second = llm.generate(LONG, SamplingParams(n=2, max_tokens=400, ignore_eos=True), request_id="both")
    other = llm.generate(SHORT, greedy(8, ignore_eos=True), request_id="other")
    await second.__anext__()
    await llm.abort("both")
    for stream in (first, second):
        last = (await collect(stream))[-1]
        assert last.request_id == "both"
        assert {c.finish_reason for c in last.outputs} == {"abort"}
    assert (await other.collect()).outputs[0].finish_reason == "length"
    await wait_until_idle(llm)


@pytest.mark.slow
async def test_a_scheduler_error_for_one_request_fails_that_request_alone(make_llm: EngineFactory, mode: str) -> None:
    """Fault injection inside the engine's scheduler, in the engine's own process (a test executor patches the
    scheduler's stop check there): the victim fails alone, a bystander and later requests get their usual output."""
    executor = "tests.integration.custom_executor:SchedulerFaultExecutor"
    llm = make_llm(engine_process=mode == "process", num_kv_blocks=64, distributed_executor_backend=executor)
    alone = await llm.generate(SHORT, greedy(16)).collect()
    victim = llm.generate(LONG, greedy(40, ignore_eos=True), request_id=SchedulerFaultExecutor.VICTIM)
    bystander = llm.generate(SHORT, greedy(16), request_id="bystander")
    with pytest.raises(EngineGenerateError, match=rf"'victim'.*{SchedulerFaultExecutor.MESSAGE}"):
        await victim.collect()
    assert (await bystander.collect()).outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.is_running
    again = await llm.generate(SHORT, greedy(16), request_id="after").collect()
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids
    await wait_until_idle(llm)


async def test_a_cache_salt_isolates_tenants_in_the_prefix_cache(llm: AsyncLLM) -> None:
    """vLLM's `cache_salt`: a salted request never hits blocks cached under another salt (or none), so one tenant
    cannot learn another's prompt from time to first token; the same salt hits."""
    prompt = {"prompt_token_ids": list(range(1000, 1100))}  # 100 tokens: 6 full blocks of 16

    async def cached(salt: str | None) -> int:
        out = await llm.generate(prompt, greedy(2), cache_salt=salt).collect()
        return out.num_cached_tokens

    await wait_until_idle(llm)
    assert await llm.reset_prefix_cache()
    assert await cached("tenant-a") == 0
    assert await cached("tenant-b") == 0
    assert await cached(None) == 0
    assert await cached("tenant-a") == 96  # every full block but the last token's
    assert await cached("tenant-b") == 96
    assert await cached(None) == 96
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        llm.generate(prompt, greedy(2), cache_salt="")
