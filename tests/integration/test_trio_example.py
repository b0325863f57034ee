"""The examples run as a user runs them (a fresh interpreter), on the real model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
@pytest.mark.mp  # the example starts its engine in a process of its own
def test_trio_stream_example_answers_and_aborts_the_cut_short_request(model_path: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "trio_stream.py"),
            "--model",
            model_path,
            "--max-tokens",
            "16",
            "--quantization",
            "none",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "assistant: The capital of France is Paris." in result.stdout
    assert "running requests after the nursery: 0" in result.stdout
