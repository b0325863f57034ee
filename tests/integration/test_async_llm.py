"""AsyncLLM end to end on the real SmolLM2-135M-Instruct, engine core in its own process and in a thread."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from asyncllm import AsyncLLM, RequestOutput, RequestOutputKind
from tests.integration.conftest import collect, greedy, wait_until_idle
from tests.reference import clear_prefix_len, greedy_margins

pytestmark = pytest.mark.asyncio(loop_scope="module")

PARIS_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PARIS_ANSWER = "The capital of France is Paris."
MARGIN = 0.05  # logits; below this a greedy choice can flip with batch shape (fp32 summation order)


@pytest.fixture(scope="module")
def llm_overrides() -> dict[str, Any]:
    """The shared `llm` (both modes: the engine core in its own process and in a thread) with 512 KV blocks."""
    return {"num_kv_blocks": 512}


def assert_one_final_and_last(outputs: list[RequestOutput]) -> None:
    assert outputs, "no output"
    assert [o.finished for o in outputs].count(True) == 1
    assert outputs[-1].finished


async def test_paris_cumulative_and_delta(llm: AsyncLLM) -> None:
    cumulative = await collect(llm.generate(PARIS_QUESTION, greedy(32)))
    delta = await collect(llm.generate(PARIS_QUESTION, greedy(32, RequestOutputKind.DELTA)))
    assert_one_final_and_last(cumulative)
    assert_one_final_and_last(delta)
    final = cumulative[-1].outputs[0]
    assert final.text == PARIS_ANSWER
    assert final.finish_reason == "stop"
    assert len(cumulative) > 3, "CUMULATIVE should stream, not arrive in one piece"
    assert "".join(o.outputs[0].text for o in delta) == final.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == final.token_ids
    assert "France" in (cumulative[-1].prompt or "")
    assert PARIS_QUESTION[0]["content"] not in final.text  # the prompt never leaks into the output


async def test_final_only_and_token_prompt(llm: AsyncLLM) -> None:
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(tokenizer.apply_chat_template(PARIS_QUESTION), add_special_tokens=False)
    outputs = await collect(llm.generate({"prompt_token_ids": ids}, greedy(32, RequestOutputKind.FINAL_ONLY)))
    assert len(outputs) == 1
    assert outputs[0].finished
    assert outputs[0].outputs[0].text == PARIS_ANSWER
    assert outputs[0].prompt_token_ids == ids


_ALONE: list[list[int]] = []  # each prompt of the continuous-batching test run alone, shared by both modes


@pytest.mark.slow
async def test_continuous_batching_matches_alone(llm: AsyncLLM, reference_model) -> None:
    tokenizer = llm.get_tokenizer()
    topics = ["the sea", "a cat", "Paris", "numbers", "music", "rain", "trees", "the moon"]
    prompts = [f"Tell me {'very ' * (i % 5)}briefly about {topics[i % 8]}. Answer #{i}." for i in range(16)]
    params = [greedy(6 + i, ignore_eos=True) for i in range(16)]  # 16 different steps to leave at

    if not _ALONE:  # computed in the first mode only; the other mode must match them too
        for prompt, p in zip(prompts, params, strict=True):
            _ALONE.append((await collect(llm.generate(prompt, p)))[-1].outputs[0].token_ids)
    alone = _ALONE

    async def staggered(i: int) -> list[int]:
        await asyncio.sleep(0.03 * i)  # requests join at different steps; different max_tokens leave at different steps
        return (await collect(llm.generate(prompts[i], params[i])))[-1].outputs[0].token_ids

    batched = await asyncio.gather(*(staggered(i) for i in range(16)))

    compared = 0
    for prompt, ref, got, p in zip(prompts, alone, batched, params, strict=True):
        assert len(ref) == len(got) == p.max_tokens
        prompt_ids = tokenizer.encode(prompt)
        k = clear_prefix_len(greedy_margins(reference_model, prompt_ids, ref), MARGIN)
        assert got[:k] == ref[:k], f"batched output diverged within the clear prefix ({k} tokens) of {prompt!r}"
        compared += k
    assert compared >= 0.5 * sum(p.max_tokens for p in params), "too few clear-margin tokens to mean anything"
    await wait_until_idle(llm)


async def test_break_out_of_async_for_frees_request(llm: AsyncLLM) -> None:
    seen = 0
    async for _ in llm.generate("Count from one to one hundred:", greedy(200, ignore_eos=True)):
        seen += 1
        if seen == 3:
            break
    await wait_until_idle(llm)


async def test_aclose_frees_request_and_is_idempotent(llm: AsyncLLM) -> None:
    stream = llm.generate("Count from one to one hundred:", greedy(200, ignore_eos=True), request_id="aclose-1")
    first = await stream.__anext__()
    assert not first.finished
    await stream.aclose()
    await stream.aclose()
    await wait_until_idle(llm)
    # The id is free again once the request is gone.
    outputs = await collect(llm.generate("Hi", greedy(2), request_id="aclose-1"))
    assert_one_final_and_last(outputs)


async def test_task_cancellation_frees_request(llm: AsyncLLM) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in llm.generate("Count from one to one hundred:", greedy(200, ignore_eos=True)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), timeout=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until_idle(llm)


async def test_abort_ends_stream_with_one_final_output(llm: AsyncLLM) -> None:
    stream = llm.generate("Count from one to one hundred:", greedy(200, ignore_eos=True), request_id="abort-1")
    outputs = []
    async for out in stream:
        outputs.append(out)
        if len(outputs) == 2:
            await llm.abort("abort-1")
    assert_one_final_and_last(outputs)
    assert outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 200
    await wait_until_idle(llm)


async def test_event_loop_keeps_ticking_with_16_live_streams(llm: AsyncLLM) -> None:
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick_task = asyncio.create_task(ticker())
    streams = [llm.generate(f"Write a story about robot number {i}.", greedy(24, ignore_eos=True)) for i in range(16)]
    results = await asyncio.gather(*(collect(s) for s in streams))
    done.set()
    await tick_task
    assert all(r[-1].finished and len(r[-1].outputs[0].token_ids) == 24 for r in results)
    assert len(gaps) > 20
    assert max(gaps) < 0.1, f"event loop stalled for {max(gaps) * 1000:.0f} ms"
