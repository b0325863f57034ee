"""vLLM's synchronous `LLM` on asyncllm: `LLM(model=...).generate(prompts, params)` -> a list of `RequestOutput`s in
the prompts' order, and `chat()`, on the real model (engine in a thread)."""

from __future__ import annotations

import asyncio

import pytest

from asyncllm import LLM, InvalidRequestError, RequestOutput, SamplingParams
from asyncllm.inputs import TokensPrompt

PROMPTS = ["Hello, my name is", "The capital of France is", "The future of AI is"]


@pytest.fixture(scope="module")
def sync_llm(model_path: str):
    """vLLM's synchronous `LLM`, built as vLLM's docs build it (the class under test, so not `make_llm`)."""
    with LLM(model=model_path, engine_process=False, num_kv_blocks=64, quantization=None) as engine:  # float32: "Paris"
        yield engine


def test_generate_returns_one_finished_output_per_prompt_in_order(sync_llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = sync_llm.generate(PROMPTS, greedy)
    assert [type(o) for o in outputs] == [RequestOutput] * 3
    assert [o.prompt for o in outputs] == PROMPTS
    assert all(o.finished for o in outputs)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        (alone,) = sync_llm.generate(prompt, greedy)  # one prompt: a list of one, as vLLM
        assert alone.outputs[0].token_ids == output.outputs[0].token_ids
        assert len(output.outputs[0].token_ids) == 8
        assert output.outputs[0].text == sync_llm.get_tokenizer().decode(output.outputs[0].token_ids)


def test_generate_takes_one_params_per_prompt_and_token_prompts(sync_llm: LLM) -> None:
    ids = sync_llm.get_tokenizer().encode(PROMPTS[1])
    outputs = sync_llm.generate(
        [PROMPTS[1], TokensPrompt(prompt_token_ids=ids)],
        [SamplingParams(temperature=0.0, max_tokens=3), SamplingParams(temperature=0.0, max_tokens=5)],
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 5]
    assert outputs[1].outputs[0].token_ids[:3] == outputs[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="2 entries for 3 prompts"):
        sync_llm.generate(PROMPTS, [SamplingParams(), SamplingParams()])


def test_chat_answers_each_conversation(sync_llm: LLM) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    (answer,) = sync_llm.chat(question, SamplingParams(temperature=0.0, max_tokens=12))
    assert "Paris" in answer.outputs[0].text
    both = sync_llm.chat([question, question], SamplingParams(temperature=0.0, max_tokens=12))
    assert [o.outputs[0].text for o in both] == [answer.outputs[0].text] * 2
    with pytest.raises(InvalidRequestError, match="continue_final_message"):
        sync_llm.chat(question, continue_final_message=True)


def test_an_llm_works_from_inside_a_running_event_loop(sync_llm: LLM) -> None:
    async def inside() -> list[RequestOutput]:
        return sync_llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2))

    (output,) = asyncio.run(inside())
    assert len(output.outputs[0].token_ids) == 2


def test_get_metrics_reads_the_engines_metrics_back_as_objects(sync_llm: LLM) -> None:
    from asyncllm.metrics.reader import Counter, Histogram

    before = {
        m.name: m
        for m in sync_llm.get_metrics()
        if isinstance(m, Counter | Histogram) and not m.labels.keys() - {"model_name"}
    }
    sync_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    after = {
        m.name: m
        for m in sync_llm.get_metrics()
        if isinstance(m, Counter | Histogram) and not m.labels.keys() - {"model_name"}
    }
    generated = after["asyncllm:generation_tokens"]
    assert isinstance(generated, Counter)
    assert generated.value - before["asyncllm:generation_tokens"].value == 12  # 3 prompts x 4 tokens
    for name in ("e2e_request_latency_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        latency = after[f"asyncllm:{name}"]
        assert isinstance(latency, Histogram)
        assert latency.count - before[f"asyncllm:{name}"].count == 3
    tokens = after["asyncllm:request_generation_tokens"]
    assert isinstance(tokens, Histogram)
    assert tokens.sum - before["asyncllm:request_generation_tokens"].sum == 12


def test_encode_embeds_each_prompt_in_order(sync_llm: LLM) -> None:
    vectors = sync_llm.encode(PROMPTS)
    (alone,) = sync_llm.encode(PROMPTS[1])
    assert [len(v.embedding) for v in vectors] == [576] * 3  # SmolLM2-135M's hidden size
    assert vectors[1].embedding == pytest.approx(alone.embedding, abs=1e-5)
    assert vectors[0].embedding != pytest.approx(vectors[1].embedding, abs=1e-3)
    assert sum(x * x for x in vectors[0].embedding) == pytest.approx(1.0, abs=1e-4)  # normalized by default
