"""`EngineCoreClient`: the frontend's one handle on the engine core, the same in both modes and on every loop.

Sockets (ARCHITECTURE.md section 6): the client binds a ROUTER for requests and a PULL for outputs inside a
private 0700 temp directory; the engine core (`EngineCoreProc`, started by `engine/launcher.py` in its own
`python -m` process or in a background thread of this process) connects a DEALER and a PUSH. Requests are sent
synchronously from the caller's thread (a send only queues the frames). Outputs are read by ONE background task
per client, the output reader, started on the event loop the client is first used from (and again on each later
loop, once the previous one has ended): it waits for the PULL socket's file descriptor with `anyio.wait_readable`,
drains it with `NOBLOCK` (re-checking `zmq.EVENTS` after every wake-up, because ZeroMQ signals that descriptor
edge-triggered), stores utility results for their callers, and hands every batch of outputs to the output sink
(the `AsyncLLM`'s `OutputHandler`, which processes it there and then) or, with no sink, queues it for
`get_output_async()`. So outputs, stop strings and stats move whether or not anyone waits, on asyncio and trio
alike (anyio; an asyncio task or a trio system task).

Death: a watcher thread waits for the engine (process or thread) to end; if it ends unexpectedly the client is
marked dead (`errored`, `check_health()`, `add_request()` raise) and an `ENGINE_CORE_DEAD` message is pushed into
our own PULL socket, so the reader, and through it every waiter, fails within milliseconds even when no output
flows. The engine core itself sends `[ENGINE_CORE_DEAD, reason]` when a step raises.

Unresponsive engine (only with `ParallelConfig.engine_timeout`): a `HeartbeatWatcher` (engine/heartbeat.py)
marks the client dead the same way when outputs are expected (requests in flight, a utility call) and the
engine sent no heartbeat for `engine_timeout` seconds; `shutdown()` then kills the process without waiting.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec
import zmq

from asyncllm.engine.handshake import decode_handshake, startup_error
from asyncllm.engine.heartbeat import HeartbeatWatcher
from asyncllm.engine.launcher import EngineLauncher, launch_engine
from asyncllm.errors import EngineDeadError, EngineGenerateError, InvalidRequestError
from asyncllm.messages.engine import (
    ENGINE_CORE_DEAD,
    UTILITY_METHODS,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineReadyInfo,
    UtilityCall,
    UtilityResult,
)
from asyncllm.messages.serial import MessageDecodeError, MsgpackDecoder, MsgpackEncoder
from asyncllm.utils.loops import LoopBinding, spawn_background_task
from asyncllm.utils.process import ChildProcess, make_ipc_dir, remove_ipc_dir

if TYPE_CHECKING:
    from asyncllm.engine.core_proc import CoreFactory
    from asyncllm.engine_config import EngineConfig

__all__ = ["READY_TIMEOUT_S", "SHUTDOWN_TIMEOUT_S", "EngineCoreClient", "OutputSink"]

logger = logging.getLogger("asyncllm.engine.client")
READY_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 5.0
POLL_INTERVAL_MS = 100
DEATH_GRACE_S = 0.5  # the watcher lets the engine's own death message (with its reason) arrive first
SHUT_DOWN = "the engine was shut down"


class OutputSink(Protocol):
    """What the output reader hands engine outputs to (`OutputHandler`); every method runs on the loop's thread,
    inside the reader task, and must not raise."""

    def process_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Process one batch (one engine step's outputs, a failure notice, or stats) now."""

    def stop(self, error: BaseException) -> None:
        """The reader ended for good: the engine died (`EngineDeadError`) or was shut down."""

    def expects_outputs(self) -> bool:
        """True while requests are in flight (the heartbeat watcher reports silence only then). Called from the
        watcher's thread."""


