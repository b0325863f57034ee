"""The start-up, death-watch and clean-up half of `EngineCoreClient` (`engine/client.py`), as its base class.

Start-up: bind the ROUTER (requests) and PULL (outputs) sockets in the client's private ipc directory, launch the
engine core (`engine/launcher.py`) and wait for its handshake. Death: a watcher thread waits for the engine to end
and, when it ends unexpectedly, marks the client dead and pushes an `ENGINE_CORE_DEAD` message into the client's
own PULL socket so every waiter wakes; the heartbeat watcher's silence does the same. Clean-up: stop an engine
still running after a failed start, remove the ipc directory, close the sockets once the output reader no longer
waits on them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import zmq

from asyncllm.engine.handshake import decode_handshake, startup_error
from asyncllm.engine.launcher import EngineLauncher, launch_engine
from asyncllm.errors import EngineDeadError
from asyncllm.messages.engine import ENGINE_CORE_DEAD, EngineReadyInfo
from asyncllm.utils.process import ChildProcess, remove_ipc_dir

if TYPE_CHECKING:
    from asyncllm.engine.core_proc import CoreFactory
    from asyncllm.engine_config import EngineConfig

logger = logging.getLogger("asyncllm.engine.client")  # one logger for the whole client (client.py logs there too)
READY_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 5.0
POLL_INTERVAL_MS = 100
DEATH_GRACE_S = 0.5  # the watcher lets the engine's own death message (with its reason) arrive first
SHUT_DOWN = "the engine was shut down"


class ClientLifecycle:
    """Start-up, death and clean-up of an engine-core client; `EngineCoreClient` adds sending and receiving.

    The state below is set by `EngineCoreClient.__init__` (and `_open_sockets`); it is shared by both halves.
    """

    ready_info: EngineReadyInfo
    ipc_dir: str
    launcher: EngineLauncher | None
    _closed: bool
    _dead: EngineDeadError | None
    _reader_active: bool
    _unresponsive: bool
    _send_lock: threading.Lock
    _io_lock: threading.RLock

    @property
    def process(self) -> ChildProcess | None:
        """The engine process (process mode), or None (thread mode)."""
        return getattr(self.launcher, "process", None)

    @property
    def errored(self) -> bool:
        """True once the engine died (sticky)."""
        return self._dead is not None

    # ---- start-up ------------------------------------------------------------------------------------

    def _start_engines(
        self, config: EngineConfig, input_address: str, in_thread: bool, core_factory: CoreFactory, timeout_s: float
    ) -> EngineLauncher:
        """Launch the engine core and wait for its handshake; returns `launcher` (also sets `ready_info` and the
        engine's identity)."""
        self.launcher = launcher = launch_engine(
            config, input_address, self._output_address, self.ipc_dir, in_thread=in_thread, core_factory=core_factory
        )
        self._engine_identity = self._wait_for_handshake(timeout_s)
        return launcher

    def _open_sockets(self) -> str:
        """Bind the ROUTER (requests) and PULL (outputs, plus an inproc wake-up address); returns the input
        address."""
        input_address, self._output_address = f"ipc://{self.ipc_dir}/input", f"ipc://{self.ipc_dir}/output"
        self._ctx = zmq.Context(io_threads=1)
        self._input = self._ctx.socket(zmq.ROUTER)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished engine raises, never drops
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a busy engine: queue without limit
        self._input.bind(input_address)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(self._output_address)
        self._wake_address = f"inproc://asyncllm-wake-{id(self)}-{os.getpid()}"
        self._output.bind(self._wake_address)  # wake-ups: no socket file, so they survive removing the ipc dir
        self._output_fd = int(self._output.getsockopt(zmq.FD))
        return input_address

    def _wait_for_handshake(self, timeout_s: float) -> bytes:
        """Wait for the engine's handshake; returns its DEALER identity. Raises if it failed or ended."""
        assert self.launcher is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._input.poll(POLL_INTERVAL_MS):
                decoded = decode_handshake(self._input.recv_multipart())
                if decoded is None:
                    continue
                identity, handshake = decoded
                if handshake.ready_info is None:
                    raise startup_error(handshake)
                self.ready_info = handshake.ready_info
                return identity
            if self.launcher.has_exited():
                raise EngineDeadError(f"the engine core failed to start: {self.launcher.describe_exit()}")
        raise EngineDeadError(f"the engine core was not ready within {timeout_s:.0f} s")

    # ---- death watcher (thread) ----------------------------------------------------------------------

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        if reason == SHUT_DOWN and self._closed:
            return  # our own wake-up at shutdown: `_ensure_alive` says "shut down"
        self._dead = EngineDeadError(f"the engine core died: {reason}; create a new AsyncLLM")
        logger.error("%s", self._dead)

    def _watch_engine(self) -> None:
        assert self.launcher is not None
        self.launcher.wait()
        if self._closed:
            return
        deadline = time.monotonic() + DEATH_GRACE_S
        while self._dead is None and time.monotonic() < deadline:
            time.sleep(0.01)  # a reader may be taking the engine's own death message (with its reason)
        reason = self.launcher.describe_exit()
        self._mark_dead(reason)
        self._push_dead_message(reason)

    def _mark_unresponsive(self, reason: str) -> None:
        """The heartbeat watcher heard nothing for `engine_timeout` seconds: dead, and wake every waiter."""
        self._unresponsive = True
        self._mark_dead(reason)
        self._push_dead_message(reason)

    def _push_dead_message(self, reason: str) -> None:
        """Wake a reader through its own socket (thread-safe: a new socket owned by this thread)."""
        with contextlib.suppress(zmq.ZMQError):
            socket = self._ctx.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 1000)
            socket.connect(self._wake_address)
            socket.send_multipart([ENGINE_CORE_DEAD, reason.encode()])
            socket.close()

    # ---- clean-up ------------------------------------------------------------------------------------

    def _close_resources(self) -> None:
        """Stop the engine if it still runs (failed start-up), remove the ipc directory, close the sockets (or
        leave that to the reader still waiting on them: it is woken by the message `shutdown` pushed). Safe on a
        partly built client (a start-up that failed half-way): it closes only what exists."""
        self._closed = True
        try:
            if self.launcher is not None and not self.launcher.has_exited():
                self.launcher.stop(0)
        finally:
            remove_ipc_dir(self.ipc_dir)
            self._release_sockets()

    def _release_sockets(self) -> None:
        """Close both sockets and the context once the client is closed and no reader waits on the output fd."""
        with self._send_lock, self._io_lock:
            ctx = getattr(self, "_ctx", None)
            if not self._closed or self._reader_active or ctx is None or ctx.closed:
                return
            for name in ("_input", "_output"):
                socket = getattr(self, name, None)
                if socket is not None:
                    socket.close(linger=0)
            ctx.term()


def clean_up_leftovers(launcher: EngineLauncher, ipc_dir: str) -> None:
    """The finalizer of a client dropped without `shutdown()`: stop its engine, remove its ipc directory."""
    if not launcher.has_exited():
        launcher.stop(0)
    remove_ipc_dir(ipc_dir)
