"""The `ray` executor with no cluster given: the engine process starts a local Ray cluster, serves, and on shutdown
stops it, leaving none of its processes behind."""

from __future__ import annotations

import os

import pytest

from asyncllm import AsyncLLM, SamplingParams
from tests.integration.executor_helpers import engine_args, wait_gone

pytest.importorskip("ray", reason="needs asyncllm[ray]")

pytestmark = [pytest.mark.ray, pytest.mark.mp]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


async def test_engine_starts_and_stops_its_own_local_cluster(model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    llm = AsyncLLM.from_engine_args(engine_args(model_path, distributed_executor_backend="ray", load_format="dummy"))
    engine_pid = llm._client.process.pid  # type: ignore[attr-defined]
    ray_processes: list[int] = []
    try:
        (actor_pid,) = await llm.collective_rpc("get_pid")
        final = await llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True)).collect()
        assert len(final.outputs[0].token_ids) == 4
        ray_processes = descendants(engine_pid)
        assert actor_pid in ray_processes  # the actor runs in the cluster this engine started
    finally:
        await llm.shutdown()
    assert wait_gone([engine_pid, *ray_processes], within=10.0) == []
