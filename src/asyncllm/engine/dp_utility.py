"""Utility calls under data parallelism: decoding each engine's result, and combining the results of one call on
every engine into one (`UTILITY_COMBINERS`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from asyncllm.errors import EngineGenerateError
from asyncllm.messages.engine import UTILITY_METHODS, SchedulerStats, UtilityResult
from asyncllm.metrics.stats import sum_scheduler_stats


def _concatenate(per_engine: list[list[Any]]) -> list[Any]:
    return [item for results in per_engine for item in results]


UTILITY_COMBINERS: dict[str, Callable[[list[Any]], Any]] = {
    "get_scheduler_stats": sum_scheduler_stats,
    "reset_prefix_cache": all,
    "set_scheduler_paused": all,
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
