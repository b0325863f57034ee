"""Sampling and streaming semantics on the real SmolLM2-135M-Instruct (engine core in a background thread):
n > 1, output kinds, stream_interval, stop rules, logprobs, seeds, validation at submission, request ids,
collect(). Scripted token sequences for what a model cannot force are in tests/unit/test_output_processor.py
and tests/unit/test_detokenizer.py."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from asyncllm import AsyncLLM, InvalidRequestError, RequestOutput, RequestOutputKind, SamplingParams
from tests.integration.conftest import greedy, wait_until_idle
from tests.reference import next_token_logits

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_MODEL_LEN = 256
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time, in a small village by the sea,"
DELTA, CUMULATIVE, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def mode() -> str:
    """The shared `llm` runs its engine core in a thread."""
    return "thread"


@pytest.fixture(scope="module")
def llm_overrides() -> dict[str, Any]:
    """The shared `llm` with 256 KV blocks and `MAX_MODEL_LEN`."""
    return {"num_kv_blocks": 256, "max_model_len": MAX_MODEL_LEN}


async def outputs_of(stream, stall: AsyncLLM | None = None) -> list[RequestOutput]:
    """All outputs of a stream. With `stall`, the consumer stops after the first output until that engine is
    idle (the request finished meanwhile), so every later output must merge in the collector."""
    seen = []
    async for out in stream:
        seen.append(out)
        if stall is not None and len(seen) == 1:
            await wait_until_idle(stall, within=60.0)
    return seen


def joined_delta(outputs: list[RequestOutput], index: int = 0) -> tuple[str, list[int]]:
    parts = [c for o in outputs for c in o.outputs if c.index == index]
    return "".join(c.text for c in parts), [t for c in parts for t in c.token_ids]


# ---- output kinds and stream_interval -------------------------------------------------------------------


async def test_kinds_agree_also_with_a_slow_delta_consumer(llm: AsyncLLM) -> None:
    cumulative, only, fast = await asyncio.gather(
        *(
            outputs_of(llm.generate(STORY, greedy(16, kind, ignore_eos=True)))
            for kind in (CUMULATIVE, FINAL_ONLY, DELTA)
        )
    )
    slow = await outputs_of(llm.generate(STORY, greedy(16, DELTA, ignore_eos=True)), stall=llm)
    final = cumulative[-1].outputs[0]
    assert len(final.token_ids) == 16
    assert len(only) == 1
    assert (only[0].outputs[0].text, only[0].outputs[0].token_ids) == (final.text, final.token_ids)
    assert joined_delta(fast) == joined_delta(slow) == (final.text, final.token_ids)
    assert len(slow) == 2, "the stalled consumer sees the first output, then everything else merged"
    assert final.text == llm.get_tokenizer().hf.decode(final.token_ids)  # one decode of all ids


@pytest.mark.parametrize("interval", [3, 5])
async def test_stream_interval_emits_every_k_tokens_and_at_the_end(llm: AsyncLLM, interval: int) -> None:
    outputs = await outputs_of(llm.generate(STORY, greedy(13, DELTA, ignore_eos=True, stream_interval=interval)))
    sizes = [len(o.outputs[0].token_ids) for o in outputs]
    assert sizes == [interval] * (13 // interval) + ([13 % interval] if 13 % interval else [])


async def test_max_tokens_one_gives_one_token_and_one_final_output(llm: AsyncLLM) -> None:
    outputs = await outputs_of(llm.generate(STORY, greedy(1)))
    assert len(outputs) == 1
    assert outputs[0].finished
    assert len(outputs[0].outputs[0].token_ids) == 1
    assert outputs[0].outputs[0].finish_reason == "length"


# ---- n > 1 ----------------------------------------------------------------------------------------------


async def test_n_completions_share_one_stream_and_each_finishes_once(llm: AsyncLLM) -> None:
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True, output_kind=DELTA)
    cumulative_params = msgspec.structs.replace(params, output_kind=CUMULATIVE)
    alone_params = msgspec.structs.replace(params, n=1, seed=1235, output_kind=CUMULATIVE)
    outputs, cumulative, alone = await asyncio.gather(
        outputs_of(llm.generate(STORY, params, request_id="n3")),
        llm.generate(STORY, cumulative_params).collect(),
        llm.generate(STORY, alone_params).collect(),
    )
    assert {o.request_id for o in outputs} == {"n3"}
    assert [o.finished for o in outputs].count(True) == 1
    assert outputs[-1].finished
    finishes = sorted(c.index for o in outputs for c in o.outputs if c.finished)
    assert finishes == [0, 1, 2]
    assert [c.index for c in cumulative.outputs] == [0, 1, 2]
    for completion in cumulative.outputs:
        assert joined_delta(outputs, completion.index) == (completion.text, completion.token_ids)
        assert len(completion.token_ids) == 8
    assert len({tuple(c.token_ids) for c in cumulative.outputs}) == 3, "derived seeds should differ per index"
    # Child i is seeded with seed + i: a lone n=1 request with seed 1235 gives completion 1.
    assert alone.outputs[0].token_ids == cumulative.outputs[1].token_ids


async def test_aborting_an_n_request_aborts_every_completion(llm: AsyncLLM) -> None:
    params = SamplingParams(n=4, max_tokens=200, temperature=1.0, ignore_eos=True)
    stream = llm.generate("Count from one to one hundred:", params, request_id="n4")
    await stream.__anext__()
    await stream.aclose()
    await wait_until_idle(llm)
    again = await llm.generate(STORY, SamplingParams(n=2, max_tokens=2), request_id="n4").collect()
    assert [c.index for c in again.outputs] == [0, 1]


async def test_abort_by_id_ends_an_n_stream_with_abort_for_every_running_index(llm: AsyncLLM) -> None:
    params = SamplingParams(n=2, max_tokens=200, temperature=0.0, ignore_eos=True, output_kind=FINAL_ONLY)
    stream = llm.generate("Count from one to one hundred:", params, request_id="n2-abort")
    await asyncio.sleep(0.3)
    await llm.abort("n2-abort")
    result = await stream.collect()
    assert [(c.index, c.finish_reason) for c in result.outputs] == [(0, "abort"), (1, "abort")]
    await wait_until_idle(llm)


# ---- stop rules -----------------------------------------------------------------------------------------


async def greedy_reference(llm: AsyncLLM, prompt, max_tokens: int = 24) -> tuple[str, list[int]]:
    out = (await llm.generate(prompt, greedy(max_tokens, ignore_eos=True)).collect()).outputs[0]
    return out.text, out.token_ids


async def test_stop_strings_spanning_tokens_and_inside_one_token(llm: AsyncLLM) -> None:
    hf = llm.get_tokenizer().hf
    text, ids = await greedy_reference(llm, STORY, 16)
    starts = [len(hf.decode(ids[:i])) for i in range(len(ids) + 1)]
    tokens = [text[starts[i] : starts[i + 1]] for i in range(len(ids))]
    spanning = next(  # the last 2 chars of token i + the first 2 of token i + 1, first seen at that boundary
        stop
        for i in range(len(ids) - 1)
        if len(tokens[i]) >= 2 and len(tokens[i + 1]) >= 2
        if text.find(stop := tokens[i][-2:] + tokens[i + 1][:2]) == starts[i + 1] - 2
    )
    inside = next(  # the first 3 chars of a token of >= 4 chars: the stop string ends inside that token
        stop for i in range(len(ids)) if len(tokens[i]) >= 4 and text.find(stop := tokens[i][:3]) == starts[i]
    )
    for stop in (spanning, inside):
        assert stop
        assert stop in text
        cut = text.index(stop)
        for include in (False, True):
            params = {"stop": [stop], "include_stop_str_in_output": include}
            streamed, whole_output = await asyncio.gather(
                outputs_of(llm.generate(STORY, greedy(16, DELTA, ignore_eos=True, **params))),
                llm.generate(STORY, greedy(16, FINAL_ONLY, ignore_eos=True, **params)).collect(),
            )
            whole = whole_output.outputs[0]
            expected = text[: cut + len(stop)] if include else text[:cut]
            assert joined_delta(streamed)[0] == whole.text == expected
            assert (whole.finish_reason, whole.stop_reason) == ("stop", stop)
            if not include:  # text that could still become the stop string was never emitted
                assert all(stop not in o.outputs[0].text for o in streamed)
    await wait_until_idle(llm)


async def test_stop_token_ids_eos_ignore_eos_and_min_tokens(llm: AsyncLLM) -> None:
    eos = llm.get_tokenizer().eos_token_id
    answer = (await llm.generate(PARIS, greedy(40)).collect()).outputs[0]
    assert (answer.finish_reason, answer.stop_reason) == ("stop", None)
    assert answer.token_ids[-1] == eos
    n = len(answer.token_ids)
    stop_id = answer.token_ids[2]
    by_id_out, ignoring_out, longer_out = await asyncio.gather(
        llm.generate(PARIS, greedy(40, stop_token_ids=[stop_id])).collect(),
        llm.generate(PARIS, greedy(n + 5, ignore_eos=True)).collect(),
        llm.generate(PARIS, greedy(40, min_tokens=n + 3)).collect(),
    )
    by_id, ignoring, longer = by_id_out.outputs[0], ignoring_out.outputs[0], longer_out.outputs[0]
    assert by_id.token_ids == answer.token_ids[: answer.token_ids.index(stop_id) + 1]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", stop_id)
    assert len(ignoring.token_ids) == n + 5
    assert ignoring.finish_reason == "length"
    assert len(longer.token_ids) >= n + 3
    assert eos not in longer.token_ids[: n + 3], "EOS is masked before min_tokens"


async def test_characters_split_across_tokens_never_show_as_replacement_chars(llm: AsyncLLM) -> None:
    hf = llm.get_tokenizer().hf
    prompt = [{"role": "user", "content": "Write a happy message full of emojis \U0001f600\U0001f389:"}]
    outputs = await outputs_of(llm.generate(prompt, greedy(24, DELTA, ignore_eos=True)))
    deltas = [o.outputs[0].text for o in outputs]
    ids = [t for o in outputs for t in o.outputs[0].token_ids]
    assert sum(hf.decode([t]) == "\ufffd" for t in ids) >= 2, "the model should emit characters split across tokens"
    assert "".join(deltas) == hf.decode(ids)
    # Only the final flush may hold U+FFFD, when max_tokens cuts a character in half.
    assert all("\ufffd" not in delta for delta in deltas[:-1])
    assert "\ufffd" not in deltas[-1].rstrip("\ufffd")


# ---- logprobs -------------------------------------------------------------------------------------------


async def test_logprobs_per_token_match_the_reference_forward(llm: AsyncLLM, reference_model) -> None:
    k = 3
    prompt_ids = llm.get_tokenizer().encode(STORY)
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=7, logprobs=k, prompt_logprobs=2, output_kind=DELTA)
    outputs = await outputs_of(llm.generate({"prompt_token_ids": prompt_ids}, params))
    for out in outputs:
        completion = out.outputs[0]
        assert completion.logprobs is not None
        assert len(completion.logprobs) == len(completion.token_ids)
    ids = [t for o in outputs for t in o.outputs[0].token_ids]
    logprobs = [d for o in outputs for d in o.outputs[0].logprobs or []]
    ref = next_token_logits(reference_model, prompt_ids + ids).log_softmax(dim=-1)
    hf = llm.get_tokenizer().hf
    for i, (token, entry) in enumerate(zip(ids, logprobs, strict=True)):
        row = ref[len(prompt_ids) - 1 + i]
        assert token in entry
        assert k <= len(entry) <= k + 1
        top = row.topk(k)
        assert set(top.indices.tolist()) <= set(entry)
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=2e-3)
        assert entry[token].rank == 1 + int((row > row[token] + 1e-4).sum())
        assert entry[token].decoded_token == hf.decode([token], skip_special_tokens=False)
    assert outputs[-1].outputs[0].cumulative_logprob == pytest.approx(
        sum(d[t].logprob for d, t in zip(logprobs, ids, strict=True))
    )
    prompt_logprobs = outputs[0].prompt_logprobs
    assert prompt_logprobs is not None
    assert len(prompt_logprobs) == len(prompt_ids)
    assert prompt_logprobs[0] is None
    for j in range(1, len(prompt_ids)):
        entry = prompt_logprobs[j]
        assert entry is not None
        assert entry[prompt_ids[j]].logprob == pytest.approx(ref[j - 1, prompt_ids[j]].item(), abs=2e-3)
    assert all(o.prompt_logprobs is None for o in outputs[1:]), "DELTA sends prompt logprobs once"


async def test_greedy_logprobs_rank_one_and_sampled_token_outside_top_k_is_included(llm: AsyncLLM) -> None:
    cumulative = await outputs_of(llm.generate(STORY, greedy(6, logprobs=0, ignore_eos=True)))
    for out in cumulative:
        assert out.outputs[0].logprobs is not None
        assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)
    result = await llm.generate(STORY, greedy(6, logprobs=0, ignore_eos=True)).collect()
    completion = result.outputs[0]
    assert completion.logprobs is not None
    assert [list(d) for d in completion.logprobs] == [[t] for t in completion.token_ids]
    assert {d[t].rank for d, t in zip(completion.logprobs, completion.token_ids, strict=True)} == {1}
    # Force an unlikely token with logit_bias: it is sampled, and listed with its raw (low) rank.
    forced = await llm.generate(STORY, greedy(1, logprobs=2, logit_bias={1000: 100.0})).collect()
    entry = forced.outputs[0].logprobs[0]
    assert forced.outputs[0].token_ids == [1000]
    assert len(entry) == 3
    assert entry[1000].rank > 2


# ---- seeds and determinism ------------------------------------------------------------------------------


async def test_greedy_is_deterministic_and_seeded_requests_are_batch_independent(llm: AsyncLLM) -> None:
    first, second = await greedy_reference(llm, STORY, 12), await greedy_reference(llm, STORY, 12)
    assert first == second
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    alone = (await llm.generate(STORY, seeded).collect()).outputs[0].token_ids
    others = [
        llm.generate(f"Tell me about {topic}.", SamplingParams(max_tokens=16, temperature=1.0))
        for topic in ("cats", "rain", "ships")
    ]
    in_batch, *_ = await asyncio.gather(llm.generate(STORY, seeded).collect(), *(s.collect() for s in others))
    assert in_batch.outputs[0].token_ids == alone


# ---- validation at submission, request ids, collect() ---------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", None, "empty"),
        ({"prompt_token_ids": []}, None, "empty"),
        ({"prompt_token_ids": [1] * MAX_MODEL_LEN}, None, f"at most {MAX_MODEL_LEN - 1} fit"),
        ({"prompt_token_ids": [1] * (MAX_MODEL_LEN - 10)}, SamplingParams(max_tokens=11), "at most 10 here"),
        ({"prompt_token_ids": [1, 49152]}, None, "outside the vocabulary"),
        ("Hi", SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
async def test_bad_requests_are_rejected_at_submission_and_the_engine_keeps_serving(
    llm: AsyncLLM, prompt, params, match: str
) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(prompt, params)
    stats = await llm.get_scheduler_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0
    fits = await llm.generate({"prompt_token_ids": [1] * (MAX_MODEL_LEN - 10)}, greedy(10, ignore_eos=True)).collect()
    assert len(fits.outputs[0].token_ids) == 10


async def test_a_duplicate_in_flight_request_id_is_a_second_request_and_leaves_the_first_alone(
    llm: AsyncLLM,
) -> None:
    first = llm.generate(STORY, greedy(8, ignore_eos=True), request_id="dup")
    second = llm.generate("Hi", greedy(4, ignore_eos=True), request_id="dup")
    third = llm.generate("Hi", SamplingParams(n=2, max_tokens=4, ignore_eos=True), request_id="dup")
    result = await first.collect()
    assert (result.request_id, len(result.outputs[0].token_ids)) == ("dup", 8)
    assert [len(c.token_ids) for c in (await second.collect()).outputs] == [4]
    assert [len(c.token_ids) for c in (await third.collect()).outputs] == [4, 4]
    reused = await llm.generate("Hi", greedy(2), request_id="dup").collect()
    assert reused.finished
    ids = {llm.generate("Hi", greedy(1)).request_id for _ in range(3)}
    assert len(ids) == 3
    await wait_until_idle(llm)


async def test_collect_returns_the_final_output_with_usage(llm: AsyncLLM) -> None:
    prompt_ids = llm.get_tokenizer().encode(STORY)
    result = await llm.generate(
        STORY, SamplingParams(n=2, max_tokens=5, seed=3, ignore_eos=True, logprobs=1, output_kind=DELTA)
    ).collect()
    assert result.finished
    assert [len(c.token_ids) for c in result.outputs] == [5, 5]
    assert all(c.logprobs is not None and len(c.logprobs) == 5 for c in result.outputs)
    assert all(c.finish_reason == "length" for c in result.outputs)
    assert result.usage is not None
    assert (result.usage.num_prompt_tokens, result.usage.num_generated_tokens) == (len(prompt_ids), 10)
    assert result.usage.num_cached_tokens == result.num_cached_tokens
    long_prompt = {"prompt_token_ids": list(range(1000, 1040))}  # 2 full blocks of 16 cached after the first run
    first = await llm.generate(long_prompt, greedy(1)).collect()
    second = await llm.generate(long_prompt, greedy(1)).collect()
    assert first.usage is not None
    assert second.usage is not None
    assert (first.usage.num_prompt_tokens, second.usage.num_cached_tokens) == (40, 32)


async def test_logit_bias_and_allowed_token_ids_steer_the_real_model(llm: AsyncLLM) -> None:
    hf = llm.get_tokenizer().hf
    yes, no = hf.encode(" yes").ids[0], hf.encode(" no").ids[0]
    allowed = await llm.generate(
        STORY, SamplingParams(max_tokens=6, temperature=1.0, allowed_token_ids=[yes, no])
    ).collect()
    assert set(allowed.outputs[0].token_ids) <= {yes, no}
    biased = await llm.generate(STORY, greedy(3, logit_bias={no: 100.0}, ignore_eos=True)).collect()
    assert biased.outputs[0].token_ids == [no, no, no]
    plain = (await llm.generate("one one one one one one", greedy(8, ignore_eos=True)).collect()).outputs[0].token_ids
    penalized = await llm.generate(
        "one one one one one one", greedy(8, ignore_eos=True, repetition_penalty=2.0, frequency_penalty=1.0)
    ).collect()
    one = hf.encode(" one").ids[0]
    assert penalized.outputs[0].token_ids.count(one) < max(plain.count(one), 1)
