"""vLLM code runs unchanged, and a user's script can always leave: real model, real engine process, subprocesses.

- vLLM's `examples/offline_inference/async_llm_streaming.py`, ported with only its imports and model name
  changed (`vllm_ports/async_llm_streaming.py`): `AsyncEngineArgs`, `generate(request_id=, prompt=,
  sampling_params=)` and `engine.shutdown()` called synchronously inside a coroutine, as vLLM's is.
- A script that leaves `asyncio.run(asyncio.wait_for(main(), T))` through `sys.exit()` after a structured-output
  request exits: no thread of ours (nor anyio's worker threads, which asyncllm no longer uses) keeps the
  interpreter alive (issue 32: it hung in `threading._shutdown`).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.mp

PORTS = Path(__file__).resolve().parent / "vllm_ports"
WARNING_SIGNS = ("Warning", "never awaited", "Exception ignored", "Task was destroyed", "Traceback")


def run_script(path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a script in a fresh interpreter that shows every warning (`-W default`)."""
    return subprocess.run(
        [sys.executable, "-W", "default", str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=path.parent,
    )


@pytest.mark.timeout(1200)
def test_vllms_async_llm_streaming_example_runs_unchanged_without_a_warning() -> None:
    result = run_script(PORTS / "async_llm_streaming.py", timeout=1100)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.count("✅ Generation complete!") == 3, out
    assert "🎉 All streaming examples completed!" in out
    assert out.rstrip().endswith("🔧 Shutting down engine...")
    for sign in WARNING_SIGNS:
        assert sign not in result.stderr, result.stderr


EXIT_SCRIPT = """
import asyncio
import sys

from asyncllm import AsyncLLM, EngineArgs, SamplingParams, StructuredOutputsParams


async def main():
    llm = await AsyncLLM.create(EngineArgs(num_kv_blocks=64, max_model_len=512, quantization=None))
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=choice)
    output = await llm.generate("Is the sky blue? Answer yes or no.", params).collect()
    print("answer:", output.outputs[0].text, flush=True)
    sys.exit(0)


asyncio.run(asyncio.wait_for(main(), 900))
"""


@pytest.mark.timeout(1200)
def test_a_script_leaving_asyncio_run_through_sys_exit_exits(tmp_path: Path) -> None:
    script = tmp_path / "leave_with_sys_exit.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    started = time.monotonic()
    result = run_script(script, timeout=1100)  # before the fix: hung for ever after printing the answer
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() in ("answer: yes", "answer: no"), result.stdout
    print(f"the script exited {time.monotonic() - started:.1f} s after it started")


@pytest.mark.timeout(1200)
def test_vllms_basic_offline_example_runs_unchanged_without_a_warning() -> None:
    result = run_script(PORTS / "basic.py", timeout=1100)
    assert result.returncode == 0, result.stdout + result.stderr
    prompts = [line for line in result.stdout.splitlines() if line.startswith("Prompt:")]
    assert prompts == [
        "Prompt:    'Hello, my name is'",
        "Prompt:    'The president of the United States is'",
        "Prompt:    'The capital of France is'",
        "Prompt:    'The future of AI is'",
    ]
    outputs = [line for line in result.stdout.splitlines() if line.startswith("Output:")]
    assert len(outputs) == 4
    assert all(len(line) > len("Output:    ''") for line in outputs)  # each generated some text
    for sign in WARNING_SIGNS:
        assert sign not in result.stderr, result.stderr
