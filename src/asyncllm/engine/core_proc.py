"""`EngineCoreProc`: the engine core in its own process, serving one client over ZeroMQ.

Threads: the main thread runs the busy loop (drain inputs, `EngineCore.step()`, queue outputs); an input thread
receives and decodes request frames from the client's ROUTER (our DEALER) into a queue; an output thread
encodes and sends `EngineCoreOutputs` to the client's PULL (our PUSH). Decoding and encoding never run on the
step loop. Malformed frames (bad type byte, undecodable payload, pickles) are logged and dropped: the decoders
are typed msgspec decoders, so nothing in a frame is ever executed.

Start-up: build the core, then send an `EngineHandshake` (ready info, or the start-up error) on the DEALER.
Death: an exception in a step sends the single frame `ENGINE_CORE_DEAD` and exits with code 1.
Follows vLLM v1's `vllm/v1/engine/core.py` (`EngineCoreProc`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
import traceback
from typing import Any

import msgspec
import zmq

from asyncllm.config import EngineConfig
from asyncllm.engine.busy_loop import run_busy_loop, wake_on_executor_failure
from asyncllm.messages.engine import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineHandshake,
    UtilityCall,
    UtilityResult,
)
from asyncllm.messages.serial import MsgpackDecoder, MsgpackEncoder
from asyncllm.utils.process import die_with_parent

logger = logging.getLogger(__name__)
HANDSHAKE_LINGER_MS = 2000
OUTPUT_FLUSH_TIMEOUT_S = 5.0
_REQUEST_TYPES = {t.value: t for t in EngineCoreRequestType}
_STOP = object()


def run_engine_core(
    config_bytes: bytes,
    *,
    input_address: str,
    output_address: str,
    ipc_dir: str,
    parent_pid: int,
    parent_is_main_thread: bool,
    core_factory: str | None = None,
) -> None:
    """Entry point of the engine process (started by `AsyncMPClient`); never returns (exits the process).

    Args:
        config_bytes: the `EngineConfig` as msgpack bytes.
        input_address, output_address: the client's ROUTER and PULL `ipc://` addresses.
        ipc_dir: the client's private socket directory (removed here if the parent dies).
        parent_pid, parent_is_main_thread: to exit with the parent (see `die_with_parent`).
        core_factory: "pkg.module:callable" building the core from the config (tests); default `EngineCore`.
    """
    die_with_parent(parent_pid, parent_is_main_thread, ipc_dir)
    multiprocessing.current_process().daemon = False  # the engine may start worker processes of its own
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine[%(process)d] %(levelname)s %(message)s")
    exit_code = 1
    try:
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        proc = EngineCoreProc(config, input_address, output_address, core_factory)
        exit_code = proc.run()
    except SystemExit as e:
        exit_code = e.code if isinstance(e.code, int) else 1
    finally:
        logging.shutdown()
        os._exit(exit_code)  # do not wait for I/O threads blocked in ZeroMQ calls


class EngineCoreProc:
    """The busy loop plus its two I/O threads. Construction builds the core and performs the handshake.

    Args:
        config: the engine config.
        input_address: where the client's ROUTER listens (we connect a DEALER).
        output_address: where the client's PULL listens (we connect a PUSH).
        core_factory: "pkg.module:callable" or None for `EngineCore`.
    """

    def __init__(
        self, config: EngineConfig, input_address: str, output_address: str, core_factory: str | None = None
    ) -> None:
        self._ctx = zmq.Context(io_threads=1)
        self._inputs: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self._outputs: queue.Queue[Any] = queue.Queue()
        input_socket = self._ctx.socket(zmq.DEALER)
        input_socket.setsockopt(zmq.LINGER, HANDSHAKE_LINGER_MS)
        input_socket.connect(input_address)
        try:
            self.core = _build_core(config, core_factory)
        except Exception as e:
            logger.exception("the engine core failed to start")
            handshake = EngineHandshake(error=f"{type(e).__name__}: {e}", error_type=type(e).__name__, pid=os.getpid())
            input_socket.send(msgspec.msgpack.encode(handshake))
            input_socket.close()
            self._ctx.term()
            raise SystemExit(1) from e
        wake_on_executor_failure(self.core, self._inputs)
        input_socket.send(msgspec.msgpack.encode(EngineHandshake(ready_info=self.core.ready_info, pid=os.getpid())))
        self._input_thread = threading.Thread(
            target=self._receive_inputs, args=(input_socket,), name="engine-input", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._send_outputs, args=(output_address,), name="engine-output", daemon=True
        )
        self._input_thread.start()
        self._output_thread.start()

    def run(self) -> int:
        """Serve until a SHUTDOWN request (returns 0) or a failed step (sends ENGINE_CORE_DEAD, returns 1)."""
        try:
            self._busy_loop()
            code = 0
        except Exception:
            logger.exception("the engine core died")
            self._outputs.put(ENGINE_CORE_DEAD)
            code = 1
        finally:
            self._outputs.put(_STOP)
            self._output_thread.join(OUTPUT_FLUSH_TIMEOUT_S)
            try:
                self.core.shutdown()
            except Exception:
                logger.exception("engine core shutdown failed")
        return code

    # ---- busy loop (main thread) ---------------------------------------------------------------------

    def _busy_loop(self) -> None:
        run_busy_loop(self.core, self._inputs, self._outputs.put)

    # ---- I/O threads ---------------------------------------------------------------------------------

    def _receive_inputs(self, socket: zmq.Socket[Any]) -> None:
        decoders = {
            EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityCall),
        }
        while True:
            try:
                frames = socket.recv_multipart(copy=False)
            except zmq.ZMQError:
                return  # the context was terminated
            try:
                self._inputs.put(decode_request([f.buffer for f in frames], decoders))
            except Exception as e:
                logger.warning("dropped a malformed request (%d frames): %s", len(frames), _brief(e))

    def _send_outputs(self, address: str) -> None:
        socket = self._ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 1000)
        socket.connect(address)
        encoder = MsgpackEncoder()
        while True:
            item = self._outputs.get()
            if item is _STOP:
                break
            if item is ENGINE_CORE_DEAD:
                socket.send(ENGINE_CORE_DEAD)
                continue
            socket.send_multipart(encode_outputs(encoder, item), copy=False)
        socket.close()


def decode_request(frames: list[memoryview], decoders: dict[EngineCoreRequestType, MsgpackDecoder]) -> tuple[Any, Any]:
    """Decode `[type byte, payload, *array frames]` into `(EngineCoreRequestType, payload object)`.

    Raises:
        ValueError: unknown type byte or missing payload.
        msgspec.DecodeError / msgspec.ValidationError: a payload that is not the expected struct.
    """
    if not frames:
        raise ValueError("empty message")
    kind = _REQUEST_TYPES.get(bytes(frames[0]))
    if kind is None:
        raise ValueError(f"unknown request type {bytes(frames[0][:8])!r}")
    if kind is EngineCoreRequestType.SHUTDOWN:
        return kind, None
    if len(frames) < 2:
        raise ValueError(f"{kind.name} without a payload")
    return kind, decoders[kind].decode(frames[1:])


def encode_outputs(encoder: MsgpackEncoder, outputs: EngineCoreOutputs) -> list[Any]:
    """Encode outputs; a utility result that cannot be encoded is replaced by an error result."""
    try:
        return encoder.encode(outputs)
    except TypeError as e:
        result = outputs.utility_result
        if result is None:
            raise
        error = UtilityResult(result.call_id, error=f"the result cannot be sent: {e}")
        return encoder.encode(EngineCoreOutputs(utility_result=error))


def _build_core(config: EngineConfig, core_factory: str | None) -> Any:
    if core_factory is None:
        from asyncllm.engine.core import EngineCore

        return EngineCore(config)
    import importlib

    module_name, _, attr = core_factory.partition(":")
    return getattr(importlib.import_module(module_name), attr)(config)


def _brief(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()[:200]
