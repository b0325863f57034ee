"""Where the engine core runs: its own process (default) or a background thread of the client's process.

Both launchers start the same `EngineCoreProc` (busy loop and I/O threads) connected to the same client sockets
with the same launch message, so the client cannot tell them apart except by how the engine can end: a process
may be killed; a thread only ends by returning.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol

import msgspec

from asyncllm.engine.core_proc import CoreFactory, EngineCoreProc
from asyncllm.errors import ConfigError
from asyncllm.messages.engine import EngineLaunch
from asyncllm.utils.memory import release_freed_memory
from asyncllm.utils.process import (
    ChildProcess,
    launched_from_main_thread,
    start_module_process,
    stop_process,
)

ENGINE_MODULE = "asyncllm.engine.core_proc"


class EngineLauncher(Protocol):
    """A started engine core, as the client watches and stops it."""

    def wait(self) -> None:
        """Block until the engine core ended (for the client's death watcher thread)."""

    def has_exited(self) -> bool:
        """True once the engine core ended."""

    def describe_exit(self) -> str:
        """How it ended, for error messages (e.g. "exit code -9")."""

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` seconds for it to end after SHUTDOWN, then force it if it can be forced."""


def launch_engine(
    config: Any, input_address: str, output_address: str, ipc_dir: str, *, in_thread: bool, core_factory: CoreFactory
) -> EngineLauncher:
    """Start an engine core that connects to the client's sockets and sends its handshake.

    Args:
        config: the `EngineConfig`; crosses to the engine as msgpack in both modes.
        in_thread: run it in a background thread of this process instead of a `python -m` subprocess.
        core_factory: "pkg.module:callable" (both modes) or a callable (thread mode only); None = `EngineCore`.
    Raises:
        ConfigError: a callable `core_factory` in process mode.
    """
    launch = EngineLaunch(
        config=msgspec.Raw(msgspec.msgpack.encode(config)),
        input_address=input_address,
        output_address=output_address,
        ipc_dir=ipc_dir,
        parent_pid=os.getpid(),
        parent_is_main_thread=launched_from_main_thread(),
        core_factory=core_factory if isinstance(core_factory, str) else None,
    )
    if in_thread:
        return ThreadLauncher(launch, core_factory)
    if core_factory is not None and not isinstance(core_factory, str):
        raise ConfigError("in process mode core_factory must be an importable 'package.module:callable' string")
    return ProcessLauncher(start_module_process(ENGINE_MODULE, msgspec.msgpack.encode(launch), "asyncllm-engine"))


class ProcessLauncher:
    """The engine core in a `python -m asyncllm.engine.core_proc` child process."""

    def __init__(self, process: ChildProcess) -> None:
        self.process = process

    def wait(self) -> None:
        self.process.join()

    def has_exited(self) -> bool:
        return self.process.exitcode is not None

    def describe_exit(self) -> str:
        return f"the engine process exited with code {self.process.exitcode}"

    def stop(self, timeout_s: float) -> None:
        stop_process(self.process, timeout_s)
        self.process.close()


class ThreadLauncher:
    """The engine core in a daemon thread of this process (`EngineArgs(engine_process=False)`)."""

    def __init__(self, launch: EngineLaunch, core_factory: CoreFactory) -> None:
        self._launch = launch
        self._core_factory = core_factory
        self._thread = threading.Thread(target=self._run, name="asyncllm-engine-core", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from asyncllm.engine_config import EngineConfig

        launch = self._launch
        try:
            config = msgspec.msgpack.decode(launch.config, type=EngineConfig)
            EngineCoreProc(config, launch.input_address, launch.output_address, self._core_factory).run()
        except SystemExit:
            pass  # a failed start-up: the handshake carried the error
        finally:
            release_freed_memory()  # the engine's weights and KV cache leave this process's resident set

    def wait(self) -> None:
        self._thread.join()

    def has_exited(self) -> bool:
        return not self._thread.is_alive()

    def describe_exit(self) -> str:
        return "the engine thread ended"

    def stop(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
