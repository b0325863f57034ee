"""vLLM's Python API on asyncllm, called as vLLM's docs show, on the real model (one engine in a thread, shared by
the module): prompt TypedDicts, `check_health` as a coroutine, pausing, unfinished-request counts, and the sampling
options vLLM has (docs/vllm_compat.md lists each row)."""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from typing import Any

import pytest
import torch

from asyncllm import AsyncLLM, EngineGenerateError, InvalidRequestError, SamplingParams
from asyncllm.inputs import TextPrompt, TokensPrompt
from tests.integration.conftest import EngineFactory, greedy, wait_until_idle
from tests.state_probes import num_registered_callables

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def mode() -> str:
    """The shared `llm` runs its engine core in a thread: per-request callables reach the worker only there."""
    return "thread"


@pytest.fixture(scope="module")
def llm_overrides() -> dict[str, Any]:
    """The shared `llm` with no cap on requested logprobs."""
    return {"max_logprobs": -1}


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


def generated_tokens(llm: AsyncLLM) -> int:
    """The engine's generation-token counter (`get_metrics()`)."""
    (counter,) = [m for m in llm.get_metrics() if m.name == "asyncllm:generation_tokens"]
    return int(counter.value)  # type: ignore[attr-defined]


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
    await llm.resume_generation()
    assert len((await llm.generate(PROMPT, greedy(3)).collect()).outputs[0].token_ids) == 3
    await wait_until_idle(llm)


async def test_pause_keep_freezes_inflight_requests_until_resume(llm: AsyncLLM) -> None:
    with pytest.raises(InvalidRequestError, match="clear_cache=False"):
        await llm.pause_generation(mode="keep")  # clear_cache=True (default) cannot be honoured with kept requests
    assert not await llm.is_paused()
    running = llm.generate(PROMPT, greedy(16, ignore_eos=True))
    first = await running.__anext__()
    rest = asyncio.create_task(last_output(running))
    await llm.pause_generation(mode="keep", clear_cache=False)
    assert await llm.is_paused()
    stats = await llm.get_scheduler_stats()
    generated = generated_tokens(llm)
    await asyncio.sleep(0.5)  # a kept request must not advance
    assert generated_tokens(llm) == generated
    assert not rest.done()
    assert llm.has_unfinished_requests()  # kept, not aborted
    assert (await llm.get_scheduler_stats()).num_running_reqs == stats.num_running_reqs == 1
    await llm.resume_generation()
    final = await asyncio.wait_for(rest, 60)
    assert final.outputs[0].finish_reason == "length"
    assert len(final.outputs[0].token_ids) == 16
    assert final.outputs[0].token_ids[: len(first.outputs[0].token_ids)] == first.outputs[0].token_ids
    await wait_until_idle(llm)


# ---- sampling options --------------------------------------------------------------------------------------------


def token_id(llm: AsyncLLM, text: str) -> int:
    (only,) = llm.get_tokenizer().encode(text, add_special_tokens=False)
    return int(only)


async def test_bad_words_never_appear_in_200_sampled_tokens(llm: AsyncLLM) -> None:
    the = token_id(llm, " the")
    free = SamplingParams(max_tokens=200, temperature=1.0, seed=7, ignore_eos=True)
    banned = SamplingParams(max_tokens=200, temperature=1.0, seed=7, ignore_eos=True, bad_words=["the"])
    prompt = "Write a long story about the sea and the ships on the water."
    unconstrained, constrained = await asyncio.gather(
        llm.generate(prompt, free).collect(), llm.generate(prompt, banned).collect()
    )
    assert the in unconstrained.outputs[0].token_ids  # the test can fail: " the" is sampled without the ban
    assert len(constrained.outputs[0].token_ids) == 200
    assert the not in constrained.outputs[0].token_ids
    assert token_id(llm, "the") not in constrained.outputs[0].token_ids


