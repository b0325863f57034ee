"""Start and stop a real `asyncllm serve` (the installed console script) on 127.0.0.1 for tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 240.0  # model load + engine start on a loaded 2-core machine
STOP_TIMEOUT_S = 60.0


def console_script(name: str = "asyncllm") -> str:
    """Path of an installed console script next to the running interpreter."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is not installed (run scripts/setup.sh dev)")
    return str(path)


@dataclass
class ServerProcess:
    """A running `asyncllm serve` subprocess."""

    process: subprocess.Popen[bytes]
    log_path: Path
    base_url: str

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        """Resident set size of the server process (the HTTP frontend; the engine is a child process)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")


def start_server(*args: str, new_session: bool = False) -> ServerProcess:
    """`asyncllm serve --port 0 *args`; waits until /health answers 200.

    Args:
        new_session: run it in its own session and process group (to signal the group, as a terminal does).
    Raises:
        RuntimeError: the server exited or did not become healthy in time (with its log).
    """
    return start_http_process([console_script(), "serve", "--port", "0", *args], "/health", new_session)


def start_http_process(cmd: list[str], ready_path: str, new_session: bool = False) -> ServerProcess:
    """Start a uvicorn-based command (listening on port 0) and wait until `GET ready_path` answers 200.

    Raises:
        RuntimeError: the server exited or did not become healthy in time (with its log).
    """
    log = Path(tempfile.mkstemp(prefix="asyncllm-serve-", suffix=".log")[1])
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=new_session
        )
    server = ServerProcess(process, log, "")
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{cmd[:2]} exited with {process.returncode}:\n{server.log()}")
        match = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", server.log())
        if match:
            server.base_url = match.group(1)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.base_url}{ready_path}", timeout=5).status_code == 200:
                    return server
        time.sleep(0.3)
    stop_server(server)
    raise RuntimeError(f"{cmd[:2]} did not become ready in {STARTUP_TIMEOUT_S} s:\n{server.log()}")


def stop_server(server: ServerProcess, sig: int = signal.SIGTERM) -> int:
    """Signal the server and wait for it (kill it after `STOP_TIMEOUT_S`). Returns its exit code."""
    if server.process.poll() is None:
        server.process.send_signal(sig)
        try:
            server.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for pid in descendants(server.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            server.process.kill()
            server.process.wait()
    return server.process.returncode


def descendants(pid: int) -> list[int]:
    """Live processes below `pid` (from /proc parent links; zombies excluded)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[0] != "Z":
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def is_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.05) -> float:
    """Poll `condition` until true; returns the seconds it took.

    Raises:
        TimeoutError: not true within `timeout` seconds.
    """
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - start
