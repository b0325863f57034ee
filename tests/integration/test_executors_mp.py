"""The `mp` executor on the real SmolLM2-135M-Instruct: same greedy tokens as `uni` at TP=1, TP=3 equal to TP=1
where the greedy choice is clear, collective_rpc to every worker, and a killed worker -> EngineDeadError."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest
import pytest_asyncio
import torch

from asyncllm import AsyncLLM, PoolingParams, SamplingParams
from asyncllm.errors import ConfigError, EngineDeadError, EngineGenerateError
from tests.integration.executor_helpers import MAX_TOKENS, PROMPTS, engine_args, greedy_ids, pid_alive, wait_gone
from tests.reference import clear_prefix_len, greedy_margins

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.mp]

MARGIN = 0.05  # logits; below this a greedy choice may flip with fp32 summation order (TP sums partials)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mp_tp1(model_path: str):
    async with AsyncLLM.from_engine_args(engine_args(model_path, distributed_executor_backend="mp")) as llm:
        yield llm


async def test_mp_tp1_greedy_ids_equal_uni(mp_tp1: AsyncLLM, uni_ids: list[list[int]]) -> None:
    assert await greedy_ids(mp_tp1, PROMPTS) == uni_ids
    assert all(len(ids) == MAX_TOKENS for ids in uni_ids)


async def test_collective_rpc_reaches_the_worker_process(mp_tp1: AsyncLLM) -> None:
    pids = await mp_tp1.collective_rpc("get_pid")
    assert len(pids) == 1
    assert pids[0] != os.getpid()
    assert pid_alive(pids[0])
    info = await mp_tp1.collective_rpc("get_model_info")
    assert len(info) == 1
    assert info[0][1] == 49152  # SmolLM2's vocab size, from the worker process


async def test_collective_rpc_timeout_fails_the_call_only(mp_tp1: AsyncLLM) -> None:
    """A call that outlives its timeout raises; its late reply is discarded and the next calls and requests work."""
    with pytest.raises(EngineGenerateError, match="did not answer warm_up in time"):
        await mp_tp1.collective_rpc("warm_up", kwargs={"num_tokens": 256}, timeout=0.001)
    assert len(await mp_tp1.collective_rpc("get_pid")) == 1
    assert (await greedy_ids(mp_tp1, PROMPTS[:1]))[0]


async def test_tp3_equals_tp1_where_the_choice_is_clear(
    model_path: str, uni_ids: list[list[int]], mp_tp1: AsyncLLM, reference_model: Any
) -> None:
    reference = reference_model
    tokenizer_prompts = [mp_tp1.get_tokenizer().encode(p) for p in PROMPTS]
    async with AsyncLLM.from_engine_args(
        engine_args(model_path, distributed_executor_backend="mp", tensor_parallel_size=3)
    ) as llm:
        pids = await llm.collective_rpc("get_pid")
        assert len(set(pids)) == 3
        tp3_ids = await greedy_ids(llm, PROMPTS)
        # Prompt embeddings (bytes in the workers' RPC) and pooling reach every rank alike.
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        embeds = reference.embed(torch.tensor(tokenizer_prompts[0]))
        tp3_embeds_ids = (await llm.generate({"prompt_embeds": embeds}, params).collect()).outputs[0].token_ids
        tp3_vectors = await llm.encode(PROMPTS, PoolingParams(pooling="mean"))
    tp1_vectors = await mp_tp1.encode(PROMPTS, PoolingParams(pooling="mean"))
    for tp3, tp1 in zip(tp3_vectors, tp1_vectors, strict=True):
        assert max(abs(a - b) for a, b in zip(tp3.embedding, tp1.embedding, strict=True)) < 1e-4
    num_compared = 0
    for prompt_ids, expected, got in zip(tokenizer_prompts, uni_ids, tp3_ids, strict=True):
        clear = clear_prefix_len(greedy_margins(reference, prompt_ids, expected), MARGIN)
        assert got[:clear] == expected[:clear]
        num_compared += clear
    assert num_compared >= MAX_TOKENS  # the comparison covered real tokens
    clear = clear_prefix_len(greedy_margins(reference, tokenizer_prompts[0], uni_ids[0]), MARGIN)
    assert clear > 0
    assert tp3_embeds_ids[:clear] == uni_ids[0][:clear]
    assert wait_gone(pids, within=10.0) == []


async def test_tp2_is_rejected_with_a_clear_error(model_path: str) -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 does not divide.*valid sizes.*\[1, 3\]"):
        AsyncLLM.from_engine_args(engine_args(model_path, distributed_executor_backend="mp", tensor_parallel_size=2))


async def test_uni_rejects_tp_above_one(model_path: str) -> None:
    with pytest.raises(ConfigError, match="needs distributed_executor_backend='mp'"):
        AsyncLLM.from_engine_args(engine_args(model_path, tensor_parallel_size=3))


@pytest.mark.parametrize(("tp", "victim_rank"), [(1, 0), (3, 1)])
async def test_killed_worker_fails_open_streams_fast_and_leaves_no_orphans(
    model_path: str, tp: int, victim_rank: int
) -> None:
    """Random weights (`dummy`) are enough here: what is tested is processes and sockets, not tokens."""
    args = engine_args(model_path, distributed_executor_backend="mp", tensor_parallel_size=tp, load_format="dummy")
    llm = AsyncLLM.from_engine_args(args)
    engine_pid = llm._client.process.pid  # type: ignore[attr-defined]
    try:
        worker_pids = await llm.collective_rpc("get_pid")
        assert len(worker_pids) == tp
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        streams = [llm.generate(p, params) for p in PROMPTS]
        first = await streams[0].__anext__()  # streaming has started
        assert len(first.outputs[0].token_ids) >= 1
        os.kill(worker_pids[victim_rank], signal.SIGKILL)
        killed_at = time.monotonic()
        for stream in streams:
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
        assert time.monotonic() - killed_at < 5.0
        assert llm.errored
    finally:
        started = time.monotonic()
        await llm.shutdown()
        assert time.monotonic() - started < 10.0
    assert wait_gone([engine_pid, *worker_pids], within=5.0) == []


@pytest.mark.parametrize("engine_process", [True, False], ids=["process", "thread"])
async def test_worker_killed_while_idle_marks_the_engine_dead(model_path: str, engine_process: bool) -> None:
    """No step is running: the executor's death watcher wakes the idle engine loop (failure callback)."""
    args = engine_args(
        model_path, distributed_executor_backend="mp", load_format="dummy", engine_process=engine_process
    )
    llm = AsyncLLM.from_engine_args(args)
    try:
        (worker_pid,) = await llm.collective_rpc("get_pid")
        os.kill(worker_pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while not llm.errored and time.monotonic() < deadline:  # noqa: ASYNC110 (polling a property)
            await asyncio.sleep(0.05)
        assert llm.errored
        with pytest.raises(EngineDeadError):
            await llm.generate("Hello", SamplingParams(max_tokens=4)).collect()
    finally:
        await llm.shutdown()
