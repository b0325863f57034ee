"""`AsyncMPClient`: the engine core in its own process, over ZeroMQ `ipc://` sockets and msgspec messages.

Sockets (ARCHITECTURE.md section 6): this client binds a ROUTER for requests and a PULL for outputs inside a
private 0700 temp directory; the engine connects a DEALER and a PUSH. Requests are sent synchronously from the
caller's thread (a send only queues the frames). Outputs are read by one reader task on the running event loop
(`zmq.asyncio`), which answers utility calls and queues step outputs for `get_output_async()`.

Death: a watcher thread waits on the process sentinel; when the engine process exits unexpectedly it marks the
client dead at once (`errored`, `check_health()`, `add_request()` raise) and pushes an `ENGINE_CORE_DEAD` frame
into our own PULL socket, so the reader fails every waiter within milliseconds, even when no output flows.
The engine itself sends `ENGINE_CORE_DEAD` when a step raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import wait as wait_for_handles
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from asyncllm import errors
from asyncllm.engine.client import EngineCoreClient
from asyncllm.engine.core_proc import run_engine_core
from asyncllm.engine.process import make_ipc_dir, remove_ipc_dir, start_engine_process, stop_process
from asyncllm.engine.protocol import (
    ENGINE_CORE_DEAD,
    UTILITY_METHODS,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineHandshake,
    UtilityCall,
    UtilityResult,
)
from asyncllm.engine.serial import MsgpackDecoder, MsgpackEncoder
from asyncllm.errors import EngineDeadError, EngineGenerateError

if TYPE_CHECKING:
    from asyncllm.config import EngineConfig

logger = logging.getLogger(__name__)
READY_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 5.0
POLL_INTERVAL_MS = 100


class AsyncMPClient(EngineCoreClient):
    """Starts an `EngineCoreProc` in a spawned process and talks to it over ZeroMQ.

    Args:
        config: the engine configuration (sent to the engine process as msgpack).
        ready_timeout_s: seconds to wait for the engine's handshake (model loading included).
        core_factory: "pkg.module:callable" building the core in the engine process (tests); None = EngineCore.
    Raises:
        EngineDeadError: the engine process failed to start or did not become ready in time; the message carries
            the engine's own error text. Start-up errors that are `asyncllm.errors` classes (e.g.
            `ModelNotFoundError`, `ExecutorError`) are raised as that class.
    """

    def __init__(self, config: EngineConfig, ready_timeout_s: float = READY_TIMEOUT_S, core_factory: str | None = None):
        self._closed = False
        self._dead: EngineDeadError | None = None
        self.ipc_dir = make_ipc_dir()
        try:  # every failure from here on removes the ipc directory (and whatever else was made)
            self._start(config, ready_timeout_s, core_factory)
        except BaseException:
            self._close_resources()
            raise
        self._stop_r, self._stop_w = os.pipe()
        self._watcher = threading.Thread(target=self._watch_process, name="asyncllm-engine-watch", daemon=True)
        self._watcher.start()
        # Safety net for a client dropped without shutdown(): at interpreter exit, stop the process, remove the dir.
        self._leftovers = weakref.finalize(self, _clean_up_leftovers, self.process, self.ipc_dir)

    # ---- EngineCoreClient ----------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._ensure_alive()
        self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self._closed and not self.errored:
            with contextlib.suppress(EngineDeadError):
                self._send(EngineCoreRequestType.ABORT, list(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        waiter = self._ensure_reader()
        while True:
            if self._outputs:
                return self._outputs.popleft()
            self._ensure_alive()
            await waiter.wait()
            waiter.clear()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_alive()
        if method not in UTILITY_METHODS:
            raise EngineGenerateError(f"unknown utility method {method!r}")
        self._ensure_reader()
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = (method, future)
        try:
            self._send(EngineCoreRequestType.UTILITY, UtilityCall(call_id, method, list(args)))
            return await future
        finally:
            self._pending_calls.pop(call_id, None)

    def shutdown(self) -> None:
        """Ask the engine to exit, wait (then terminate/kill), close the sockets, remove the ipc directory."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        with contextlib.suppress(EngineDeadError, zmq.ZMQError):
            self._send(EngineCoreRequestType.SHUTDOWN, None)
        stop_process(self.process, SHUTDOWN_TIMEOUT_S)
        self._watcher.join(SHUTDOWN_TIMEOUT_S)
        self._stop_reader_and_fail_waiters(EngineDeadError("the engine was shut down"))
        self._close_resources()
        self._leftovers.detach()

    # ---- start-up ------------------------------------------------------------------------------------

    def _start(self, config: EngineConfig, ready_timeout_s: float, core_factory: str | None) -> None:
        """Bind the sockets in `ipc_dir`, start the engine process, wait for its handshake."""
        input_address, output_address = f"ipc://{self.ipc_dir}/input", f"ipc://{self.ipc_dir}/output"
        self._output_address = output_address
        self._ctx = zmq.asyncio.Context(io_threads=1)
        self._sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(self._ctx.underlying)
        self._input = self._sync_ctx.socket(zmq.ROUTER)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished engine raises, never drops
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a busy engine: queue without limit
        self._input.bind(input_address)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        self._send_lock = threading.Lock()
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._outputs: deque[EngineCoreOutputs] = deque()
        self._waiter: asyncio.Event | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending_calls: dict[int, tuple[str, asyncio.Future[Any]]] = {}
        self._call_ids = itertools.count()
        self.process = start_engine_process(
            run_engine_core,
            config,
            input_address=input_address,
            output_address=output_address,
            ipc_dir=self.ipc_dir,
            core_factory=core_factory,
        )
        self._engine_identity = self._wait_for_handshake(ready_timeout_s)

    def _wait_for_handshake(self, timeout_s: float) -> bytes:
        """Wait for the engine's handshake; returns its DEALER identity. Raises if it failed or died."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._input.poll(POLL_INTERVAL_MS):
                frames = self._input.recv_multipart()
                try:
                    identity, payload = frames
                    handshake = msgspec.msgpack.decode(payload, type=EngineHandshake)
                except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as e:
                    logger.error("dropped a malformed handshake (%d frames): %s", len(frames), e)
                    continue
                if handshake.ready_info is None:
                    raise _startup_error(handshake)
                self.ready_info = handshake.ready_info
                return identity
            if self.process.exitcode is not None:
                code = self.process.exitcode
                raise EngineDeadError(
                    f"the engine process exited with code {code} before it was ready (its log is above; a script"
                    " that starts an engine must guard its entry point with `if __name__ == '__main__':`)"
                )
        raise EngineDeadError(f"the engine process was not ready within {timeout_s:.0f} s")

    # ---- requests ------------------------------------------------------------------------------------

    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        with self._send_lock:  # the encoder and the socket belong to one thread at a time
            frames: list[Any] = [self._engine_identity, kind.value]
            if payload is not None:
                frames += self._encoder.encode(payload)
            if self._closed and kind is not EngineCoreRequestType.SHUTDOWN:
                raise EngineDeadError("the engine was shut down")
            try:
                self._input.send_multipart(frames, copy=False)
            except zmq.ZMQError as e:  # EHOSTUNREACH: the engine's DEALER is gone
                raise EngineDeadError(f"cannot reach the engine process: {e}") from e

    def _ensure_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead)) from self._dead
        if self._closed:
            raise EngineDeadError("the engine was shut down")

    # ---- outputs (event loop) ------------------------------------------------------------------------

    def _ensure_reader(self) -> asyncio.Event:
        """Start the output reader task on the running loop unless it runs there; returns the output event."""
        loop = asyncio.get_running_loop()
        reader = self._reader
        if (
            self._dead is None
            and not self._closed
            and (reader is None or reader.done() or reader.get_loop() is not loop)
        ):
            self._waiter = asyncio.Event()
            self._reader = loop.create_task(self._read_outputs(), name="asyncllm-engine-output-reader")
        if self._waiter is None:
            self._waiter = asyncio.Event()
        return self._waiter

    async def _read_outputs(self) -> None:
        try:
            await self._read_outputs_until_death()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a bug here must not leave waiters hanging
            logger.exception("the engine output reader failed")
            self._on_death(EngineDeadError(f"the engine output reader failed: {e!r}"))

    async def _read_outputs_until_death(self) -> None:
        while True:
            try:
                frames = await self._output.recv_multipart(copy=False)
            except zmq.ZMQError as e:
                self._on_death(EngineDeadError(f"the output socket failed: {e}"))
                return
            if len(frames) == 1 and frames[0].bytes == ENGINE_CORE_DEAD:
                self._on_death(self._dead or EngineDeadError("the engine core died (ENGINE_CORE_DEAD)"))
                return
            try:
                outputs: EngineCoreOutputs = self._decoder.decode([f.buffer for f in frames])
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
                logger.error("dropped an undecodable output message: %s", e)
                continue
            if outputs.utility_result is not None:
                self._resolve_utility(outputs.utility_result)
            if outputs.outputs or outputs.finished_requests or outputs.failed_requests:
                self._outputs.append(outputs)
                if self._waiter is not None:
                    self._waiter.set()

    def _resolve_utility(self, result: UtilityResult) -> None:
        method, future = self._pending_calls.pop(result.call_id, (None, None))
        if future is None or future.done():
            return
        if result.error is not None:
            future.set_exception(EngineGenerateError(f"engine utility call {method} failed: {result.error}"))
            return
        try:
            future.set_result(msgspec.convert(result.result, UTILITY_METHODS[method or "echo"]))
        except msgspec.ValidationError as e:
            future.set_exception(EngineGenerateError(f"engine utility call {method} returned a bad result: {e}"))

    def _on_death(self, error: EngineDeadError) -> None:
        """On the loop: mark dead and fail every utility call and output waiter."""
        if self._dead is None:
            logger.error("%s", error)
            self._dead = error
        self._fail_waiters(error)

    def _fail_waiters(self, error: EngineDeadError) -> None:
        """On the loop: fail pending utility calls and wake `get_output_async()` (which then raises)."""
        for _, future in list(self._pending_calls.values()):
            if not future.done():
                future.set_exception(EngineDeadError(str(error)))
        self._pending_calls.clear()
        if self._waiter is not None:
            self._waiter.set()

    def _stop_reader_and_fail_waiters(self, error: EngineDeadError) -> None:
        """Cancel the reader task and wake waiters, on the reader's loop (from whatever thread calls this)."""
        reader = self._reader
        if reader is None or reader.done():
            return
        loop = reader.get_loop()

        done = threading.Event()

        def stop() -> None:
            reader.cancel()
            self._fail_waiters(error)
            done.set()

        if _running_loop() is loop:
            stop()
        elif loop.is_running():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stop)
                done.wait(SHUTDOWN_TIMEOUT_S)

    # ---- death watcher (thread) ----------------------------------------------------------------------

    def _watch_process(self) -> None:
        wait_for_handles([self.process.sentinel, self._stop_r])
        if self._closed:
            return
        if self._dead is None:
            code = self.process.exitcode
            self._dead = EngineDeadError(f"the engine process died (exit code {code}); create a new AsyncLLM")
            logger.error("%s", self._dead)
        self._push_dead_frame()

    def _push_dead_frame(self) -> None:
        """Wake the reader task through its own socket (thread-safe: a new socket owned by this thread)."""
        with contextlib.suppress(zmq.ZMQError):
            socket = self._sync_ctx.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 1000)
            socket.connect(self._output_address)
            socket.send(ENGINE_CORE_DEAD)
            socket.close()

    # ---- clean-up ------------------------------------------------------------------------------------

    def _close_resources(self) -> None:
        """Stop the process if it still runs (failed start-up), close the sockets, remove the ipc directory.

        Safe on a partly built client (a start-up that failed half-way): it closes only what exists.
        """
        self._closed = True
        try:
            process = getattr(self, "process", None)
            if process is not None and process.exitcode is None:
                stop_process(process, 0)
            for name in ("_input", "_output"):
                socket = getattr(self, name, None)
                if socket is not None:
                    socket.close(linger=0)
            ctx = getattr(self, "_ctx", None)
            if ctx is not None:
                ctx.term()
            for fd in (getattr(self, "_stop_r", None), getattr(self, "_stop_w", None)):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        finally:
            remove_ipc_dir(self.ipc_dir)


def _clean_up_leftovers(process: Any, ipc_dir: str) -> None:
    if process.exitcode is None:
        stop_process(process, 0)
    remove_ipc_dir(ipc_dir)


def _startup_error(handshake: EngineHandshake) -> BaseException:
    """The exception to raise for a failed start-up: the `asyncllm.errors` class it names, else EngineDeadError."""
    message = f"the engine process failed to start: {handshake.error}"
    error_class = getattr(errors, handshake.error_type or "", None)
    if isinstance(error_class, type) and issubclass(error_class, errors.AsyncLLMError):
        return error_class(message)
    return EngineDeadError(message)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
