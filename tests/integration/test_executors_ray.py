"""The `ray` executor on a real local Ray cluster (num_cpus=2) and the real SmolLM2-135M-Instruct: greedy ids equal
`uni`, collective_rpc reaches the actor, a killed actor -> EngineDeadError, missing resources -> a clear error.

The test process starts the cluster; the engine process connects to it by address (`ray_address`), as it would
to a multi-node cluster.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import pytest_asyncio

from asyncllm import AsyncLLM, EngineArgs, SamplingParams
from asyncllm.errors import EngineDeadError, ExecutorError
from tests.integration.executor_helpers import MAX_TOKENS, PROMPTS, engine_args, greedy_ids, wait_gone
from tests.reference import clear_prefix_len, greedy_margins

ray = pytest.importorskip("ray", reason="needs asyncllm[ray]")

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.ray, pytest.mark.mp]


@pytest.fixture(scope="module")
def ray_address():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def ray_args(model_path: str, address: str, **kw) -> EngineArgs:
    return engine_args(model_path, distributed_executor_backend="ray", ray_address=address, **kw)


async def test_ray_tp3_equals_tp1_where_the_choice_is_clear(
    model_path: str, ray_address: str, uni_ids: list[list[int]], reference_model: Any
) -> None:
    """Runs before the TP=1 engine holds a CPU: 3 ranks of 0.5 CPU fit the 2-CPU cluster."""
    reference = reference_model
    args = ray_args(model_path, ray_address, tensor_parallel_size=3, ray_cpus_per_worker=0.5)
    async with AsyncLLM.from_engine_args(args) as llm:
        pids = await llm.collective_rpc("get_pid")
        assert len(set(pids)) == 3
        tp3_ids = await greedy_ids(llm, PROMPTS)
        prompts_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    num_compared = 0
    for prompt_ids, expected, got in zip(prompts_ids, uni_ids, tp3_ids, strict=True):
        clear = clear_prefix_len(greedy_margins(reference, prompt_ids, expected), 0.05)
        assert got[:clear] == expected[:clear]
        num_compared += clear
    assert num_compared >= MAX_TOKENS


async def test_engine_inside_a_placement_group_reuses_it(model_path: str, ray_address: str) -> None:
    """An engine core built inside a Ray actor that runs in a placement group puts its worker in that group's
    bundle instead of reserving a new group (runs before the TP=1 engine holds a CPU)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0)
    class EngineHost:
        def build(self, args: EngineArgs) -> tuple[bool, str, int]:
            from asyncllm.engine.core import EngineCore

            core = EngineCore(args.create_engine_config())
            try:
                executor = core.executor
                pid = core.executor.collective_rpc("get_pid")[0]
                return executor._own_placement_group, executor._placement_group.id.hex(), pid
            finally:
                core.shutdown()

    group = placement_group([{"CPU": 1.0}], strategy="PACK")
    ray.get(group.ready(), timeout=60)
    try:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
        )
        host = EngineHost.options(scheduling_strategy=strategy).remote()
        args = engine_args(model_path, distributed_executor_backend="ray", load_format="dummy")
        own_group, group_id, worker_pid = ray.get(host.build.remote(args), timeout=120)
        assert own_group is False
        assert group_id == group.id.hex()
        assert worker_pid > 0
        ray.kill(host)
    finally:
        remove_placement_group(group)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def ray_tp1(model_path: str, ray_address: str):
    async with AsyncLLM.from_engine_args(ray_args(model_path, ray_address)) as llm:
        yield llm


async def test_ray_tp1_greedy_ids_equal_uni(ray_tp1: AsyncLLM, uni_ids: list[list[int]]) -> None:
    assert await greedy_ids(ray_tp1, PROMPTS) == uni_ids


async def test_collective_rpc_reaches_the_actor(ray_tp1: AsyncLLM) -> None:
    pids = await ray_tp1.collective_rpc("get_pid")
    assert len(pids) == 1
    assert pids[0] not in (os.getpid(), ray_tp1._client.process.pid)  # type: ignore[attr-defined]
    info = await ray_tp1.collective_rpc("get_model_info")
    assert info[0][1] == 49152


async def test_missing_resources_fail_with_a_clear_error(model_path: str, ray_address: str) -> None:
    """TP=3 needs 3 CPU bundles; the cluster has 2 (one of them held by the TP=1 engine)."""
    args = ray_args(model_path, ray_address, tensor_parallel_size=3, ray_placement_timeout_s=3.0)
    with pytest.raises(ExecutorError, match=r"could not reserve 3 bundle\(s\) of \{'CPU': 1.0\}.*within 3.0 s"):
        AsyncLLM.from_engine_args(args)


async def test_killed_actor_fails_open_streams_fast(model_path: str, ray_address: str, ray_tp1: AsyncLLM) -> None:
    """A second engine (random weights: processes are tested, not tokens) uses the cluster's other CPU."""
    llm = AsyncLLM.from_engine_args(ray_args(model_path, ray_address, load_format="dummy"))
    engine_pid = llm._client.process.pid  # type: ignore[attr-defined]
    try:
        (actor_pid,) = await llm.collective_rpc("get_pid")
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        streams = [llm.generate(p, params) for p in PROMPTS]
        await streams[0].__anext__()
        os.kill(actor_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for stream in streams:
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
        assert time.monotonic() - killed_at < 5.0
    finally:
        started = time.monotonic()
        await llm.shutdown()
        assert time.monotonic() - started < 10.0
    assert wait_gone([engine_pid, actor_pid], within=5.0) == []
    assert not ray_tp1.errored  # the other engine on the same cluster is untouched
