"""Heartbeats: how the client tells a frozen engine from a busy one (only with `ParallelConfig.engine_timeout`).

The engine's heartbeat thread (`send_heartbeats`, beside the busy loop, sharing nothing with it) sends
`ENGINE_HEARTBEAT` to a PULL socket of the client's every `heartbeat_interval(engine_timeout)` seconds. The
client's `HeartbeatWatcher` thread reads them; when engine output is expected and no beat came for
`engine_timeout` seconds (a SIGSTOPped, swapped-out or deadlocked-in-C engine process), it reports the engine
unresponsive. A long step keeps beating, so it is never taken for a frozen engine. vLLM's V0 multiprocessing
client had a heartbeat tied to its engine loop (which long steps silenced); vLLM V1 watches only the process.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import zmq

from asyncllm.messages.engine import ENGINE_HEARTBEAT

MAX_HEARTBEAT_INTERVAL_S = 1.0
POLL_INTERVAL_MS = 100


def heartbeat_address(output_address: str) -> str:
    """The client's heartbeat socket address, next to its output socket."""
    return f"{output_address}-heartbeat"


def heartbeat_interval(engine_timeout_s: float) -> float:
    """Seconds between two heartbeats: a quarter of the timeout, at most `MAX_HEARTBEAT_INTERVAL_S`."""
    return min(engine_timeout_s / 4, MAX_HEARTBEAT_INTERVAL_S)


def send_heartbeats(ctx: zmq.Context, address: str, interval_s: float, stopping: threading.Event) -> None:
    """Engine side (a thread of its own): send `ENGINE_HEARTBEAT` to `address` every `interval_s` seconds until
    `stopping` is set. Never blocks: a full queue towards a client that stopped reading drops the beat."""
    socket = ctx.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 4)
    socket.connect(address)
    while not stopping.wait(interval_s):
        with contextlib.suppress(zmq.Again):
            socket.send(ENGINE_HEARTBEAT, zmq.NOBLOCK)
    socket.close(linger=0)


class HeartbeatWatcher:
    """Client side: a daemon thread that binds the heartbeat socket and reports a silent engine.

    Args:
        ctx: the client's ZeroMQ context (the watcher closes its socket before returning, so join it before
            terminating the context).
        address: the client's output address (the heartbeat socket is bound next to it).
        timeout_s: seconds of silence after which the engine is unresponsive (`engine_timeout`).
        is_waiting: True while engine output is expected (requests in flight, a utility call): silence only
            matters then.
        is_done: True once the client shut down or the engine is known dead (the watcher ends).
        on_silence: called once, from the watcher thread, with the reason text.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        timeout_s: float,
        *,
        is_waiting: Callable[[], bool],
        is_done: Callable[[], bool],
        on_silence: Callable[[str], None],
    ) -> None:
        self._ctx, self._address, self._timeout_s = ctx, heartbeat_address(address), timeout_s
        self._is_waiting, self._is_done, self._on_silence = is_waiting, is_done, on_silence
        self._thread = threading.Thread(target=self._watch, name="asyncllm-engine-heartbeat", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` seconds for the watcher to end (after shutdown or death)."""
        self._thread.join(timeout_s)

    def _watch(self) -> None:
        socket = self._ctx.socket(zmq.PULL)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.bind(self._address)
            last_heard = time.monotonic()
            while not self._is_done():
                if socket.poll(POLL_INTERVAL_MS):
                    while socket.poll(0):
                        socket.recv(zmq.NOBLOCK)
                    last_heard = time.monotonic()
                    continue
                silent_s = time.monotonic() - last_heard
                if silent_s > self._timeout_s and self._is_waiting():
                    self._on_silence(
                        f"unresponsive: no heartbeat for {silent_s:.1f} s (engine_timeout={self._timeout_s:g} s)"
                    )
                    return
        finally:
            socket.close(linger=0)
