"""Prefix caching: chained block hashes, LRU free queue with cached blocks, hits in the KV cache manager and
the scheduler, and block accounting after finish, abort and preemption."""

from __future__ import annotations

from asyncllm.config import SchedulerConfig
from asyncllm.messages.engine import EngineCoreRequest
from asyncllm.messages.scheduler import ModelRunnerOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.sched.block_pool import ROOT_BLOCK_HASH, BlockPool, hash_block_tokens
from asyncllm.sched.kv_cache_manager import KVCacheManager
from asyncllm.sched.request import Request, RequestStatus
from asyncllm.sched.scheduler import Scheduler

BLOCK = 4


def _request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=4))


def test_block_hash_is_chained_and_deterministic() -> None:
    first = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])
    assert first == hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])
    assert len(first) == 32
    assert first != hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 5])
    # Same tokens after a different parent: a different prefix, a different hash.
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(ROOT_BLOCK_HASH, [5, 6, 7, 8])


def test_freed_cached_block_stays_findable_until_reallocated_lru_first() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_full_block(a, b"ha")
    pool.cache_full_block(b, b"hb")
    pool.free([b, a])  # tail first: b is evicted before a
    assert pool.num_free_blocks == 3
    assert pool.get_cached_block(b"ha") is a
    assert pool.get_cached_block(b"hb") is b
    # Never-used block 2 is at the front of the free queue, then b, then a.
    assert [blk.block_id for blk in pool.allocate(2)] == [2, b.block_id]
    assert pool.get_cached_block(b"hb") is None
    assert b.block_hash is None
    assert pool.get_cached_block(b"ha") is a


def test_touch_takes_a_free_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_full_block(a, b"ha")
    pool.free([a])
    pool.touch([a])
    assert a.ref_cnt == 1
    assert pool.num_free_blocks == 1
    pool.touch([a])  # a second holder
    pool.free([a])
    assert pool.num_free_blocks == 1
    pool.free([a])
    assert pool.num_free_blocks == 2


def test_caching_off_keeps_no_hashes() -> None:
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_full_block(a, b"ha")
    assert pool.get_cached_block(b"ha") is None
    assert pool.num_cached_blocks == 0


def test_manager_reuses_full_blocks_of_a_shared_prefix_but_never_the_last_token() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK)
    first = _request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert manager.get_computed_blocks(first) == []
    assert manager.allocate_slots(first, 10) == [0, 1, 2]
    assert len(first.block_hashes) == 2
    same_prefix = _request("b", [*range(8), 99, 98, 97])
    hits = manager.get_computed_blocks(same_prefix)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert manager.allocate_slots(same_prefix, 3, hits) == [3]
    assert manager.get_block_ids("b") == [0, 1, 3]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    # A prompt of exactly 2 full blocks may reuse only the first: its last token must be computed.
    exact = _request("c", list(range(8)))
    assert [blk.block_id for blk in manager.get_computed_blocks(exact)] == [0]
    # A different first block breaks the chain even if later tokens match.
    other = _request("d", [42, *range(1, 10)])
    assert manager.get_computed_blocks(other) == []


def test_manager_counts_evictable_hits_against_free_blocks() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK)
    first = _request("a", list(range(8)))
    manager.allocate_slots(first, 8)
    manager.free(first)
    assert manager.num_free_blocks == 3
    second = _request("b", [*range(8), 50, 51, 52, 53, 54])  # 13 tokens: 4 blocks needed, 2 cached
    hits = manager.get_computed_blocks(second)
    assert len(hits) == 2
    assert manager.allocate_slots(second, 5, hits) is None  # 2 more needed, only 1 non-hit block free
    assert manager.num_free_blocks == 3
    assert manager.allocate_slots(second, 4, hits) == [2]
    assert manager.get_block_ids("b") == [0, 1, 2]


def _scheduler(num_blocks: int = 64, budget: int = 64, caching: bool = True, **kw: object) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, **kw)  # type: ignore[arg-type]
    return Scheduler(config, num_blocks, BLOCK, max_model_len=64, enable_prefix_caching=caching)


def _add(scheduler: Scheduler, request_id: str, token_ids: list[int], max_tokens: int = 3) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    scheduler.add_request(EngineCoreRequest(request_id, token_ids, params, eos_token_id=2))


