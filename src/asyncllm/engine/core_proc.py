"""`EngineCoreProc`: the engine core serving one client over ZeroMQ, in its own process or in a thread.

Two launchers, one code path: process mode runs it as `python -m asyncllm.engine.core_proc` (launch message on
stdin, `main`); thread mode runs it in a background thread of the client's process (`engine/launcher.py`).
Threads: the busy-loop thread (the process's main thread) runs the busy loop (drain inputs, `EngineCore.step()`,
queue outputs); an input thread receives and decodes request frames from the client's ROUTER (our DEALER) into
a queue; an output thread encodes and sends `EngineCoreOutputs` to the client's PULL (our PUSH). Decoding and
encoding never run on the step loop. Malformed frames (bad type byte, undecodable payload, pickles) are logged
and dropped: the decoders are typed msgspec decoders, so nothing in a frame is ever executed.

Heartbeat (only with `ParallelConfig.engine_timeout`): a fourth thread sends heartbeats to the client
(engine/heartbeat.py). It shares nothing with the busy loop, so a long step never silences it; only a frozen
(SIGSTOPped, swapped-out, deadlocked-in-C) process does.

Start-up: build the core, then send an `EngineHandshake` (ready info, or the start-up error) on the DEALER.
Death: an exception in a step sends `[ENGINE_CORE_DEAD, reason]` and stops (the process exits with code 1).
Follows vLLM v1's `vllm/v1/engine/core.py` (`EngineCoreProc`).
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from asyncllm.engine.busy_loop import run_busy_loop, wake_on_executor_failure
from asyncllm.engine.heartbeat import heartbeat_address, heartbeat_interval, send_heartbeats
from asyncllm.engine_config import EngineConfig
from asyncllm.messages.engine import (
    CLIENT_REQUEST_TYPES,
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineHandshake,
    EngineLaunch,
    UtilityCall,
    UtilityResult,
)
from asyncllm.messages.serial import MessageDecodeError, MsgpackDecoder, MsgpackEncoder
from asyncllm.utils.process import die_with_parent, read_launch_message

logger = logging.getLogger(__name__)
HANDSHAKE_LINGER_MS = 2000
INPUT_POLL_MS = 100  # the input thread checks for shutdown this often while idle
OUTPUT_FLUSH_TIMEOUT_S = 5.0
_REQUEST_TYPES = {t.value: t for t in CLIENT_REQUEST_TYPES}
_STOP = object()
CoreFactory = str | Callable[[EngineConfig], Any] | None


def main() -> None:
    """Entry point of `python -m asyncllm.engine.core_proc`: read the `EngineLaunch` from stdin and serve."""
    launch = msgspec.msgpack.decode(read_launch_message(), type=EngineLaunch)
    run_engine_core(launch)


def run_engine_core(launch: EngineLaunch) -> None:
    """Run an engine-core process (started by `EngineCoreClient`); never returns (exits the process).

    Exits with the client's process (`die_with_parent`); exit code 0 after SHUTDOWN, 1 after a failed start-up or
    a failed step.
    """
    die_with_parent(launch.parent_pid, launch.parent_is_main_thread, launch.ipc_dir)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine[%(process)d] %(levelname)s %(message)s")
    exit_code = 1
    try:
        config = msgspec.msgpack.decode(launch.config, type=EngineConfig)
        proc = EngineCoreProc(config, launch.input_address, launch.output_address, launch.core_factory)
        exit_code = proc.run()
    except SystemExit as e:
        exit_code = e.code if isinstance(e.code, int) else 1
    finally:
        logging.shutdown()
        os._exit(exit_code)  # do not wait for I/O threads blocked in ZeroMQ calls


class EngineCoreProc:
    """The busy loop plus its two I/O threads, in an engine process or in a background thread of the client's
    process (the same code and frames in both). Construction builds the core and performs the handshake.

    Args:
        config: the engine config.
        input_address: where the client's ROUTER listens (we connect a DEALER).
        output_address: where the client's PULL listens (we connect a PUSH).
        core_factory: "pkg.module:callable", a callable (thread mode, tests), or None for `EngineCore`.
    Raises:
        SystemExit(1): the core failed to start (the handshake carried the error to the client).
    """

    def __init__(
        self, config: EngineConfig, input_address: str, output_address: str, core_factory: CoreFactory = None
    ) -> None:
        self._ctx = zmq.Context(io_threads=1)
        self._inputs: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self._outputs: queue.Queue[Any] = queue.Queue()
        self._stopping = threading.Event()
        self._rank = rank = config.parallel.data_parallel_rank
        self._death_prefix = f"data-parallel rank {rank}: " if config.parallel.data_parallel_size > 1 else ""
        input_socket = self._ctx.socket(zmq.DEALER)
        input_socket.setsockopt(zmq.LINGER, HANDSHAKE_LINGER_MS)
        input_socket.connect(input_address)
        try:
            self.core = _build_core(config, core_factory)
        except Exception as e:
            logger.exception("the engine core failed to start")
            error = f"{type(e).__name__}: {e}"
            handshake = EngineHandshake(
                error=error, error_type=type(e).__name__, pid=os.getpid(), data_parallel_rank=rank
            )
            input_socket.send(msgspec.msgpack.encode(handshake))
            input_socket.close()
            self._ctx.term()
            raise SystemExit(1) from e
        freeze_startup_heap()
        wake_on_executor_failure(self.core, self._inputs)
        ready = EngineHandshake(ready_info=self.core.ready_info, pid=os.getpid(), data_parallel_rank=rank)
        input_socket.send(msgspec.msgpack.encode(ready))
        self._input_thread = threading.Thread(
            target=self._receive_inputs, args=(input_socket,), name="engine-input", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._send_outputs, args=(output_address,), name="engine-output", daemon=True
        )
        self._input_thread.start()
        self._output_thread.start()
        if config.parallel.engine_timeout is not None:
            beats = (self._ctx, heartbeat_address(output_address), heartbeat_interval(config.parallel.engine_timeout))
            threading.Thread(
                target=send_heartbeats, args=(*beats, self._stopping), name="engine-heartbeat", daemon=True
            ).start()

    def run(self) -> int:
        """Serve until a SHUTDOWN request (returns 0) or a failed step (sends ENGINE_CORE_DEAD, returns 1).
        Stops both I/O threads and the core before returning."""
        try:
            run_busy_loop(self.core, self._inputs, self._outputs.put)
            code = 0
        except Exception as e:
            logger.exception("the engine core died")
            self._outputs.put((ENGINE_CORE_DEAD, f"{self._death_prefix}{type(e).__name__}: {e}"))
            code = 1
        finally:
            self._outputs.put(_STOP)
            self._output_thread.join(OUTPUT_FLUSH_TIMEOUT_S)
            self._stopping.set()
            self._input_thread.join(OUTPUT_FLUSH_TIMEOUT_S)
            try:
                self.core.shutdown()
            except Exception:
                logger.exception("engine core shutdown failed")
            if not self._output_thread.is_alive() and not self._input_thread.is_alive():
                self._ctx.term()  # else an I/O thread is stuck in ZeroMQ (a client that stopped reading): never
                # block on it; the process exits anyway (`os._exit`), a thread leaves the context to the GC
        return code

    # ---- I/O threads ---------------------------------------------------------------------------------

    def _receive_inputs(self, socket: zmq.Socket[Any]) -> None:
        decoders = {
            EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityCall),
        }
        while not self._stopping.is_set():
            if not socket.poll(INPUT_POLL_MS):
                continue
            frames = socket.recv_multipart(copy=False)
            try:
                self._inputs.put(decode_request([f.buffer for f in frames], decoders))
            except MessageDecodeError as e:
                logger.warning("dropped a malformed request (%d frames): %s", len(frames), _brief(e))
            except Exception:  # a decoder bug must not stop the engine's only input path either
                logger.exception("dropped a request the decoder failed on (%d frames)", len(frames))
        socket.close(linger=0)

    def _send_outputs(self, address: str) -> None:
        socket = self._ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 1000)
        socket.connect(address)
        encoder = MsgpackEncoder()
        while True:
            item = self._outputs.get()
            if item is _STOP:
                break
            if isinstance(item, tuple):  # (ENGINE_CORE_DEAD, reason)
                socket.send_multipart([item[0], item[1].encode()])
                continue
            if self._rank:
                stamp_engine_index(item, self._rank)
            socket.send_multipart(encode_outputs(encoder, item), copy=False)
        socket.close()


def decode_request(frames: list[memoryview], decoders: dict[EngineCoreRequestType, MsgpackDecoder]) -> tuple[Any, Any]:
    """Decode `[type byte, payload, *array frames]` into `(EngineCoreRequestType, payload object)`.

    Raises:
        MessageDecodeError: unknown type byte, missing payload, or a payload that is not the expected struct.
    """
    if not frames:
        raise MessageDecodeError("empty message")
    kind = _REQUEST_TYPES.get(bytes(frames[0]))
    if kind is None:
        raise MessageDecodeError(f"unknown request type {bytes(frames[0][:8])!r}")
    if kind is EngineCoreRequestType.SHUTDOWN:
        return kind, None
    if len(frames) < 2:
        raise MessageDecodeError(f"{kind.name} without a payload")
    return kind, decoders[kind].decode(frames[1:])


def stamp_engine_index(outputs: EngineCoreOutputs, rank: int) -> None:
    """Mark outputs (and their scheduler stats) as sent by the engine core of data-parallel rank `rank`."""
    outputs.engine_index = rank
    if outputs.scheduler_stats is not None:
        outputs.scheduler_stats = msgspec.structs.replace(outputs.scheduler_stats, engine_index=rank)


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


def _build_core(config: EngineConfig, core_factory: CoreFactory) -> Any:
    if core_factory is None:
        from asyncllm.engine.core import EngineCore

        return EngineCore(config)
    if callable(core_factory):
        return core_factory(config)
    import importlib

    module_name, _, attr = core_factory.partition(":")
    return getattr(importlib.import_module(module_name), attr)(config)


def freeze_startup_heap() -> None:
    """In the process that loaded torch (engine process, or the client's process in thread mode): move every
    object alive after start-up out of the cyclic collector's reach.

    With torch imported, a full (generation 2) collection scans every object torch created and holds the GIL
    meanwhile, stalling the busy loop and the event loop alike (`benchmarks/analysis.md`, "Garbage collection").
    Frozen objects are never scanned again (they
    are still freed by reference counting). vLLM does the same after start-up; see `gc.freeze` in the CPython
    documentation. Without torch (scripted test cores) nothing is frozen.
    """
    if "torch" in sys.modules:
        gc.collect()
        gc.freeze()


def _brief(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()[:200]


if __name__ == "__main__":
    main()
