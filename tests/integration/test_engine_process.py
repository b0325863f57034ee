"""The engine core in its own process: death detection, clean shutdown, no orphans, hostile frames.

Tests that only exercise the process boundary use scripted cores (tests/integration/engine_helpers.py, no torch
in the engine process); death and hostile-frame tests also run on the real SmolLM2 model.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import zmq

from asyncllm import AsyncLLM, EngineArgs, EngineDeadError, EngineGenerateError, SamplingParams
from asyncllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from asyncllm.engine.client import EngineCoreClient
from asyncllm.messages.engine import EngineCoreRequestType, SchedulerStats
from asyncllm.model.loading.tokenizer import Tokenizer
from tests.integration.conftest import EngineFactory
from tests.integration.engine_helpers import FAKE_TOKENS

pytestmark = pytest.mark.mp
module_loop = pytest.mark.asyncio(loop_scope="module")  # async tests share the module-scoped engine's loop

PARIS_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
FAKE_CONFIG = EngineConfig(ModelConfig("fake", "fake"), CacheConfig(), SchedulerConfig(), ParallelConfig())
HELPERS = "tests.integration.engine_helpers"


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def fake_client(factory: str = "make_fake_core", **kw) -> EngineCoreClient:
    return EngineCoreClient(FAKE_CONFIG, core_factory=f"{HELPERS}:{factory}", **kw)


def is_gone(pid: int) -> bool:
    """True when `pid` no longer runs (absent, or a zombie nobody reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def child_pids(pid: int) -> set[int]:
    """Live direct children of `pid` (from /proc)."""
    children = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                children.add(int(entry.name))
    return children


def wait_until(predicate, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer.load(model_path)


@pytest.fixture(scope="module")
def mode() -> str:
    """The shared `llm` runs its engine core in its own process."""
    return "process"


# ---- real model ---------------------------------------------------------------------------------------


@module_loop
async def test_garbage_frames_and_a_pickle_bomb_are_dropped(llm: AsyncLLM, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Bomb:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    bomb = pickle.dumps(Bomb())
    client = llm._client
    assert isinstance(client, EngineCoreClient)
    identity = client._engine_identity
    hostile = [
        [identity, bomb],
        [identity, EngineCoreRequestType.ADD.value, bomb],
        [identity, EngineCoreRequestType.UTILITY.value, bomb],
        [identity, EngineCoreRequestType.ABORT.value, b"\xc1\xff\x00garbage"],
        [identity, b"\x42", b"unknown type"],
        [identity, EngineCoreRequestType.ADD.value],
        [identity, EngineCoreRequestType.ADD.value, os.urandom(4096)],
    ]
    with client._send_lock:
        for frames in hostile:
            client._input.send_multipart(frames)
    # The frontend's own output socket gets the same treatment from a rogue peer.
    rogue = zmq.Context.instance().socket(zmq.PUSH)
    rogue.setsockopt(zmq.LINGER, 1000)
    rogue.connect(client._output_address)
    for frames in ([bomb], [b"\x93garbage"], [os.urandom(64), os.urandom(8)]):
        rogue.send_multipart(frames)
    rogue.close()

    outputs = [out async for out in llm.generate(PARIS_QUESTION, greedy(32))]
    assert outputs[-1].outputs[0].text == "The capital of France is Paris."
    assert not marker.exists(), "a pickle payload was executed"
    assert llm.is_running
    assert client.process.exitcode is None
    stats = await llm.get_scheduler_stats()
    assert stats.num_total_blocks == 128


@module_loop
async def test_utility_calls_cross_the_process_boundary(llm: AsyncLLM) -> None:
    client = llm._client
    stats = await client.call_utility_async("get_scheduler_stats")
    assert isinstance(stats, SchedulerStats)
    assert stats.num_total_blocks == 128
    assert await client.call_utility_async("echo", 1, "x", [2.5]) == [1, "x", [2.5]]
    (model_info,) = await llm.collective_rpc("get_model_info")  # one worker
    assert model_info[1] == 49152  # (max_model_len, vocab_size) from worker 0
    with pytest.raises(EngineGenerateError, match="unknown utility method"):
        await client.call_utility_async("shutdown")
    with pytest.raises(EngineGenerateError, match="no_such_method"):
        await llm.collective_rpc("no_such_method")
    await llm.check_health()


@module_loop
async def test_reset_prefix_cache_makes_a_repeated_prompt_miss(llm: AsyncLLM) -> None:
    prompt = {"prompt_token_ids": list(range(300, 340))}  # 40 tokens: two full 16-token blocks
    await llm.generate(prompt, greedy(1)).collect()
    repeated = await llm.generate(prompt, greedy(1)).collect()
    assert repeated.num_cached_tokens == 32
    assert await llm.reset_prefix_cache() is True
    after_reset = await llm.generate(prompt, greedy(1)).collect()
    assert after_reset.num_cached_tokens == 0
    stats = await llm.get_scheduler_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_frontend_process_does_not_load_torch(tmp_path: Path, model_path: str) -> None:
    script = f"""
        import asyncio, sys
        from asyncllm import AsyncLLM, EngineArgs, SamplingParams

        async def main():
            llm = AsyncLLM.from_engine_args(EngineArgs(model={model_path!r}, num_kv_blocks=64, quantization=None))
            async with llm:
                outs = [o async for o in llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0))]
            print("torch" in sys.modules, len(outs[-1].outputs[0].token_ids))

        asyncio.run(main())  # no `if __name__ == "__main__":` guard needed
    """
    path = tmp_path / "frontend.py"
    path.write_text(textwrap.dedent(script))
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["False", "3"]


@module_loop
async def test_sigkill_with_two_live_streams_raises_engine_dead_within_5s(make_llm: EngineFactory) -> None:
    llm = make_llm(engine_process=True)
    client = llm._client
    assert isinstance(client, EngineCoreClient)
    streams = [llm.generate(f"Count to a thousand, part {i}:", greedy(2000, ignore_eos=True)) for i in range(2)]
    for stream in streams:
        first = await asyncio.wait_for(stream.__anext__(), 30)
        assert not first.finished

    async def drain(stream) -> float:
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        return time.monotonic()

    drains = [asyncio.create_task(drain(s)) for s in streams]
    killed_at = time.monotonic()
    os.kill(client.process.pid, signal.SIGKILL)
    raised_at = await asyncio.wait_for(asyncio.gather(*drains), 10)
    assert max(raised_at) - killed_at < 5.0, f"streams raised {max(raised_at) - killed_at:.1f} s after the kill"
    assert llm.errored
    assert not llm.is_running
    with pytest.raises(EngineDeadError):
        await llm.check_health()
    with pytest.raises(EngineDeadError):
        llm.generate("Hello", greedy(4))
    with pytest.raises(EngineDeadError):
        await llm.get_scheduler_stats()
    await llm.shutdown()
    assert not await asyncio.to_thread(os.path.exists, client.ipc_dir)


@module_loop
async def test_bad_model_file_error_reaches_the_user(tmp_path: Path, model_path: str) -> None:
    bad = tmp_path / "broken.gguf"  # a whole header (the frontend reads and checks it), then truncated weights
    data = await asyncio.to_thread(Path(model_path).read_bytes)
    await asyncio.to_thread(bad.write_bytes, data[: int(len(data) * 0.6)])
    args = EngineArgs(model=str(bad), engine_process=True)
    config = args.create_engine_config()
    with pytest.raises(EngineDeadError, match=r"failed to start: \w+Error: \S"):
        EngineCoreClient(config)


# ---- scripted cores: the boundary alone --------------------------------------------------------------


@module_loop
async def test_an_exception_in_one_request_fails_only_that_request(tokenizer: Tokenizer) -> None:
    client = fake_client("make_picky_core")
    llm = AsyncLLM(FAKE_CONFIG, tokenizer, client)
    async with llm:
        good = llm.generate({"prompt_token_ids": [1, 2]}, greedy(5, ignore_eos=True), request_id="good")
        bad = llm.generate({"prompt_token_ids": [1, 2]}, greedy(5, ignore_eos=True), request_id="bad-1")
        with pytest.raises(EngineGenerateError, match="cannot take bad-1"):
            async for _ in bad:
                pass
        outputs = [out async for out in good]
        assert outputs[-1].outputs[0].token_ids == (FAKE_TOKENS * 2)[:5]
        assert llm.is_running
        again = [out async for out in llm.generate({"prompt_token_ids": [3]}, greedy(2), request_id="after-bad")]
        assert again[-1].finished


@module_loop
async def test_exception_in_a_step_sends_engine_core_dead_and_the_process_exits(tokenizer: Tokenizer) -> None:
    client = fake_client("make_failing_core")
    llm = AsyncLLM(FAKE_CONFIG, tokenizer, client)
    stream = llm.generate({"prompt_token_ids": [1, 2]}, greedy(50, ignore_eos=True))
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass
    assert llm.errored
    assert await asyncio.to_thread(wait_until, lambda: client.process.exitcode is not None, 5)
    assert client.process.exitcode == 1
    with pytest.raises(EngineDeadError):
        llm.generate("Hello", greedy(2))
    await llm.shutdown()


def test_sockets_live_in_a_private_directory_removed_at_shutdown() -> None:
    client = fake_client()
    try:
        assert stat.S_IMODE(os.stat(client.ipc_dir).st_mode) == 0o700
        assert sorted(os.listdir(client.ipc_dir)) == ["input", "output"]
        assert client.ready_info.num_kv_blocks > 0
    finally:
        client.shutdown()
    client.shutdown()  # idempotent
    assert not os.path.exists(client.ipc_dir)
    assert client.process.exitcode == 0, "the engine did not exit cleanly on SHUTDOWN"


@module_loop
async def test_death_of_an_idle_engine_is_noticed_without_outputs(tokenizer: Tokenizer) -> None:
    client = fake_client()
    llm = AsyncLLM(FAKE_CONFIG, tokenizer, client)
    stats = await llm.get_scheduler_stats()  # the output reader runs; nothing else flows
    assert stats.num_running_reqs == 0
    os.kill(client.process.pid, signal.SIGKILL)
    assert await asyncio.to_thread(wait_until, lambda: llm.errored, 5.0), "death not noticed within 5 s"
    with pytest.raises(EngineDeadError, match="died"):
        await llm.check_health()
    with pytest.raises(EngineDeadError):
        llm.generate({"prompt_token_ids": [1]}, greedy(2))
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(llm.get_scheduler_stats(), 5)
    await llm.shutdown()
    assert not await asyncio.to_thread(os.path.exists, client.ipc_dir)


def test_handshake_timeout_stops_the_process_and_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    resource_tracker.ensure_running()
    before = child_pids(os.getpid())
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="not ready within 3 s"):
        fake_client("make_sleepy_core", ready_timeout_s=3.0)
    assert time.monotonic() - started < 15
    assert wait_until(lambda: child_pids(os.getpid()) <= before, 5)
    assert list(tmp_path.iterdir()) == []


@module_loop
async def test_twenty_start_shutdown_cycles_leave_no_processes_or_files(
    tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    resource_tracker.ensure_running()  # one helper per interpreter (spawn starts it once), not per engine
    before = child_pids(os.getpid())
    engine_pids = []
    for cycle in range(20):
        client = fake_client()
        engine_pids.append(client.process.pid)
        assert Path(client.ipc_dir).parent == tmp_path
        llm = AsyncLLM(FAKE_CONFIG, tokenizer, client)
        outputs = [out async for out in llm.generate({"prompt_token_ids": [1]}, greedy(3, ignore_eos=True))]
        assert outputs[-1].outputs[0].token_ids == FAKE_TOKENS
        if cycle % 2 == 0:
            await llm.shutdown()
        else:  # dropped without shutdown(): garbage collection ends the engine
            del llm, client, outputs
            await asyncio.to_thread(gc.collect)
    assert await asyncio.to_thread(wait_until, lambda: all(is_gone(pid) for pid in engine_pids), 10)
    assert child_pids(os.getpid()) <= before
    assert await asyncio.to_thread(lambda: list(tmp_path.iterdir())) == []


ORPHAN_SCRIPT = """
import asyncio, json, sys, threading
from asyncllm import AsyncLLM, EngineArgs, SamplingParams

def start(box):
    box.append(AsyncLLM.from_engine_args(EngineArgs(model=sys.argv[1], num_kv_blocks=64, quantization=None)))

async def main():
    box = []
    if sys.argv[2] == "sigkill_started_from_a_thread":  # no PDEATHSIG then: the parent-pid watcher must act
        thread = threading.Thread(target=start, args=(box,))
        thread.start()
        thread.join()  # the starting thread is gone; the engine must live on
    else:
        start(box)
    llm = box[0]
    outputs = [o async for o in llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0))]
    client, num_tokens = llm._client, len(outputs[-1].outputs[0].token_ids)
    info = {"engine_pid": client.process.pid, "ipc_dir": client.ipc_dir, "tokens": num_tokens}
    print(json.dumps(info), flush=True)
    if sys.argv[2] != "interpreter_exit":  # otherwise return without shutdown(): GC/atexit must end the engine
        await asyncio.sleep(3600)

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.parametrize("exit_kind", ["sigkill", "sigkill_started_from_a_thread", "interpreter_exit"])
def test_user_process_death_leaves_no_engine_behind(tmp_path: Path, model_path: str, exit_kind: str) -> None:
    script = ORPHAN_SCRIPT
    path = tmp_path / "user_service.py"
    path.write_text(script)
    with subprocess.Popen(
        [sys.executable, str(path), model_path, exit_kind], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    ) as proc:
        try:
            info = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
            engine_pid, ipc_dir = info["engine_pid"], info["ipc_dir"]
            assert info["tokens"] == 2
            if exit_kind != "interpreter_exit":
                assert not is_gone(engine_pid)
                proc.kill()
            proc.wait(30)
            assert wait_until(lambda: is_gone(engine_pid), 10), "the engine process outlived its parent"
            assert wait_until(lambda: not os.path.exists(ipc_dir), 2), "the socket directory was left behind"
        finally:
            if proc.poll() is None:
                proc.kill()
