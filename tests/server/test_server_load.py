"""Many concurrent streaming clients against the shared server: all complete, no memory is kept."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.server_helpers import ServerProcess, wait_for

pytestmark = [pytest.mark.mp, pytest.mark.slow]

NUM_CLIENTS = 64
MAX_TOKENS = 8
RSS_SLACK_BYTES = 48 << 20  # allocator slack; a leak of per-request state over 64 requests x rounds exceeds it


async def stream_one(http: httpx.AsyncClient, base_url: str, i: int) -> tuple[str, str | None]:
    """One streaming chat request; returns (text, finish_reason)."""
    body = {
        "messages": [{"role": "user", "content": f"Say a word about the number {i}."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
    }
    text, finish = "", None
    async with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
    return text, finish


async def run_round(base_url: str, num_clients: int) -> list[tuple[str, str | None]]:
    limits = httpx.Limits(max_connections=num_clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        return await asyncio.gather(*(stream_one(http, base_url, i) for i in range(num_clients)))


async def test_64_concurrent_streams_complete_and_rss_returns(server: ServerProcess) -> None:
    await run_round(server.base_url, 8)  # warm-up: first-use allocations are not a leak
    rss_before = server.rss_bytes()
    for _ in range(2):
        results = await run_round(server.base_url, NUM_CLIENTS)
        assert len(results) == NUM_CLIENTS
        assert all(finish in ("stop", "length") for _, finish in results), results
        assert all(text for text, _ in results)

    def engine_idle() -> bool:
        return httpx.get(f"{server.base_url}/stats").json()["num_running_reqs"] == 0

    wait_for(engine_idle, timeout=30)
    rss_after = server.rss_bytes()
    print(
        f"server RSS before {rss_before / 2**20:.1f} MiB, after 2 x {NUM_CLIENTS} streams {rss_after / 2**20:.1f} MiB"
    )
    assert rss_after - rss_before < RSS_SLACK_BYTES