def _run(scheduler: Scheduler, max_steps: int = 200) -> dict[str, list]:
    """Run to completion, sampling token 7; returns each request's outputs."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        so = scheduler.schedule()
        sampled = {
            rid: [7]
            for rid in so.num_scheduled_tokens
            if scheduler.requests[rid].num_computed_tokens == scheduler.requests[rid].num_tokens
        }
        for out in scheduler.update_from_output(so, ModelRunnerOutput(sampled)).outputs:
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("did not finish")


def test_scheduler_second_request_starts_after_cached_prefix() -> None:
    scheduler = _scheduler()
    prefix = list(range(100, 112))  # 3 full blocks
    _add(scheduler, "a", [*prefix, 1, 2])
    _run(scheduler)
    _add(scheduler, "b", [*prefix, 3, 4, 5])
    so = scheduler.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 12
    assert so.num_scheduled_tokens == {"b": 3}
    assert new.block_ids[:3] == [0, 1, 2]
    assert scheduler.requests["b"].num_cached_tokens == 12
    stats = scheduler.get_stats()
    assert stats.num_prefix_cache_queries == 14 + 15
    assert stats.num_prefix_cache_hits == 12
    assert abs(stats.prefix_cache_hit_rate - 12 / 29) < 1e-9


def test_scheduler_reports_num_cached_tokens_in_outputs() -> None:
    scheduler = _scheduler()
    _add(scheduler, "a", list(range(9)))
    first = _run(scheduler)["a"]
    _add(scheduler, "b", list(range(9)))
    second = _run(scheduler)["b"]
    assert {o.num_cached_tokens for o in first} == {0}
    assert {o.num_cached_tokens for o in second} == {8}


def test_scheduler_without_caching_never_hits() -> None:
    scheduler = _scheduler(caching=False)
    _add(scheduler, "a", list(range(9)))
    _run(scheduler)
    _add(scheduler, "b", list(range(9)))
    so = scheduler.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert scheduler.get_stats().prefix_cache_hit_rate == 0.0


def _assert_all_blocks_free(scheduler: Scheduler) -> None:
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    assert not scheduler.requests
    assert manager.num_free_blocks == manager.num_total_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    # Every cached block is free (evictable) and findable under its own hash.
    cached = [block for block in pool.blocks if block.block_hash is not None]
    assert len(cached) == pool.num_cached_blocks
    assert all(pool.get_cached_block(block.block_hash) is block for block in cached if block.block_hash)
    stats = scheduler.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_all_blocks_free_after_finished_aborted_and_preempted_requests() -> None:
    scheduler = _scheduler(num_blocks=16, budget=16)  # 64 tokens of cache: preemption under load
    shared = list(range(200, 216))
    for i in range(8):
        _add(scheduler, f"r{i}", [*shared[: 4 + 2 * i], 300 + i, 301 + i], max_tokens=12 + i)
    for step in range(6):
        so = scheduler.schedule()
        sampled = {
            rid: [7]
            for rid in so.num_scheduled_tokens
            if scheduler.requests[rid].num_computed_tokens == scheduler.requests[rid].num_tokens
        }
        scheduler.update_from_output(so, ModelRunnerOutput(sampled))
        if step == 3:
            scheduler.finish_requests(["r1", "r6"], RequestStatus.FINISHED_ABORTED)
    outputs = _run(scheduler)
    assert scheduler.num_preemptions > 0
    assert set(outputs) <= {f"r{i}" for i in range(8)} - {"r1", "r6"}
    for rid in {f"r{i}" for i in range(8)} - {"r1", "r6"}:
        assert outputs[rid][-1].finish_reason is not None
    _assert_all_blocks_free(scheduler)


def test_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    scheduler = _scheduler()
    _add(scheduler, "a", list(range(10)), max_tokens=8)
    so = scheduler.schedule()
    scheduler.update_from_output(so, ModelRunnerOutput({"a": [7]}))
    req = scheduler.requests["a"]
    scheduler.running.remove(req)
    scheduler._preempt(req)
    so = scheduler.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 8  # blocks 0 and 1 were still cached
    assert new.output_token_ids == [7]
    assert so.num_scheduled_tokens == {"a": 3}
    assert req.num_cached_tokens == 0  # counted at the first scheduling only


def test_a_cache_salt_gives_its_requests_their_own_prefix_cache() -> None:
    """Issue 12 (vLLM's cache_salt): the salt starts the hash chain, so different salts never share a block."""
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK)
    tokens = list(range(1, 14))  # 3 full blocks + 1 token

    def admit(request_id: str, salt: str | None) -> int:
        request = Request(request_id, tokens, SamplingParams(max_tokens=4), cache_salt=salt)
        hits = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, len(tokens) - len(hits) * BLOCK, hits) is not None
        manager.free(request)
        return len(hits)

    assert admit("first", "tenant-a") == 0
    assert admit("other tenant", "tenant-b") == 0
    assert admit("unsalted", None) == 0
    assert admit("same tenant", "tenant-a") == 3
    assert admit("unsalted again", None) == 3
