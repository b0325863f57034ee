"""One real `asyncllm serve` (default model, 127.0.0.1, a free port) shared by the server tests of a session."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.server.server_helpers import ServerProcess, descendants, is_alive, start_server, stop_server, wait_for


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """The shared server; stopped with SIGTERM at the end, which must leave no process behind."""
    proc = start_server("--max-num-seqs", "64", "--quantization", "none")  # float32, as the tests expect
    children = descendants(proc.pid)
    yield proc
    code = stop_server(proc)
    assert code in (0, -signal.SIGTERM), proc.log()  # uvicorn re-raises the signal after a clean shutdown
    assert "Application shutdown complete" in proc.log()
    wait_for(lambda: not any(is_alive(pid) for pid in children), timeout=30)  # raises: orphans after SIGTERM


@pytest.fixture
def base_url(server: ServerProcess) -> str:
    return server.base_url
