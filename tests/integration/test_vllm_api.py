"""vLLM's Python API on asyncllm, called as vLLM's docs show, on the real model (one engine in a thread, shared by
the module): prompt TypedDicts, `check_health` as a coroutine, pausing, unfinished-request counts, and the sampling
options vLLM has (docs/vllm_compat.md lists each row)."""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest
import pytest_asyncio

from asyncllm import AsyncLLM, EngineArgs, InvalidRequestError
from asyncllm.inputs import TextPrompt, TokensPrompt
from tests.integration.conftest import greedy, wait_until_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The capital of France is"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def llm(model_path: str):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=model_path, engine_process=False, num_kv_blocks=128))
    async with engine:
        yield engine


async def wait_for(condition, within: float = 60.0) -> None:
    """Wait (generously: a loaded machine) until `condition()` is true."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def last_output(stream):
    """The last output of a (CUMULATIVE) stream already partly read: the whole result."""
    outputs = [output async for output in stream]
    return outputs[-1]


# ---- prompts: vLLM's TokensPrompt / TextPrompt ----------------------------------------------------------------


async def test_tokens_prompt_and_text_prompt_run_as_vllms(llm: AsyncLLM) -> None:
    ids = llm.get_tokenizer().encode(PROMPT)
    from_text = await llm.generate(PROMPT, greedy(6)).collect()
    from_ids = await llm.generate(TokensPrompt(prompt_token_ids=ids), greedy(6)).collect()
    from_dict = await llm.generate(TextPrompt(prompt=PROMPT, cache_salt="tenant-a"), greedy(6)).collect()
    assert from_ids.prompt_token_ids == ids == from_text.prompt_token_ids
    assert from_ids.outputs[0].token_ids == from_text.outputs[0].token_ids == from_dict.outputs[0].token_ids
    assert len(from_text.outputs[0].token_ids) == 6
    assert from_dict.prompt == PROMPT


async def test_a_bad_prompt_raises_at_generate_naming_what_is_not_served(llm: AsyncLLM) -> None:
    # vLLM raises these from the first iteration; asyncllm raises them from generate() (docs/vllm_compat.md).
    with pytest.raises(InvalidRequestError, match="multi_modal_data"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": None}}, greedy(2))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate(TokensPrompt(prompt_token_ids=[10**9]), greedy(2))
    with pytest.raises(InvalidRequestError, match="cache_salt is given twice"):
        llm.generate(TextPrompt(prompt=PROMPT, cache_salt="a"), greedy(2), cache_salt="b")


# ---- health, pausing, unfinished requests ---------------------------------------------------------------------


async def test_check_health_is_a_coroutine(llm: AsyncLLM) -> None:
    assert inspect.iscoroutinefunction(llm.check_health)
    assert await llm.check_health() is None


async def test_pause_waiting_for_inflight_requests_lets_them_finish_and_holds_new_ones(llm: AsyncLLM) -> None:
    running = llm.generate(PROMPT, greedy(24, ignore_eos=True))
    first = await running.__anext__()  # the request is in the engine
    assert not first.finished
    assert llm.has_unfinished_requests()
    assert llm.num_unfinished_requests == 1
    rest = asyncio.create_task(last_output(running))
    await llm.pause_generation(wait_for_inflight_requests=True, clear_cache=True)
    assert await llm.is_paused()
    assert not llm.has_unfinished_requests()
    finished = await rest
    assert finished.outputs[0].finish_reason == "length"
    assert len(finished.outputs[0].token_ids) == 24

    held = asyncio.create_task(llm.generate(PROMPT, greedy(4)).collect())
    await asyncio.sleep(0.5)  # the held request must not run while paused (it would finish well within this)
    assert not held.done()
    assert not llm.has_unfinished_requests()
    assert (await llm.get_scheduler_stats()).num_waiting_reqs == 0
    await llm.resume_generation()
    assert not await llm.is_paused()
    output = await asyncio.wait_for(held, 60)
    assert len(output.outputs[0].token_ids) == 4
    await wait_until_idle(llm)


async def test_pause_by_default_aborts_inflight_requests(llm: AsyncLLM) -> None:
    running = llm.generate(PROMPT, greedy(200, ignore_eos=True))
    await running.__anext__()
    await llm.pause_generation()  # vLLM's default: abort
    final = await asyncio.wait_for(last_output(running), 60)
    assert final.finished
    assert final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) < 200
    assert not llm.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="keep"):
        await llm.pause_generation(mode="keep")
    await llm.resume_generation()
    assert len((await llm.generate(PROMPT, greedy(3)).collect()).outputs[0].token_ids) == 3
    await wait_until_idle(llm)
