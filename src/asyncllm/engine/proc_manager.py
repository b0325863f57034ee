"""`EngineProcManager`: starts, watches and stops the data-parallel engine-core processes of one client.

To the client it is one `EngineLauncher` (`engine/launcher.py`): `wait()` returns when the first engine that is
not being retired ends, `describe_exit()` names that engine's rank and exit, `stop()` stops them all. So the
client's existing death watcher makes the client dead on the first unexpected engine death, with that engine's
reason. With `on_death` set (`restart_dead_engines=True`), a death is handed to that callback instead and `wait()`
keeps watching. Engines retired on purpose (`retire`, when scaling down) never count as deaths.
Follows the role of vLLM v1's `CoreEngineProcManager` (vllm/v1/engine/utils.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from asyncllm.engine.handshake import decode_handshake, startup_error
from asyncllm.engine.launcher import EngineLauncher
from asyncllm.errors import EngineDeadError
from asyncllm.messages.engine import EngineReadyInfo

if TYPE_CHECKING:
    from asyncllm.engine_config import EngineConfig

logger = logging.getLogger(__name__)
WATCH_INTERVAL_S = 0.05
HANDSHAKE_POLL_S = 0.05


def threads_per_engine(config: EngineConfig, num_engines: int) -> int | None:
    """Torch threads per worker of each engine: the configured `num_threads`, else the machine's CPUs split
    between every worker of every engine (backend "mp"), or the worker's Ray CPUs (backend "ray"); at least 1.
    None (torch's default) without data parallelism."""
    parallel = config.parallel
    if parallel.num_threads is not None or num_engines <= 1:
        return parallel.num_threads
    if parallel.data_parallel_backend == "ray":  # the engine's bundle: ray_cpus_per_worker per worker
        return max(1, int(parallel.ray_cpus_per_worker))
    return max(1, (os.cpu_count() or 1) // (num_engines * parallel.tensor_parallel_size))


def engine_config(config: EngineConfig, rank: int, num_engines: int) -> EngineConfig:
    """The config of the engine core of data-parallel `rank` out of `num_engines`."""
    parallel = dataclasses.replace(
        config.parallel,
        data_parallel_rank=rank,
        data_parallel_size=max(num_engines, config.parallel.data_parallel_size),
        num_threads=threads_per_engine(config, num_engines),
    )
    return dataclasses.replace(config, parallel=parallel)


def receive_handshakes(
    socket: zmq.Socket[Any], lock: threading.Lock, manager: EngineProcManager, ranks: list[int], timeout_s: float
) -> dict[int, tuple[bytes, EngineReadyInfo]]:
    """Wait for the handshake of every engine in `ranks` on the client's ROUTER `socket` (used under `lock`, so
    the client may keep serving other engines meanwhile).

    Returns:
        rank -> (DEALER identity, ready info).
    Raises:
        EngineDeadError (or the `asyncllm.errors` class of the engine's start-up error): an engine failed to
            start, ended, or was not ready within `timeout_s` seconds.
    """
    pending, ready, deadline = set(ranks), {}, time.monotonic() + timeout_s
    while pending:
        with lock:
            frames = socket.recv_multipart(zmq.NOBLOCK) if socket.poll(0) else None
        if frames is None:
            exited = manager.exited(pending)
            if exited:
                rank, how = exited[0]
                raise EngineDeadError(f"the engine core of data-parallel rank {rank} failed to start: {how}")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"data-parallel ranks {sorted(pending)} were not ready within {timeout_s:.0f} s")
            time.sleep(HANDSHAKE_POLL_S)
            continue
        decoded = decode_handshake(frames)
        if decoded is None:
            continue
        identity, handshake = decoded
        if handshake.ready_info is None:
            raise startup_error(handshake)
        if handshake.data_parallel_rank not in pending:
            logger.error("dropped a handshake of unexpected rank %d", handshake.data_parallel_rank)
            continue
        pending.discard(handshake.data_parallel_rank)
        ready[handshake.data_parallel_rank] = (identity, handshake.ready_info)
    return ready


class EngineProcManager:
    """The engine-core processes of one data-parallel client, by rank.

    Args:
        config: the engine config (per-rank copies are made with `engine_config`).
        launch: starts the engine core of a per-rank config (a process, or a Ray actor); its handshake is the
            client's to wait for.
        on_death: called (on the watcher thread) with (rank, description) when an engine dies unexpectedly;
            None = `wait()` returns instead (the client becomes dead).
    """

    def __init__(
        self,
        config: EngineConfig,
        launch: Callable[[EngineConfig], EngineLauncher],
        on_death: Callable[[int, str], None] | None = None,
    ) -> None:
        self._config = config
        self._launch = launch
        self._on_death = on_death
        self._lock = threading.Lock()
        self._engines: dict[int, EngineLauncher] = {}
        self._retired: list[EngineLauncher] = []
        self._dead: tuple[int, str] | None = None
        self._stopping = False
        self._exits_expected = False  # SHUTDOWN was sent to every engine: their exits are no deaths

    @property
    def ranks(self) -> list[int]:
        """Ranks of the engines started and not retired, ascending."""
        with self._lock:
            return sorted(self._engines)

    def start(self, rank: int, num_engines: int) -> EngineLauncher:
        """Start the engine core of `rank` (its handshake is the client's to wait for)."""
        launcher = self._launch(engine_config(self._config, rank, num_engines))
        with self._lock:
            self._engines[rank] = launcher
        return launcher

    def exited(self, ranks: set[int]) -> list[tuple[int, str]]:
        """(rank, how it ended) of every engine in `ranks` that ended."""
        with self._lock:
            found = [(r, self._engines[r]) for r in sorted(ranks) if r in self._engines]
        return [(rank, launcher.describe_exit()) for rank, launcher in found if launcher.has_exited()]

    def retire(self, rank: int) -> EngineLauncher | None:
        """Stop watching `rank` (it is being shut down on purpose); returns its launcher to stop."""
        with self._lock:
            launcher = self._engines.pop(rank, None)
            if launcher is not None:
                self._retired.append(launcher)
            return launcher

    def expect_exits(self) -> None:
        """Every engine is being shut down: from now on no exit counts as a death (`wait` returns on `stop`)."""
        with self._lock:
            self._exits_expected = True

    def stop_retired(self, launcher: EngineLauncher, timeout_s: float) -> None:
        """Stop a retired engine (after its SHUTDOWN): wait `timeout_s` seconds, then terminate, then kill."""
        with self._lock:
            if launcher not in self._retired:
                return
            self._retired.remove(launcher)
        launcher.stop(timeout_s)

    # ---- the EngineLauncher protocol (what the client's death watcher uses) ----------------------------

    def wait(self) -> None:
        """Block until an engine dies unexpectedly (without `on_death`), or every engine was stopped."""
        while True:
            with self._lock:
                if self._stopping:
                    return
                engines = {} if self._exits_expected else self._engines
                exited = [(rank, launcher) for rank, launcher in engines.items() if launcher.has_exited()]
            for rank, launcher in exited:
                description = launcher.describe_exit()
                if self._on_death is None:
                    self._dead = (rank, description)
                    return
                self.retire(rank)
                self._on_death(rank, description)
            time.sleep(WATCH_INTERVAL_S)

    def has_exited(self) -> bool:
        """True once every engine (watched or retired) ended."""
        with self._lock:
            return all(launcher.has_exited() for launcher in [*self._engines.values(), *self._retired])

    def describe_exit(self) -> str:
        """Which engine ended first and how."""
        if self._dead is not None:
            rank, description = self._dead
            return f"data-parallel rank {rank}: {description}"
        with self._lock:
            for rank, launcher in sorted(self._engines.items()):
                if launcher.has_exited():
                    return f"data-parallel rank {rank}: {launcher.describe_exit()}"
        return "the engines were stopped"

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` seconds for every engine to exit after SHUTDOWN, then terminate, then kill them
        (in parallel threads, so N engines take one timeout, not N)."""
        with self._lock:
            self._stopping = True
            launchers = [*self._engines.values(), *self._retired]
        threads = [threading.Thread(target=launcher.stop, args=(timeout_s,), daemon=True) for launcher in launchers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