class EngineCoreClient:
    """Starts an engine core and talks to it over ZeroMQ with msgspec frames.

    Args:
        config: the engine configuration (crosses to the engine as msgpack in both modes).
        in_thread: run the engine core in a background thread of this process (default:
            `not config.parallel.engine_process`).
        ready_timeout_s: seconds to wait for the engine's handshake (model loading included).
        core_factory: builds the core in the engine (tests): "pkg.module:callable", or a callable in thread mode;
            None = `EngineCore`.
    Attributes:
        ready_info: KV block count, max model length and vocabulary size reported by the ready engine.
    Raises:
        EngineDeadError: the engine failed to start or was not ready in time; the message carries the engine's
            own error text. Start-up errors that are `asyncllm.errors` classes (e.g. `ModelNotFoundError`,
            `ConfigError`, `ExecutorError`) are raised as that class.
    """

    ready_info: EngineReadyInfo  # set by the engine's handshake (`_wait_for_handshake`)

    def __init__(
        self,
        config: EngineConfig,
        *,
        in_thread: bool | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
        core_factory: CoreFactory = None,
    ) -> None:
        self._closed = False
        self._dead: EngineDeadError | None = None
        self._send_lock = threading.Lock()
        self._io_lock = threading.RLock()  # guards closing the output socket against a reader
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._outputs: deque[EngineCoreOutputs] = deque()
        self._results: dict[int, UtilityResult] = {}
        self._pending_calls: set[int] = set()
        # Random start: a stray or forged utility answer (e.g. a late one, a frame replayed on the socket) cannot
        # be mistaken for the answer to a call of ours; answers to calls nobody waits for are dropped.
        self._call_ids = itertools.count(secrets.randbelow(1 << 62))
        self._loop = LoopBinding("this AsyncLLM")
        self._sink: OutputSink | None = None
        self._reader_active = False  # the output reader task runs (on `_reader_loop`) and waits on the output fd
        self._reader_loop: Any = None
        self._changed: anyio.Event | None = None  # set (and dropped) by the reader after each read: wakes waiters
        self._num_waiting = 0  # tasks waiting for a result (utility call, get_output_async)
        self._threads_joined = False  # shutdown() joined the watcher threads: the sockets and context may go
        self.launcher: EngineLauncher | None = None
        self._unresponsive = False
        self._heartbeat_watcher: HeartbeatWatcher | None = None
        in_thread = not config.parallel.engine_process if in_thread is None else in_thread
        self.ipc_dir = make_ipc_dir()
        try:  # every failure from here on removes the ipc directory (and whatever else was made)
            input_address = self._open_sockets()
            launcher = self._start_engines(config, input_address, in_thread, core_factory, ready_timeout_s)
        except BaseException:
            self._close_resources()
            raise
        self._watcher = threading.Thread(target=self._watch_engine, name="asyncllm-engine-watch", daemon=True)
        self._watcher.start()
        if config.parallel.engine_timeout is not None:
            self._heartbeat_watcher = HeartbeatWatcher(
                self._ctx,
                self._output_address,
                config.parallel.engine_timeout,
                is_waiting=self._expects_output,
                is_done=lambda: self._closed or self._dead is not None,
                on_silence=self._mark_unresponsive,
            )
        # Safety net for a client dropped without shutdown(): at interpreter exit, stop the engine, remove the dir.
        self._leftovers = weakref.finalize(self, clean_up_leftovers, launcher, self.ipc_dir)

    # ---- state ---------------------------------------------------------------------------------------

    @property
    def process(self) -> ChildProcess | None:
        """The engine process (process mode), or None (thread mode)."""
        return getattr(self.launcher, "process", None)

    @property
    def errored(self) -> bool:
        """True once the engine died (sticky)."""
        return self._dead is not None

    def check_health(self) -> None:
        """Raises `EngineDeadError` if the engine died or was shut down."""
        self._ensure_alive()

    def set_output_sink(self, sink: OutputSink) -> None:
        """Hand every batch of outputs to `sink` from now on (set once, before the first request)."""
        self._sink = sink

    def bind_to_current_loop(self) -> bool:
        """Bind to the running event loop (rebinding after a previous loop ended) and make sure the output reader
        runs on it; True when the binding changed.

        Raises:
            EventLoopError: another loop, still running in another thread, uses this client.
        """
        changed = self._loop.bind()
        if changed:
            self._changed = None  # waiters of an ended loop are gone
            if self._reader_loop is not self._loop.loop:
                self._reader_active = False  # a reader of an ended loop is gone (cancelled, or its loop closed)
        if not self._reader_active and not self._closed and self._dead is None:
            self._reader_active, self._reader_loop = True, self._loop.loop
            spawn_background_task(self._run_reader, name="asyncllm-output-reader")
        return changed

    # ---- requests ------------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest, data_parallel_rank: int | None = None) -> None:
        """Submit a request; returns at once. Raises `EngineDeadError` when the engine is dead, and
        `InvalidRequestError` for a `data_parallel_rank` other than None or 0 (one engine)."""
        self._ensure_alive()
        if data_parallel_rank not in (None, 0):
            raise InvalidRequestError(f"data_parallel_rank={data_parallel_rank!r}: the only engine rank is 0")
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests in the engine (unknown ids are ignored); the engine sends no output for them. Returns
        at once; a dead or shut-down engine is ignored (it holds nothing any more)."""
        if request_ids and not self._closed and not self.errored:
            with contextlib.suppress(EngineDeadError):
                self._send(EngineCoreRequestType.ABORT, list(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        """Wait for the next batch of engine outputs (a client without an output sink: tests, tools).

        Raises:
            EngineDeadError: the engine died (sticky) or was shut down.
            EventLoopError: another live event loop uses this client.
        """
        await self._wait_until(lambda: bool(self._outputs))
        return self._outputs.popleft()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Call `EngineCore.<method>(*args)` inside the engine; the result is decoded to the type
        `UTILITY_METHODS[method]` names (the same in both modes).

        Raises:
            EngineGenerateError: unknown method (nothing is sent), or the call raised inside a live engine.
            EngineDeadError: the engine died (also while waiting) or was shut down.
        """
        self._ensure_alive()
        if method not in UTILITY_METHODS:
            raise EngineGenerateError(f"unknown utility method {method!r}; known: {sorted(UTILITY_METHODS)}")
        call_id = next(self._call_ids)
        self._pending_calls.add(call_id)
        try:
            self._send(EngineCoreRequestType.UTILITY, UtilityCall(call_id, method, list(args)))
            await self._wait_until(lambda: call_id in self._results)
            result = self._results.pop(call_id)
        finally:
            self._pending_calls.discard(call_id)
            self._results.pop(call_id, None)
        if result.error is not None:
            raise EngineGenerateError(f"engine utility call {method} failed: {result.error}")
        try:
            return msgspec.convert(result.result, UTILITY_METHODS[method])
        except msgspec.ValidationError as e:
            raise EngineGenerateError(f"engine utility call {method} returned a bad result: {e}") from e

    async def call_utility_per_engine_async(self, method: str, *args: Any) -> dict[int, Any]:
        """`call_utility_async` per engine core, by data-parallel rank (here the one engine, rank 0)."""
        return {0: await self.call_utility_async(method, *args)}

    def shutdown(self) -> None:
        """Ask the engine to exit, wait (then force a process), close the sockets, remove the ipc directory.
        Idempotent; callable from any thread."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(EngineDeadError, zmq.ZMQError):
            self._send(EngineCoreRequestType.SHUTDOWN, None)
        if self.launcher is not None:  # an unresponsive engine will not exit by itself: force it at once
            self.launcher.stop(0 if self._unresponsive else SHUTDOWN_TIMEOUT_S)
        self._push_dead_message(SHUT_DOWN)  # wakes a reader blocked on another thread's loop
        self._watcher.join(SHUTDOWN_TIMEOUT_S)
        if self._heartbeat_watcher is not None:
            self._heartbeat_watcher.join(SHUTDOWN_TIMEOUT_S)  # it closes its socket before the context ends
        self._threads_joined = True  # from here on the output reader, when it ends after us, closes the sockets
        self._close_resources()
        self._leftovers.detach()

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

    # ---- sending -------------------------------------------------------------------------------------

    def _send(self, kind: EngineCoreRequestType, payload: Any, identity: bytes | None = None) -> None:
        """Send to the engine core whose DEALER has `identity` (None: the one engine core)."""
        with self._send_lock:  # the encoder and the socket belong to one thread at a time
            frames: list[Any] = [identity or self._engine_identity, kind.value]
            if payload is not None:
                frames += self._encoder.encode(payload)
            if self._closed and kind is not EngineCoreRequestType.SHUTDOWN:
                raise EngineDeadError(SHUT_DOWN)
            try:
                self._input.send_multipart(frames, copy=False)
            except zmq.ZMQError as e:  # EHOSTUNREACH: the engine's DEALER is gone
                raise EngineDeadError(f"cannot reach the engine core: {e}") from e

    def _ensure_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead)) from self._dead
        if self._closed:
            raise EngineDeadError(SHUT_DOWN)

    # ---- receiving (the output reader, a background task on the bound loop) -------------------------

    def _expects_output(self) -> bool:
        """True while a task waits for a result or requests are in flight (heartbeat watcher thread)."""
        sink = self._sink
        return self._num_waiting > 0 or bool(self._pending_calls) or (sink is not None and sink.expects_outputs())

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        """Wait until `ready()` (re-checked whenever the reader has read something).

        Raises:
            EngineDeadError: the engine died or was shut down before `ready()`.
            EventLoopError: another live event loop uses this client.
        """
        self.bind_to_current_loop()
        self._num_waiting += 1
        try:
            while not ready():
                self._ensure_alive()
                if self._changed is None:
                    self._changed = anyio.Event()
                await self._changed.wait()
        finally:
            self._num_waiting -= 1

    def _wake_waiters(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    async def _run_reader(self) -> None:
        """The output reader: read, hand outputs to the sink (a checkpoint between two engine steps' batches),
        wake waiters; until the engine dies or is shut down (then the sink is stopped), or the loop ends (then
        batches not yet handed over wait in `_outputs` for the reader of the next loop)."""
        loop, error = self._reader_loop, None
        try:
            while True:
                sink = self._sink  # first what a reader of an ended loop left, then every read
                while sink is not None and self._outputs:
                    sink.process_outputs(self._outputs.popleft())
                    await anyio.lowlevel.checkpoint()  # let the streams run between engine steps
                self._ensure_alive()
                await self._read_available()
                self._wake_waiters()
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as e:  # EngineDeadError, or a bug: either way nothing is read any more
            error = e
            if not isinstance(e, EngineDeadError):
                logger.exception("the output reader failed")
                self._mark_dead(f"the output reader failed: {e!r}")  # sticky, as any death: waiters raise
        finally:
            if self._reader_loop is loop:
                self._reader_active = False
            self._wake_waiters()
            if self._threads_joined:  # else shutdown() is still joining threads that use the context: it closes
                self._release_sockets()
        if error is not None and self._sink is not None:
            self._sink.stop(error)

    async def _read_available(self) -> None:
        """Wait until the output socket has a message, then take every message it has (at least one)."""
        while not self._output_has_message():
            await anyio.wait_readable(self._output_fd)
        with self._io_lock:
            while self._output_has_message():
                self._route(self._output.recv_multipart(zmq.NOBLOCK, copy=False))

    def _output_has_message(self) -> bool:
        """`zmq.EVENTS` says whether a message waits (the fd alone does not: it is edge-triggered)."""
        with self._io_lock:
            if self._output.closed:
                raise EngineDeadError(str(self._dead or SHUT_DOWN))
            return bool(int(self._output.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def _route(self, frames: list[zmq.Frame]) -> None:
        if frames and frames[0].bytes == ENGINE_CORE_DEAD:
            reason = frames[1].bytes.decode(errors="replace") if len(frames) > 1 else "unknown reason"
            self._mark_dead(reason)
            return
        try:
            outputs: EngineCoreOutputs = self._decoder.decode([f.buffer for f in frames])
        except MessageDecodeError as e:
            logger.error("dropped an undecodable output message: %s", e)
            return
        result = outputs.utility_result
        if result is not None and result.call_id in self._pending_calls:
            self._results[result.call_id] = result
        if outputs.outputs or outputs.finished_requests or outputs.failed_requests or outputs.scheduler_stats:
            self._outputs.append(outputs)


def clean_up_leftovers(launcher: EngineLauncher, ipc_dir: str) -> None:
    """The finalizer of a client dropped without `shutdown()`: stop its engine, remove its ipc directory."""
    if not launcher.has_exited():
        launcher.stop(0)
    remove_ipc_dir(ipc_dir)
