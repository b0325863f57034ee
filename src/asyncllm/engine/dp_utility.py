"""Utility calls under data parallelism: decoding each engine's result, and combining the results of one call on
every engine into one (`UTILITY_COMBINERS`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from asyncllm.errors import EngineGenerateError
from asyncllm.messages.engine import UTILITY_METHODS, SchedulerStats, SpecDecodeMetrics, UtilityResult


def sum_scheduler_stats(per_engine: list[SchedulerStats]) -> SchedulerStats:
    """The engines' stats as one engine's: counts, blocks, bytes and counters summed; the prefix-cache hit rate
    recomputed from the summed counters; `block_size` of the first; `engine_index` 0. One engine's stats are
    returned as they are; none give zeros."""
    if len(per_engine) == 1:
        return per_engine[0]
    queries = sum(s.num_prefix_cache_queries for s in per_engine)
    hits = sum(s.num_prefix_cache_hits for s in per_engine)
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in per_engine),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in per_engine),
        num_free_blocks=sum(s.num_free_blocks for s in per_engine),
        num_total_blocks=sum(s.num_total_blocks for s in per_engine),
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        num_preemptions=sum(s.num_preemptions for s in per_engine),
        num_prefix_cache_queries=queries,
        num_prefix_cache_hits=hits,
        block_size=per_engine[0].block_size if per_engine else 0,
        kv_cache_bytes=sum(s.kv_cache_bytes for s in per_engine),
        spec_decode=sum_spec_decode([s.spec_decode for s in per_engine if s.spec_decode is not None]),
    )


def sum_spec_decode(per_engine: list[SpecDecodeMetrics]) -> SpecDecodeMetrics | None:
    """The engines' speculative decoding counters summed (per draft position too); None when none has them."""
    if not per_engine:
        return None
    width = max(len(m.num_accepted_tokens_per_pos) for m in per_engine)
    per_pos = [
        sum(m.num_accepted_tokens_per_pos[i] for m in per_engine if i < len(m.num_accepted_tokens_per_pos))
        for i in range(width)
    ]
    return SpecDecodeMetrics(
        num_drafts=sum(m.num_drafts for m in per_engine),
        num_draft_tokens=sum(m.num_draft_tokens for m in per_engine),
        num_accepted_tokens=sum(m.num_accepted_tokens for m in per_engine),
        num_accepted_tokens_per_pos=per_pos,
    )


def _concatenate(per_engine: list[list[Any]]) -> list[Any]:
    return [item for results in per_engine for item in results]


UTILITY_COMBINERS: dict[str, Callable[[list[Any]], Any]] = {
    "get_scheduler_stats": sum_scheduler_stats,
    "reset_prefix_cache": all,
    "collective_rpc": _concatenate,  # by engine rank, then worker rank
    "echo": lambda per_engine: per_engine[0],  # every engine echoes the same arguments
}
"""Utility method -> how its per-engine results (in rank order) combine."""


def decode_utility_result(method: str, rank: int, result: UtilityResult) -> Any:
    """Engine `rank`'s result of `method`, decoded to the type `UTILITY_METHODS` names (scheduler stats stamped
    with the rank).

    Raises:
        EngineGenerateError: the call raised in the engine, or returned a result of the wrong type.
    """
    if result.error is not None:
        raise EngineGenerateError(f"engine utility call {method} failed on data-parallel rank {rank}: {result.error}")
    try:
        value = msgspec.convert(result.result, UTILITY_METHODS[method])
    except msgspec.ValidationError as e:
        raise EngineGenerateError(f"engine utility call {method} returned a bad result on rank {rank}: {e}") from e
    if isinstance(value, SchedulerStats):
        value = msgspec.structs.replace(value, engine_index=rank)
    return value
