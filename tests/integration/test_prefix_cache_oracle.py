"""Prefix caching, chunked prefill, preemption and priority against an exact oracle: a fake model whose next
token is sum((position + 1) * token) mod vocab over the whole sequence, read back from the paged KV cache
(see tests/integration/test_engine_core.py). Any wrong reuse of a cached block changes the tokens."""

from __future__ import annotations

import random

import pytest

from asyncllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from asyncllm.engine.core import EngineCore
from asyncllm.messages.engine import EngineCoreRequest
from asyncllm.sampling_params import SamplingParams
from tests.integration.test_engine_core import FAKE_VOCAB, _oracle, _SumModelExecutor


@pytest.mark.parametrize(
    ("policy", "num_kv_blocks", "max_num_batched_tokens"),
    [("fcfs", 64, 512), ("fcfs", 8, 16), ("priority", 8, 20), ("priority", 64, 16)],
)
def test_exact_oracle_with_shared_prefixes_chunking_preemption_and_priority(
    policy: str, num_kv_blocks: int, max_num_batched_tokens: int
) -> None:
    """The exact oracle of test_engine_core (next token = sum((position + 1) * token) mod vocab, read back
    from the paged cache) with prefix caching on: every token must be exact, whatever is reused or recomputed."""
    config = EngineConfig(
        ModelConfig("fake", "fake", max_model_len=96),
        CacheConfig(block_size=16, num_kv_blocks=num_kv_blocks, enable_prefix_caching=True),
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=max_num_batched_tokens, scheduling_policy=policy),  # type: ignore[arg-type]
        ParallelConfig(),
    )
    core = EngineCore(config, executor_class=_SumModelExecutor)
    rng = random.Random(5)
    shared = [rng.randrange(FAKE_VOCAB) for _ in range(48)]
    requests = []
    for i in range(12):
        prompt = shared[: 16 + 8 * (i % 5)] + [rng.randrange(FAKE_VOCAB) for _ in range(1 + i % 4)]
        if i == 11:
            prompt = list(requests[3].prompt_token_ids)  # an exact repeat: all but its last token can hit
        params = SamplingParams(temperature=0.0, max_tokens=3 + (5 * i) % 17, ignore_eos=True)
        requests.append(EngineCoreRequest(f"r{i}", prompt, params, arrival_time=float(i), priority=i % 3))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    cached: dict[str, int] = {}
    pending = list(requests)
    for step in range(10_000):
        if pending and step % 2 == 0:
            core.add_request(pending.pop(0))
        if not pending and not core.has_unfinished_requests():
            break
        for output in core.step().outputs:
            tokens[output.request_id] += output.new_token_ids
            cached[output.request_id] = output.num_cached_tokens
    for request in requests:
        expected = _oracle(request.prompt_token_ids, request.sampling_params.max_tokens or 0)
        assert tokens[request.request_id] == expected, request.request_id
    assert sum(cached.values()) > 0
    assert all(n % 16 == 0 and n < len(r.prompt_token_ids) for r in requests for n in [cached[r.request_id]])
    stats = core.get_scheduler_stats()
    assert stats.num_prefix_cache_hits > 0
    assert (stats.num_preemptions > 0) == (num_kv_blocks == 8)
    assert stats.num_free_blocks == stats.num_total_blocks == num_kv_blocks
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
    assert core.executor.runner.requests == {}  # type: ignore[attr-defined]
    core.shutdown()
