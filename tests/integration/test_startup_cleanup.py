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
from asyncllm.engine import mp_client
from asyncllm.engine.mp_client import AsyncMPClient

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
        AsyncMPClient(FAKE_CONFIG, core_factory=f"{HELPERS}:make_broken_core")
    assert _leftovers(temp_dir) == []


def test_broken_model_file_leaves_nothing(temp_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(256))
    config = EngineArgs(model=str(bad)).create_engine_config()
    with pytest.raises(EngineDeadError, match="failed to start"):  # the engine process fails to load it
        AsyncMPClient(config)
    assert _leftovers(temp_dir) == []


def test_process_start_failure_leaves_nothing(temp_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("An attempt has been made to start a new process before bootstrapping finished")

    monkeypatch.setattr(mp_client, "start_engine_process", refuse)
    with pytest.raises(RuntimeError, match="bootstrapping"):
        AsyncMPClient(FAKE_CONFIG, core_factory=f"{HELPERS}:make_fake_core")
    assert _leftovers(temp_dir) == []


NO_MAIN_GUARD = """
    import asyncio, sys
    from asyncllm import AsyncLLM, EngineArgs

    llm = AsyncLLM.from_engine_args(EngineArgs(model=sys.argv[1]))  # no `if __name__ == "__main__":`
    asyncio.run(llm.shutdown())
"""


def test_script_without_main_guard_leaves_nothing(tmp_path: pathlib.Path, model_path: str) -> None:
    """The issue's case: spawn re-runs the script in the engine process, which fails there and in the parent."""
    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(NO_MAIN_GUARD))
    env = {**os.environ, "TMPDIR": str(temp_dir), "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, str(script), model_path], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0
    assert "__main__" in result.stderr  # the parent's error names the missing main guard
    assert _leftovers(temp_dir) == []
