"""BlockPool and KVCacheManager: allocation, reference counts, free order, per-request block tables."""

from __future__ import annotations

import pytest

from asyncllm.sampling_params import SamplingParams
from asyncllm.sched.block_pool import BlockPool
from asyncllm.sched.kv_cache_manager import KVCacheManager
from asyncllm.sched.request import Request


def test_allocate_and_free_round_trip() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    assert all(b.ref_cnt == 0 for b in blocks)


def test_allocate_more_than_free_raises_and_allocates_nothing() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError, match="already free"):
        pool.free(blocks)


def test_shared_block_is_freed_by_its_last_holder() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    block.ref_cnt += 1  # a second holder (prefix caching)
    pool.free([block])
    assert pool.num_free_blocks == 1
    pool.free([block])
    assert pool.num_free_blocks == 2


def test_freed_blocks_are_reused_last() -> None:
    pool = BlockPool(3)
    first = pool.allocate(1)
    pool.free(first)
    assert [b.block_id for b in pool.allocate(3)] == [1, 2, 0]


def test_zero_blocks_rejected() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        BlockPool(0)


def _request(request_id: str, num_prompt_tokens: int) -> Request:
    return Request(request_id, list(range(num_prompt_tokens)), SamplingParams())


def test_allocate_slots_allocates_only_missing_blocks() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4)
    req = _request("a", 6)
    assert manager.allocate_slots(req, 6) == [0, 1]
    req.num_computed_tokens = 6
    assert manager.allocate_slots(req, 2) == []  # positions 6, 7 fit in block 1
    req.num_computed_tokens = 8
    assert manager.allocate_slots(req, 1) == [2]
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.num_free_blocks == 7


def test_allocate_slots_returns_none_when_out_of_blocks_and_keeps_state() -> None:
    manager = KVCacheManager(num_blocks=2, block_size=4)
    a, b = _request("a", 8), _request("b", 1)
    assert manager.allocate_slots(a, 8) == [0, 1]
    assert manager.allocate_slots(b, 1) is None
    assert manager.get_block_ids("b") == []
    assert manager.num_free_blocks == 0


def test_free_returns_all_blocks_tail_first() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=2)
    req = _request("a", 5)
    manager.allocate_slots(req, 5)
    manager.free(req)
    manager.free(req)  # no-op the second time
    assert manager.num_free_blocks == 4
    assert manager.get_block_ids("a") == []
    other = _request("b", 8)
    assert manager.allocate_slots(other, 8) == [3, 2, 1, 0]


def test_reset_prefix_cache_refuses_while_blocks_are_held_then_forgets_every_hash():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.cache_full_block(blocks[0], b"h0")
    assert pool.reset_prefix_cache() is False  # a request still holds blocks
    assert pool.get_cached_block(b"h0") is blocks[0]
    pool.free(reversed(blocks))
    assert pool.get_cached_block(b"h0") is blocks[0]  # a free block keeps its hash until reset or eviction
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"h0") is None
    assert blocks[0].block_hash is None
    assert pool.num_cached_blocks == 0
