"""A server of its own: API key, root path, and graceful shutdown on Ctrl-C (SIGINT to the process group)."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest
from openai import AsyncOpenAI, AuthenticationError

from asyncllm.engine.launcher import ENGINE_MODULE
from tests.server.server_helpers import descendants, is_alive, start_server, stop_server, wait_for

pytestmark = [pytest.mark.mp, pytest.mark.slow]

GRACE_PERIOD_S = 15  # the short stream needs 2 more tokens within it, even on a loaded machine


async def read_stream(http: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event) -> list[str]:
    """Stream a completion; returns its data lines (JSON texts and `[DONE]`)."""
    lines = []
    async with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 2:
                    started.set()
    return lines


def finish_reasons(lines: list[str]) -> list[str]:
    chunks = [json.loads(line) for line in lines if line != "[DONE]"]
    return [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]


async def test_api_key_root_path_and_graceful_ctrl_c() -> None:
    server = start_server(
        "--api-key", "s3cret", "--root-path", "/api", "--grace-period", str(GRACE_PERIOD_S), new_session=True
    )
    children = descendants(server.pid)
    try:
        base = server.base_url
        async with httpx.AsyncClient(timeout=120) as http:
            assert (await http.get(f"{base}/v1/models")).status_code == 401
            wrong = await http.get(f"{base}/v1/models", headers={"Authorization": "Bearer s3cre"})
            assert wrong.status_code == 401
            assert wrong.json()["error"]["type"] == "authentication_error"
            assert (await http.get(f"{base}/health")).status_code == 200  # ops routes need no key
            async with AsyncOpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0) as oai:
                assert [m.id async for m in oai.models.list()] == ["smollm2-135m-instruct"]
            async with AsyncOpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0) as oai:
                with pytest.raises(AuthenticationError):
                    await oai.models.list()

            headers = {"Authorization": "Bearer s3cret"}
            url = f"{base}/v1/completions"
            short_started, long_started = asyncio.Event(), asyncio.Event()
            async with httpx.AsyncClient(timeout=120, headers=headers) as streams:
                short = asyncio.create_task(
                    read_stream(streams, url, {"prompt": "Hi", "max_tokens": 4, "stream": True}, short_started)
                )
                body = {"prompt": "Tell a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
                long = asyncio.create_task(read_stream(streams, url, body, long_started))
                await asyncio.wait_for(asyncio.gather(short_started.wait(), long_started.wait()), 120)
                os.killpg(server.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole process group
                short_lines, long_lines = await asyncio.wait_for(asyncio.gather(short, long), 120)
        # in-flight streams: the short one finished within the grace period, the long one was aborted, both end
        # with [DONE]
        assert short_lines[-1] == "[DONE]"
        assert finish_reasons(short_lines) == ["length"]
        assert long_lines[-1] == "[DONE]"
        assert finish_reasons(long_lines) == ["abort"]
        server.process.wait(60)
        assert "Application shutdown complete" in server.log()
        wait_for(lambda: not any(is_alive(pid) for pid in children), timeout=30)
    finally:
        stop_server(server, signal.SIGKILL)


def test_dead_engine_gives_503_and_the_server_still_exits_cleanly() -> None:
    server = start_server()
    try:
        engines = [pid for pid in descendants(server.pid) if ENGINE_MODULE in cmdline(pid)]
        assert len(engines) == 1
        os.kill(engines[0], signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{server.base_url}/health", timeout=30).status_code == 503, timeout=60)
        response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable"
        assert stop_server(server) in (0, -signal.SIGTERM), server.log()
    finally:
        stop_server(server, signal.SIGKILL)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
