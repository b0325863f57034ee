"""The installed `asyncllm` console script: --help, generate, models, chat."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from tests.server.server_helpers import console_script

pytestmark = pytest.mark.mp


def run(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([console_script(), *args], input=stdin, capture_output=True, text=True, timeout=timeout)


def test_serve_help_lists_server_and_engine_flags() -> None:
    result = run("serve", "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    for flag in (
        "--host",
        "--port",
        "--api-key",
        "--root-path",
        "--allowed-origins",
        "--max-num-seqs",
        "--engine-process",
        "--no-engine-process",
        "--scheduling-policy",
        "--kv-cache-memory-bytes",
    ):
        assert flag in result.stdout


def test_serve_unknown_model_fails_fast_with_one_line(tmp_path: Path) -> None:
    result = run("serve", str(tmp_path / "missing.gguf"), "--port", "0", timeout=60)
    assert result.returncode == 1
    assert "ModelNotFoundError" in result.stderr
    assert "Traceback" not in result.stderr


def test_no_command_prints_usage_and_fails() -> None:
    result = run(timeout=60)
    assert result.returncode == 2
    assert "serve" in result.stdout


def test_models_lists_the_default_model_as_cached(model_path: str) -> None:
    result = run("models", timeout=60)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("smollm2-135m-instruct"))
    assert " yes " in line
    assert model_path in line


def test_generate_streams_a_greedy_answer() -> None:
    result = run("generate", "What is the capital of France?", "--max-tokens", "12", "--quantization", "none")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tokens in" in result.stderr


def test_generate_bad_argument_is_a_clear_error() -> None:
    result = run("generate", "hi", "--temperature", "-1", timeout=60)
    assert result.returncode == 1
    assert "temperature" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_chat_keeps_history_and_exits_on_eof() -> None:
    stdin = "My name is Ada.\nWhat is my name?\n"  # then end of input (Ctrl-D)
    result = run("chat", "--max-tokens", "16", stdin=stdin)
    assert result.returncode == 0, result.stderr
    answers = [part for part in result.stdout.split("> ") if part.strip()]
    assert len(answers) == 2
    turns = [line for line in result.stderr.splitlines() if "prompt tokens" in line]
    (prompt1, generated1), (prompt2, _) = [(int(t.split()[0][1:]), int(t.split()[3])) for t in turns]
    assert generated1 > 0
    # the second prompt holds the first question, the first answer and the second question
    assert prompt2 > prompt1 + generated1


@pytest.mark.slow
def test_chat_ctrl_c_stops_only_the_current_answer() -> None:
    cmd = [console_script(), "chat", "--max-tokens", "2000"]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with subprocess.Popen(cmd, text=True, start_new_session=True, **pipes) as process:  # type: ignore[call-overload]
        stderr_lines = read_in_background(process.stderr, lambda f: iter(f.readline, ""))
        stdout_chunks = read_in_background(process.stdout, lambda f: iter(lambda: f.read(1), ""))
        try:
            process.stdin.write("Tell me a very long story about the sea.\n")
            process.stdin.flush()
            text = ""
            while len(text) < 40:  # the answer is streaming
                text += stdout_chunks.get(timeout=240)
            os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole process group
            first_turn = next_matching(stderr_lines, "prompt tokens")
            generated = int(first_turn.split()[3])
            assert 0 < generated < 2000
            process.stdin.write("Thanks.\n")  # the chat goes on, with the stopped answer in its history
            process.stdin.close()
            second_turn = next_matching(stderr_lines, "prompt tokens")
            assert int(second_turn.split()[0][1:]) > int(first_turn.split()[0][1:]) + generated - 1
            assert process.wait(120) == 0
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    assert "[stopped]" in text + "".join(iter_queue(stdout_chunks))


def read_in_background(stream: Any, items: Callable[[Any], Iterable[str]]) -> queue.Queue[str]:
    """A daemon thread puts every item read from `stream` into the returned queue."""
    out: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [out.put(item) for item in items(stream)], daemon=True).start()
    return out


def next_matching(lines: queue.Queue[str], needle: str, timeout: float = 240) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        if needle in line:
            return line
    raise TimeoutError(needle)


def iter_queue(items: queue.Queue[str]) -> list[str]:
    out = []
    while not items.empty():
        out.append(items.get_nowait())
    return out
