"""Utility calls on the engine core (`get_scheduler_stats`, `reset_prefix_cache`, `collective_rpc`, `echo`).

Both clients route `call_utility_async(method, *args)` here, inside the engine (thread or process), so the same
methods exist in both modes. Only names in `messages.engine.UTILITY_METHODS` are called.
"""

from __future__ import annotations

from typing import Any

from asyncllm.messages.engine import UTILITY_METHODS


def call_utility_method(core: Any, method: str, args: list[Any] | tuple[Any, ...]) -> Any:
    """Run one utility call on `core`.

    `collective_rpc(method, args, kwargs, timeout, unique_reply_rank)` goes to the core's executor (one result
    per worker); `echo(*args)` returns `list(args)` (round-trip probes); `reset_prefix_cache()` returns False
    when the core has no prefix cache.
    Raises:
        ValueError: `method` is not a utility method.
        Whatever the called method raises (the client turns it into `EngineGenerateError`).
    """
    if method not in UTILITY_METHODS:
        raise ValueError(f"unknown utility method {method!r}")
    if method == "echo":
        return list(args)
    if method == "collective_rpc":
        return core.executor.collective_rpc(*args)
    if method == "reset_prefix_cache" and not hasattr(core, "reset_prefix_cache"):
        return False  # no prefix cache in this engine: nothing to reset
    return getattr(core, method)(*args)
