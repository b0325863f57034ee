"""A user-defined executor, importable by module path (the engine core imports it by "module:Class")."""

from __future__ import annotations

from typing import Any

from asyncllm.executors.uniproc import UniProcExecutor


class TaggedExecutor(UniProcExecutor):
    """The `uni` executor, plus a marker in every model-info reply (proves this class ran in the engine)."""

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> list[Any]:
        results = super().collective_rpc(method, args, kwargs, timeout, unique_reply_rank)
        if method == "get_model_info" and unique_reply_rank is None:  # a user's call, not the engine's start-up
            return [[*r, "tagged"] for r in results]
        return results
