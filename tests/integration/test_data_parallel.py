"""Data parallelism (`data_parallel_size=2`, backend "mp") on the real SmolLM2 model: requests split over two
engine-core processes, greedy outputs equal one engine's, prefix-cache affinity, pinning, aborts, stats per
engine, scaling while streaming, and engine death (client dead, or only that engine's requests fail with
`restart_dead_engines=True`)."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from asyncllm import AsyncLLM, EngineArgs, EngineDeadError, EngineGenerateError, SamplingParams
from asyncllm.engine.dp_client import DPEngineCoreClient
from asyncllm.errors import ConfigError, InvalidRequestError
from tests import state_probes
from tests.integration.conftest import EngineFactory, greedy

pytestmark = pytest.mark.mp
# The default weights (the file's own Q4_1 blocks, ~0.45 GB per engine process) rather than float32 (~2.5 GB): this
# module keeps three engines for its whole run while its tests start two or three more, and in float32 that took a
# fresh-clone CI run on a 24 GB host to its OOM killer. Data parallelism is the same on either.
WEIGHTS = {"quantization": "auto"}
PROMPTS = [f"Question {i}: what is {i} plus {i * 3}? Answer:" for i in range(32)]


def dp_args(model_path: str, size: int = 2, **kw) -> EngineArgs:
    return EngineArgs(model=model_path, data_parallel_size=size, num_kv_blocks=128, **{**WEIGHTS, **kw})


def client(llm: AsyncLLM) -> DPEngineCoreClient:
    assert isinstance(llm._client, DPEngineCoreClient)
    return llm._client


def is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


@pytest.fixture(scope="module")
def single(model_path: str) -> Iterator[AsyncLLM]:
    """One engine (its own process, `ENGINE_DEFAULTS`): the reference and the one-rank case."""
    factory = EngineFactory(model_path)
    yield factory(**WEIGHTS)
    factory.close()


@pytest.fixture(scope="module")
def dp(model_path: str) -> Iterator[AsyncLLM]:
    """Two engine processes behind one client (`ENGINE_DEFAULTS`, data_parallel_size=2)."""
    factory = EngineFactory(model_path)
    yield factory(data_parallel_size=2, **WEIGHTS)
    factory.close()


@pytest.fixture(scope="module")
def reference(single: AsyncLLM) -> dict[str, list[int]]:
    """Greedy token ids of every prompt on one engine (the same 32 requests, concurrently)."""

    async def body() -> dict[str, list[int]]:
        outputs = await _run_all(single, PROMPTS, greedy(16))
        return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outputs, strict=True)}

    return anyio.run(body)


def engine_of(llm: AsyncLLM, user_id: str) -> int | None:
    """The engine rank holding the one in-flight request submitted with `user_id` (the client keys requests by
    their internal ids)."""
    (internal_id,) = state_probes.internal_ids_of(llm._output_processor, user_id)
    return state_probes.engine_of(client(llm), internal_id)


async def _run_all(llm: AsyncLLM, prompts: list[str], params: SamplingParams, ranks: list[int] | None = None):
    streams = [llm.generate(p, params) for p in prompts]
    if ranks is not None:
        ranks.extend(engine_of(llm, s.request_id) for s in streams)
    results: list = [None] * len(streams)

    async def collect(i: int) -> None:
        results[i] = await streams[i].collect()

    async with anyio.create_task_group() as tg:
        for i in range(len(streams)):
            tg.start_soon(collect, i)
    return results


async def test_32_requests_split_over_both_engines_with_greedy_outputs_of_one_engine(dp, reference) -> None:
    ranks: list[int] = []
    outputs = await _run_all(dp, PROMPTS, greedy(16), ranks)
    counts = Counter(ranks)
    assert set(counts) == {0, 1}
    assert min(counts.values()) > 32 * 0.25, counts
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.outputs[0].token_ids == reference[prompt], prompt
    per_engine = await dp.get_scheduler_stats_per_engine()
    assert sorted(per_engine) == [0, 1]
    assert [s.engine_index for s in per_engine.values()] == [0, 1]
    assert all(s.num_prefix_cache_queries > 0 for s in per_engine.values())  # both engines computed prompts
    total = await dp.get_scheduler_stats()
    assert total.num_total_blocks == 256 == sum(s.num_total_blocks for s in per_engine.values())
    queries = sum(s.num_prefix_cache_queries for s in per_engine.values())
    assert total.num_prefix_cache_queries == queries
    registry, model = dp.prometheus_registry, dp.config.model.model
    for rank in ("0", "1"):  # each engine's scheduler metrics under its own `engine` label
        labels = {"model_name": model, "engine": rank}
        assert registry.get_sample_value("asyncllm:prefix_cache_queries_total", labels) > 0


async def test_a_shared_200_token_prefix_follows_its_engine_and_hits_the_prefix_cache(dp) -> None:
    prefix = [(i * 37) % 5000 + 100 for i in range(200)]

    first = dp.generate({"prompt_token_ids": [*prefix, 11, 12]}, greedy(4), data_parallel_rank=1)
    assert engine_of(dp, first.request_id) == 1
    await first.collect()
    # Both engines are idle: without affinity the tie would go to rank 0.
    second = dp.generate({"prompt_token_ids": [*prefix, 21, 22, 23]}, greedy(4))
    assert engine_of(dp, second.request_id) == 1
    output = await second.collect()
    assert output.num_cached_tokens >= 192  # 12 full blocks of the shared 200 tokens


async def test_pinning_aborts_and_bad_ranks(dp) -> None:
    stream = dp.generate("Tell me a long story about a dragon.", greedy(200, ignore_eos=True), data_parallel_rank=1)
    assert engine_of(dp, stream.request_id) == 1
    async for out in stream:
        if len(out.outputs[0].token_ids) >= 2:
            await dp.abort(stream.request_id)
    assert out.outputs[0].finish_reason == "abort"
    deadline = time.monotonic() + 30
    # The abort reached rank 1, and its finished notice (the step after the abort) reached the client.
    while (await dp.get_scheduler_stats_per_engine())[1].num_running_reqs or client(dp).num_in_flight(1):
        assert time.monotonic() < deadline
        await anyio.sleep(0.05)
    with pytest.raises(InvalidRequestError, match="data_parallel_rank=2"):
        dp.generate("hi", greedy(2), data_parallel_rank=2)
    assert (await dp.generate("hi", greedy(2), data_parallel_rank=0).collect()).finished


async def test_scale_to_one_while_16_stream_then_back_to_two(dp, reference) -> None:
    prompts = PROMPTS[:16]

    pids = state_probes.engine_pids(client(dp))
    ranks: list[int] = []
    results: list = []

    async def stream_all() -> None:
        results.extend(await _run_all(dp, prompts, greedy(16), ranks))

    async with anyio.create_task_group() as tg:
        tg.start_soon(stream_all)
        while len(ranks) < 16:  # noqa: ASYNC110 (until every request was placed)
            await anyio.sleep(0.01)
        assert set(ranks) == {0, 1}
        await dp.scale_data_parallel(1)
        assert dp.data_parallel_size == 1
    for prompt, output in zip(prompts, results, strict=True):  # all 16 complete, correctly
        assert output.finished
        assert output.outputs[0].token_ids == reference[prompt], prompt
    assert client(dp).engine_ranks == [0]
    assert state_probes.engine_pids(client(dp)) == {0: pids[0]}
    deadline = time.monotonic() + 30
    while not is_gone(pids[1]):
        assert time.monotonic() < deadline
        await anyio.sleep(0.05)
    assert sorted(os.listdir(client(dp).ipc_dir)) == ["input", "output"]  # the client's sockets only

    await dp.scale_data_parallel(2)
    assert client(dp).engine_ranks == [0, 1]
    ranks.clear()
    outputs = await _run_all(dp, PROMPTS[16:24], greedy(16), ranks)
    assert set(ranks) == {0, 1}
    for prompt, output in zip(PROMPTS[16:24], outputs, strict=True):
        assert output.outputs[0].token_ids == reference[prompt], prompt


async def test_one_engine_has_rank_0_only_and_cannot_scale(single) -> None:
    assert single.data_parallel_size == 1
    with pytest.raises(InvalidRequestError, match="data_parallel_rank=1"):
        single.generate("hi", greedy(2), data_parallel_rank=1)
    assert (await single.generate("hi", greedy(2), data_parallel_rank=0).collect()).finished
    with pytest.raises(ConfigError, match="data_parallel_size >= 2"):
        await single.scale_data_parallel(2)
    assert list(await single.get_scheduler_stats_per_engine()) == [0]


def test_data_parallel_needs_engine_processes(model_path: str) -> None:
    with pytest.raises(ConfigError, match="engine_process=True"):
        dp_args(model_path, engine_process=False).create_engine_config()
    with pytest.raises(ConfigError, match="data_parallel_size"):
        dp_args(model_path, size=0).validate()


async def _stream_until_error(stream) -> BaseException | None:
    try:
        async for _ in stream:
            pass
    except (EngineDeadError, EngineGenerateError) as e:
        return e
    return None


@pytest.mark.slow
async def test_killing_one_engine_fails_every_stream_within_5_s(make_llm: EngineFactory) -> None:
    llm = make_llm(data_parallel_size=2, **WEIGHTS)
    streams = [llm.generate(p, greedy(400, ignore_eos=True)) for p in PROMPTS[:8]]
    errors: list = [None] * 8
    killed_at: list[float] = []

    async def consume(i: int) -> None:
        errors[i] = await _stream_until_error(streams[i])
        errors[i] = (errors[i], time.monotonic())

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(consume, i)
        while (await llm.get_scheduler_stats()).num_running_reqs < 8:  # noqa: ASYNC110 (polls the engines)
            await anyio.sleep(0.02)
        os.kill(state_probes.engine_pids(client(llm))[1], signal.SIGKILL)
        killed_at.append(time.monotonic())
    for error, at in errors:
        assert isinstance(error, EngineDeadError), error
        assert at - killed_at[0] < 5.0
    assert "data-parallel rank 1" in str(errors[0][0]) or "data-parallel rank 1" in str(errors[0][0].__cause__)
    assert llm.errored
    with pytest.raises(EngineDeadError):
        llm.generate("hi", greedy(2))


@pytest.mark.slow
async def test_restart_dead_engines_fails_only_that_engines_requests(make_llm: EngineFactory) -> None:
    llm = make_llm(data_parallel_size=2, restart_dead_engines=True, **WEIGHTS)
    old_pid = state_probes.engine_pids(client(llm))[1]
    streams = [
        llm.generate(p, greedy(40, ignore_eos=True), data_parallel_rank=i % 2) for i, p in enumerate(PROMPTS[:8])
    ]
    results: list = [None] * 8

    async def consume(i: int) -> None:
        results[i] = await _stream_until_error(streams[i])

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(consume, i)
        while (await llm.get_scheduler_stats_per_engine())[1].num_running_reqs < 4:  # noqa: ASYNC110
            await anyio.sleep(0.02)
        os.kill(old_pid, signal.SIGKILL)
    assert all(results[i] is None for i in range(0, 8, 2))  # rank 0's streams completed
    assert all(isinstance(results[i], EngineGenerateError) for i in range(1, 8, 2)), results
    assert "data-parallel rank 1" in str(results[1])
    assert not llm.errored
    deadline = time.monotonic() + 120
    while client(llm).engine_ranks != [0, 1]:  # a fresh engine takes rank 1
        assert time.monotonic() < deadline
        await anyio.sleep(0.1)
    assert state_probes.engine_pids(client(llm))[1] != old_pid
    output = await llm.generate("hi", greedy(4), data_parallel_rank=1).collect()
    assert len(output.outputs[0].token_ids) == 4