async def test_a_logits_processor_that_bans_a_token_is_honoured_in_a_batch(llm: AsyncLLM) -> None:
    alone = await llm.generate(PROMPT, greedy(8)).collect()
    banned = alone.outputs[0].token_ids[0]  # the greedy first token
    seen: list[list[int]] = []

    def ban(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:  # vLLM v0's documented signature
        seen.append(list(output_ids))
        logits[banned] = -math.inf
        return logits

    def ban_with_prompt(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[banned] = -math.inf
        return logits

    outputs = await asyncio.gather(
        llm.generate(PROMPT, greedy(8, logits_processors=[ban])).collect(),
        llm.generate(PROMPT, greedy(8)).collect(),  # same batch, no processor: unchanged
        llm.generate(PROMPT, greedy(8, logits_processors=[ban_with_prompt])).collect(),
    )
    assert banned not in outputs[0].outputs[0].token_ids
    assert len(outputs[0].outputs[0].token_ids) == 8
    assert outputs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outputs[2].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert seen[0] == []
    assert seen[-1] == outputs[0].outputs[0].token_ids[:-1]
    assert num_registered_callables() == 0  # forgotten once the requests finished


async def test_a_held_stream_closed_before_resume_leaves_no_logits_processor_behind(llm: AsyncLLM) -> None:
    await llm.pause_generation(clear_cache=False)
    held = llm.generate(PROMPT, greedy(2, logits_processors=[lambda ids, logits: logits]))
    assert num_registered_callables() == 1
    await held.aclose()  # closed while paused: never submitted
    assert num_registered_callables() == 0
    await llm.resume_generation()
    assert not llm.has_unfinished_requests()


async def test_a_failing_logits_processor_fails_its_request_alone(llm: AsyncLLM) -> None:
    def broken(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("user bug")

    bad = llm.generate(PROMPT, greedy(4, logits_processors=[broken]))
    good = llm.generate(PROMPT, greedy(4))
    with pytest.raises(EngineGenerateError, match="user bug"):
        await bad.collect()
    assert len((await good.collect()).outputs[0].token_ids) == 4
    await wait_until_idle(llm)


async def test_detokenize_false_returns_token_ids_and_no_text(llm: AsyncLLM) -> None:
    text_run = await llm.generate(PROMPT, greedy(6, logprobs=1)).collect()
    ids_run = await llm.generate(PROMPT, greedy(6, logprobs=1, detokenize=False)).collect()
    assert ids_run.outputs[0].token_ids == text_run.outputs[0].token_ids
    assert text_run.outputs[0].text
    assert ids_run.outputs[0].text == ""
    assert all(lp.decoded_token is None for position in ids_run.outputs[0].logprobs for lp in position.values())
    with pytest.raises(InvalidRequestError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])


async def test_logprobs_minus_one_returns_the_whole_vocabulary_sampled_token_first(llm: AsyncLLM) -> None:
    output = (await llm.generate(PROMPT, greedy(2, logprobs=-1)).collect()).outputs[0]
    for token, position in zip(output.token_ids, output.logprobs, strict=True):
        assert len(position) == 49152  # SmolLM2's vocabulary
        assert next(iter(position)) == token
        assert math.isclose(sum(math.exp(lp.logprob) for lp in position.values()), 1.0, rel_tol=1e-3)
        assert sorted(lp.rank for lp in position.values())[:3] == [1, 2, 3]


async def test_logprobs_list_the_sampled_token_first_then_the_top_k_by_rank(llm: AsyncLLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.5, seed=3, logprobs=5)
    output = (await llm.generate(PROMPT, params).collect()).outputs[0]
    outside_top = 0
    for token, position in zip(output.token_ids, output.logprobs, strict=True):
        keys = list(position)
        assert keys[0] == token
        top = [t for t in keys if t != token] if token not in keys[1:] else keys[1:]
        ranks = [position[t].rank for t in top]
        assert ranks == sorted(ranks)
        assert ranks[-1] == 5
        outside_top += position[token].rank > 5
    assert outside_top > 0  # at temperature 1.5 some sampled tokens fall outside the top 5 (first, not last)


async def test_best_of_is_rejected_as_vllm_v1_does(llm: AsyncLLM) -> None:
    with pytest.raises(InvalidRequestError, match="vLLM V1 does not yet support best_of"):
        SamplingParams(best_of=2)
    output = await llm.generate(PROMPT, greedy(2, best_of=1)).collect()
    assert len(output.outputs[0].token_ids) == 2


# ---- engine arguments: skip_tokenizer_init, logprobs_mode --------------------------------------------------------


async def test_skip_tokenizer_init_returns_ids_and_an_empty_text_and_raw_logits_mode(
    llm: AsyncLLM, make_llm: EngineFactory
) -> None:
    ids = llm.get_tokenizer().encode(PROMPT)
    reference = (await llm.generate(TokensPrompt(prompt_token_ids=ids), greedy(4, logprobs=2)).collect()).outputs[0]
    bare = make_llm(engine_process=False, num_kv_blocks=32, skip_tokenizer_init=True, logprobs_mode="raw_logits")
    with pytest.raises(InvalidRequestError, match="skip_tokenizer_init"):
        bare.generate(PROMPT, greedy(4))
    output = (await bare.generate(TokensPrompt(prompt_token_ids=ids), greedy(4, logprobs=2)).collect()).outputs[0]
    assert output.token_ids == reference.token_ids
    assert output.text == ""
    for logits, logprobs in zip(output.logprobs, reference.logprobs, strict=True):
        first, second = sorted(logits.values(), key=lambda lp: lp.rank)[:2]
        ref_first, ref_second = sorted(logprobs.values(), key=lambda lp: lp.rank)[:2]
        assert first.logprob > 0  # a logit, not a log-probability
        assert math.isclose(first.logprob - second.logprob, ref_first.logprob - ref_second.logprob, abs_tol=1e-3)
        assert first.decoded_token is None
