"""Every example runs as it is (short max_tokens), on the real model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.server_helpers import ServerProcess, start_http_process, stop_server

pytestmark = pytest.mark.mp

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str, timeout: float = 600) -> str:
    """Run `examples/<name> *args`; returns its stdout (fails with its output on a non-zero exit)."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_openai_client_example(server: ServerProcess) -> None:
    out = run_example("openai_client.py", "--base-url", f"{server.base_url}/v1", "--max-tokens", "8")
    assert out.startswith("user: What is the capital of France?\nassistant: ")
    assert "[usage: " in out
    assert "[finish_reason=length]" in out


def test_fastapi_embed_example_streams_and_rejects_bad_input() -> None:
    app = start_http_process([sys.executable, str(EXAMPLES / "fastapi_embed.py"), "--port", "0"], "/openapi.json")
    try:
        answer = httpx.get(
            f"{app.base_url}/ask", params={"question": "Capital of France?", "max_tokens": 8}, timeout=120
        )
        assert answer.status_code == 200
        assert answer.text.strip()
        bad = httpx.get(f"{app.base_url}/ask", params={"question": "hi", "max_tokens": 0}, timeout=60)
        assert bad.status_code == 400
        assert "max_tokens" in bad.json()["detail"]
    finally:
        assert stop_server(app) in (0, -15), app.log()
    assert "Application shutdown complete" in app.log()


@pytest.mark.slow
def test_concurrent_agents_example() -> None:
    out = run_example("concurrent_agents.py", "--agents", "3", "--steps", "2", "--max-tokens", "8")
    assert "3 agents x 2 steps: 6 answered" in out
    assert out.count("[agent-") == 6


@pytest.mark.slow
def test_choose_executor_example_same_greedy_text_in_every_layout() -> None:
    out = run_example("choose_executor.py", "--max-tokens", "6")
    lines = [line for line in out.splitlines() if "start-up" in line]
    assert [line.split(":")[0].strip() for line in lines] == ["thread", "uni", "mp"]
    assert "reference" in lines[0]
    assert all("same text" in line for line in lines[1:]), out
