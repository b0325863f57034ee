"""The installed `asyncllm` console script: --help, generate, models, chat."""

from __future__ import annotations

import subprocess

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
    result = run("generate", "What is the capital of France?", "--max-tokens", "12")
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
