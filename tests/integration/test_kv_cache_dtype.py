"""`kv_cache_dtype="bfloat16"` on the real SmolLM2-135M-Instruct: greedy outputs close to the float32 cache's, and
the same guarantees the float32 cache keeps (batch == solo, chunked prefill == whole prefill, prefix-cache hit ==
miss); twice the blocks in one memory budget; the setting crosses to an engine process.

Outputs of one bf16 engine are compared with another bf16 engine's as `test_scheduler_features` compares float32
engines: identical token ids, except from a near-tie of the reference's greedy choice (a different batch shape or
chunking changes float32 summation order). The bf16 cache against the float32 cache is a different model numerically
(K/V rounded to 8 mantissa bits, bfloat16 prefill attention), so that comparison measures closeness instead:
teacher-forced logprobs on the same token sequences within `TEACHER_FORCED_BOUND`.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from asyncllm import AsyncLLM
from tests.integration.conftest import greedy, wait_until_idle
from tests.integration.test_scheduler_features import (
    QUESTIONS,
    SHORT_PROMPTS,
    assert_same_greedy,
    chat,
    run_all,
    run_one,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

BF16 = {"kv_cache_dtype": "bfloat16", "engine_process": False}
TOKENS = 32
# Teacher-forced over the 8 prompts below with the float32 cache's 32 greedy tokens appended (EOS ignored): the bf16
# cache's prompt logprobs against the float32 cache's, by weights: (largest mean |delta logprob| of the sequence's own
# next token, smallest top-1 agreement). Measured 2026-12-05 on an AMD EPYC with AVX512_BF16 (the prefill kernel's
# bfloat16 products), busy: fp32 weights 0.0053 and 98.8%, int8 weights 0.074 and 95.8% (int8's per-row activation
# quantization amplifies small changes; these short chat sequences differ more than long prose does:
# `benchmarks/kv_cache_accuracy.py`). The bounds leave about twice that (the tests below hold a cache that loses or
# misplaces K/V to the same tokens). Greedy agreement up to the first divergence, asserted before, was a noisier
# measure (fp32 weights 84.8% and 100% on the same code).
TEACHER_FORCED_BOUND = {None: (0.012, 0.97), "int8": (0.15, 0.92)}


def prompts() -> list:
    return [chat(q) for q in QUESTIONS] + SHORT_PROMPTS


async def prompt_logprobs(llm: AsyncLLM, sequences: list[list[int]]) -> list[list[tuple[float, int]]]:
    """Per sequence, per position after the first: (logprob of the sequence's next token, the most likely token)."""
    params = greedy(1, prompt_logprobs=1)
    outs = await run_all(llm, [{"prompt_token_ids": ids} for ids in sequences], params)
    rows = []
    for ids, out in zip(sequences, outs, strict=True):
        per = []
        for token, logprobs in zip(ids[1:], out.prompt_logprobs[1:], strict=True):
            per.append((logprobs[token].logprob, max(logprobs.items(), key=lambda item: item[1].logprob)[0]))
        rows.append(per)
    return rows


def compare(expected: list, got: list) -> tuple[float, float]:
    """(mean |delta logprob|, top-1 agreement) over every position."""
    pairs = [(a, b) for want, have in zip(expected, got, strict=True) for a, b in zip(want, have, strict=True)]
    return sum(abs(a[0] - b[0]) for a, b in pairs) / len(pairs), sum(a[1] == b[1] for a, b in pairs) / len(pairs)


@pytest.mark.parametrize("quantization", [None, "int8"])
async def test_bf16_cache_agrees_with_the_float32_cache(make_llm, caplog, quantization: str | None) -> None:
    fp32 = make_llm(  # "float32" named: "auto" gives int8 weights a bfloat16 cache on CPUs with AVX512_BF16
        engine_process=False,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
        quantization=quantization,
        kv_cache_dtype="float32",
    )
    generated = await run_all(fp32, prompts(), greedy(TOKENS, ignore_eos=True))
    sequences = [list(out.prompt_token_ids) + list(out.outputs[0].token_ids) for out in generated]
    assert all(len(out.outputs[0].token_ids) == TOKENS for out in generated)
    expected = await prompt_logprobs(fp32, sequences)
    fp32_stats = await fp32.get_scheduler_stats()
    await asyncio.to_thread(fp32.shutdown)
    with caplog.at_level(logging.INFO, logger="asyncllm.worker.worker"):
        bf16 = make_llm(max_num_batched_tokens=4096, enable_prefix_caching=False, quantization=quantization, **BF16)
    assert any("KV cache: 128 blocks" in r.message and "bfloat16" in r.message for r in caplog.records)
    got = await prompt_logprobs(bf16, sequences)
    stats = await bf16.get_scheduler_stats()
    assert stats.num_total_blocks == fp32_stats.num_total_blocks == 128  # num_kv_blocks fixed by the test defaults
    assert stats.kv_cache_bytes * 2 == fp32_stats.kv_cache_bytes  # half the bytes for the same blocks
    mean, top1 = compare(expected, got)
    weights = quantization or "fp32"
    print(f"{weights} weights, bf16 vs float32 KV cache: mean |dlogprob| {mean:.4f}, top-1 agreement {top1:.2%}")
    bound_mean, bound_top1 = TEACHER_FORCED_BOUND[quantization]
    assert mean <= bound_mean, f"mean |delta logprob| {mean:.4f} > {bound_mean} (top-1 agreement {top1:.2%})"
    assert top1 >= bound_top1, f"top-1 agreement {top1:.2%} < {bound_top1:.0%} (mean |delta logprob| {mean:.4f})"
    assert mean > 0  # the caches really differ: the bf16 engine rounded K/V


async def test_bf16_cache_batch_equals_solo(make_llm, reference_model) -> None:
    params = greedy(TOKENS, ignore_eos=True)
    llm = make_llm(max_num_batched_tokens=4096, enable_prefix_caching=False, **BF16)
    solo = [await run_one(llm, p, params) for p in prompts()]
    batch = await run_all(llm, prompts(), params)
    assert_same_greedy(reference_model, solo, batch)
    await wait_until_idle(llm)


async def test_bf16_cache_chunked_prefill_and_prefix_hits_equal_whole_prefill(make_llm, reference_model) -> None:
    """Chunks of 16 read their prefix back from the bf16 cache; prefix-cache hits read whole blocks written by
    another request; both must give the tokens of one whole prefill, which reads none of its K/V back."""
    params = greedy(12)
    whole = make_llm(max_num_batched_tokens=4096, enable_prefix_caching=False, **BF16)
    baseline = await run_all(whole, [chat(q) for q in QUESTIONS], params)
    await asyncio.to_thread(whole.shutdown)

    chunked = make_llm(max_num_batched_tokens=16, enable_prefix_caching=False, **BF16)
    got = await run_all(chunked, [chat(q) for q in QUESTIONS], params)
    assert all(len(out.prompt_token_ids) > 3 * 16 for out in got)  # the prompts really were chunked
    assert_same_greedy(reference_model, baseline, got)
    await asyncio.to_thread(chunked.shutdown)

    cached = make_llm(max_num_batched_tokens=4096, **BF16)  # prefix caching on (the default)
    hits = [await run_one(cached, chat(q), params) for q in QUESTIONS]  # one after another: later ones hit
    assert hits[0].num_cached_tokens == 0
    assert all(out.num_cached_tokens >= 48 for out in hits[1:])
    again = await run_one(cached, chat(QUESTIONS[0]), params)  # all but the last token cached
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16
    assert_same_greedy(reference_model, baseline, hits)
    assert_same_greedy(reference_model, baseline[:1], [again])
    await wait_until_idle(cached)


async def test_a_memory_budget_holds_twice_the_blocks_in_bf16(make_llm) -> None:
    budget = 64 * 737_280  # 64 float32 blocks of SmolLM2-135M (30 layers, 3 K/V heads of 64, 16 tokens)
    fp32 = make_llm(engine_process=False, num_kv_blocks=None, kv_cache_memory_bytes=budget)
    fp32_stats = await fp32.get_scheduler_stats()
    await asyncio.to_thread(fp32.shutdown)
    bf16 = make_llm(num_kv_blocks=None, kv_cache_memory_bytes=budget, **BF16)
    stats = await bf16.get_scheduler_stats()
    assert (fp32_stats.num_total_blocks, stats.num_total_blocks) == (64, 128)
    assert stats.kv_cache_bytes == fp32_stats.kv_cache_bytes == budget


@pytest.mark.mp
async def test_bf16_cache_in_an_engine_process(make_llm) -> None:
    llm: AsyncLLM = make_llm(kv_cache_dtype="bfloat16", engine_process=True)
    assert llm.config.cache.cache_dtype == "bfloat16"
    out = await run_one(llm, "The capital of France is", greedy(8, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 8
    assert "Paris" in out.outputs[0].text
    stats = await llm.get_scheduler_stats()
    assert stats.kv_cache_bytes == 128 * 737_280 // 2
    (info,) = [m for m in llm.get_metrics() if m.name == "asyncllm:cache_config_info"]  # vLLM's gauge and label
    assert (info.labels["cache_dtype"], info.labels["num_gpu_blocks"], info.value) == ("bfloat16", "128", 1.0)


@pytest.mark.mp
async def test_bf16_cache_at_tp3_equals_tp1(make_llm, reference_model) -> None:
    """Each of 3 `mp` ranks allocates its one K/V head's bf16 cache; greedy tokens equal TP=1's up to near-ties (TP
    sums partial products in another order)."""
    params = greedy(16, ignore_eos=True)
    tp1 = make_llm(max_num_batched_tokens=4096, **BF16)
    expected = await run_all(tp1, SHORT_PROMPTS, params)
    await asyncio.to_thread(tp1.shutdown)
    tp3 = make_llm(
        kv_cache_dtype="bfloat16",
        distributed_executor_backend="mp",
        tensor_parallel_size=3,
        max_num_batched_tokens=4096,
    )
    stats = await tp3.get_scheduler_stats()
    assert stats.kv_cache_bytes == 128 * 737_280 // 2  # the three ranks' shares together
    got = await run_all(tp3, SHORT_PROMPTS, params)
    assert_same_greedy(reference_model, expected, got)


@pytest.mark.slow
async def test_gemma3_sliding_windows_on_a_bf16_cache(make_llm) -> None:
    """Gemma 3 270M (local layers with a 512-token window beside global ones; head_dim 256): a 700-token prompt in
    chunks of 64 crosses the window (padded, masked bf16 SDPA for the local layers; the decode kernel's window),
    then comes back from the prefix cache and in a batch with the same continuation; a short prompt gives the
    float32 cache's text (HF's, `test_gemma3_engine`)."""
    from tests.integration.test_gemma3_engine import FRANCE, FRANCE_CONTINUATION
    from tests.integration.test_gemma3_parity import LONG_TEXT

    llm = make_llm(model="gemma-3-270m", max_model_len=1024, num_kv_blocks=70, max_num_batched_tokens=64, **BF16)
    out = await run_one(llm, FRANCE, greedy(9))
    assert out.outputs[0].text.startswith(FRANCE_CONTINUATION)
    ids = llm.get_tokenizer().encode(LONG_TEXT * 12)[:700]
    prompt = {"prompt_token_ids": ids}
    first = await run_one(llm, prompt, greedy(12))
    again = await run_one(llm, prompt, greedy(12))
    assert again.num_cached_tokens >= 640
    batched = await run_all(llm, [{"prompt_token_ids": ids[:650] + ids[:50]}, FRANCE, prompt], greedy(12))
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == batched[2].outputs[0].token_ids
    assert len(set(first.outputs[0].token_ids)) > 3  # a real continuation, not one token repeated
    await wait_until_idle(llm)
