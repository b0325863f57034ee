"""Data parallelism on Ray (`data_parallel_backend="ray"`) on a real local Ray cluster (num_cpus=2) and the real
SmolLM2 model: two engine-core actors talk to the client over ZeroMQ TCP; 32 requests split over both, greedy
outputs equal one engine's; a killed actor makes every stream fail; missing resources give a clear error."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator

import anyio
import pytest

from asyncllm import AsyncLLM, EngineArgs, EngineDeadError
from asyncllm.errors import ConfigError
from tests.integration.conftest import greedy
from tests.integration.test_data_parallel import PROMPTS, _run_all, _stream_until_error, client
from tests.state_probes import engine_pids

ray = pytest.importorskip("ray", reason="needs asyncllm[ray]")

pytestmark = [pytest.mark.ray, pytest.mark.mp]


def ray_args(model_path: str, **kw) -> EngineArgs:
    return EngineArgs(
        model=model_path, data_parallel_size=2, data_parallel_backend="ray", num_kv_blocks=128, quantization=None, **kw
    )


@pytest.fixture(scope="module")
def reference(model_path: str) -> dict[str, list[int]]:
    """Greedy token ids of every prompt on one engine (an engine process; before Ray takes the CPUs)."""

    async def body() -> dict[str, list[int]]:
        async with AsyncLLM.create(EngineArgs(model=model_path, num_kv_blocks=128, quantization=None)) as llm:
            outputs = await _run_all(llm, PROMPTS, greedy(16))
        return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outputs, strict=True)}

    return anyio.run(body)


@pytest.fixture(scope="module")
def ray_cluster(reference) -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_two_engine_actors_split_32_requests_with_greedy_outputs_of_one_engine(
    model_path: str, reference, ray_cluster
) -> None:
    llm = AsyncLLM.from_engine_args(ray_args(model_path))

    async def body() -> None:
        pids = engine_pids(client(llm))
        assert len(set(pids.values())) == 2
        assert os.getpid() not in pids.values()
        ranks: list[int] = []
        outputs = await _run_all(llm, PROMPTS, greedy(16), ranks)
        counts = Counter(ranks)
        assert set(counts) == {0, 1}
        assert min(counts.values()) > 32 * 0.25, counts
        for prompt, output in zip(PROMPTS, outputs, strict=True):
            assert output.outputs[0].token_ids == reference[prompt], prompt
        per_engine = await llm.get_scheduler_stats_per_engine()
        assert all(s.num_prefix_cache_queries > 0 for s in per_engine.values())

        # A killed engine actor: every stream fails within 5 s, naming the rank.
        streams = [llm.generate(p, greedy(400, ignore_eos=True)) for p in PROMPTS[:4]]
        results: list = [None] * 4

        async def consume(i: int) -> None:
            results[i] = (await _stream_until_error(streams[i]), time.monotonic())

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(consume, i)
            while (await llm.get_scheduler_stats()).num_running_reqs < 4:  # noqa: ASYNC110 (polls the engines)
                await anyio.sleep(0.02)
            os.kill(pids[0], signal.SIGKILL)
            killed_at = time.monotonic()
        for error, at in results:
            assert isinstance(error, EngineDeadError), error
            assert at - killed_at < 5.0
        assert llm.errored

    try:
        anyio.run(body)
    finally:
        anyio.run(llm.shutdown)
    wait_for_all_cpus_free()  # both engines' actors and placement groups were removed


def wait_for_all_cpus_free() -> None:
    """Ray releases a removed placement group's CPUs asynchronously: wait (30 s at most) until both are free."""
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != 2.0:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)


def test_missing_resources_are_a_clear_error_and_nothing_is_left(model_path: str, ray_cluster) -> None:
    args = ray_args(model_path, load_format="dummy", ray_cpus_per_worker=1.5, ray_placement_timeout_s=3.0)
    with pytest.raises(ConfigError, match=r"could not reserve \{'CPU': 1.5\} for data-parallel rank 1"):
        AsyncLLM.from_engine_args(args)
    wait_for_all_cpus_free()  # rank 0's actor and placement group are gone
