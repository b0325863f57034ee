"""Every failed start removes its private socket directory: no `asyncllm-*` folder is left in the temp dir."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap

import pytest

from asyncllm import AsyncLLM, EngineArgs, EngineDeadError, ModelNotFoundError
from asyncllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from asyncllm.engine import launcher
from asyncllm.engine.client import EngineCoreClient

pytestmark = pytest.mark.mp
FAKE_CONFIG = EngineConfig(ModelConfig("fake", "fake"), CacheConfig(), SchedulerConfig(), ParallelConfig())
HELPERS = "tests.integration.engine_helpers"


@pytest.fixture
def temp_dir(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """A fresh directory that `tempfile` (and so `make_ipc_dir`) uses for this test."""
    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


def _leftovers(path: pathlib.Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("asyncllm-"))


def test_missing_model_path_leaves_nothing(temp_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(ModelNotFoundError, match=str(missing)):
        AsyncLLM.from_engine_args(EngineArgs(model=str(missing)))
    assert _leftovers(temp_dir) == []


def test_handshake_failure_leaves_nothing(temp_dir: pathlib.Path) -> None:
    with pytest.raises(EngineDeadError, match="broken on purpose"):
        EngineCoreClient(FAKE_CONFIG, core_factory=f"{HELPERS}:make_broken_core")
    assert _leftovers(temp_dir) == []


def test_broken_model_file_leaves_nothing(temp_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(256))
    config = EngineArgs(model=str(bad)).create_engine_config()
    with pytest.raises(EngineDeadError, match="failed to start"):  # the engine process fails to load it
        EngineCoreClient(config)
    assert _leftovers(temp_dir) == []


def test_process_start_failure_leaves_nothing(temp_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("An attempt has been made to start a new process before bootstrapping finished")

    monkeypatch.setattr(launcher, "start_module_process", refuse)
    with pytest.raises(RuntimeError, match="bootstrapping"):
        EngineCoreClient(FAKE_CONFIG, core_factory=f"{HELPERS}:make_fake_core")
    assert _leftovers(temp_dir) == []


NO_MAIN_GUARD = """
    import asyncio, sys
    from asyncllm import AsyncLLM, EngineArgs, SamplingParams

    llm = AsyncLLM.from_engine_args(EngineArgs(model=sys.argv[1], num_kv_blocks=64))  # no __main__ guard
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    print(asyncio.run(llm.generate(messages, params).collect()).outputs[0].text)
    asyncio.run(llm.shutdown())
"""


def test_script_without_main_guard_works_and_leaves_nothing(tmp_path: pathlib.Path, model_path: str) -> None:
    """The engine process is `python -m asyncllm.engine.core_proc`: the user's script is never re-imported."""
    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(NO_MAIN_GUARD))
    env = {**os.environ, "TMPDIR": str(temp_dir), "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, str(script), model_path], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "The capital of France is Paris."
    assert _leftovers(temp_dir) == []
