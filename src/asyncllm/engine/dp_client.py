"""`DPEngineCoreClient`: N data-parallel engine cores behind one client, over the same two sockets.

Design: one client for all engines rather than N clients. Every engine core connects its DEALER to our one
ROUTER and its PUSH to our one PULL (`EngineCoreClient`'s sockets, in its private 0700 directory); the ROUTER
sends each request to the DEALER identity of the engine chosen for it, and outputs from every engine arrive on
the one PULL stamped with their `engine_index`. So the read path, the output handler and the death watcher of
`EngineCoreClient` serve N engines unchanged, and `data_parallel_size=1` is simply `EngineCoreClient`.

- Placement: `engine/load_balancer.py` (least running + waiting, prefix-cache affinity, pinning by rank).
- Processes: `engine/proc_manager.py` (start, watch, stop; torch threads split between engines).
- Aborts go to the engine holding each request; utility calls go to every engine and are combined
  (`UTILITY_COMBINERS`): stats summed, `reset_prefix_cache` true when every engine reset, `collective_rpc`
  results concatenated by engine rank then worker rank.
- Death: the first unexpected engine death makes the client dead with that engine's reason; with
  `restart_dead_engines=True` the dead engine's requests fail (`EngineGenerateError`) and a fresh engine takes
  its rank.
- `scale_data_parallel(n)`: new engines take the lowest free ranks; removed engines (the highest ranks) first
  drain (no new requests; in-flight ones finish normally), then shut down. Remaining ranks keep their numbers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import zmq

from asyncllm.engine.client import READY_TIMEOUT_S, SHUTDOWN_TIMEOUT_S, EngineCoreClient
from asyncllm.engine.dp_utility import UTILITY_COMBINERS, decode_utility_result
from asyncllm.engine.launcher import EngineLauncher, launch_engine
from asyncllm.engine.load_balancer import LoadBalancer
from asyncllm.engine.proc_manager import EngineProcManager, receive_handshakes
from asyncllm.engine.ray_engines import RayEngines
from asyncllm.errors import ConfigError, EngineDeadError, EngineGenerateError
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
from asyncllm.messages.serial import MsgpackEncoder
from asyncllm.utils.threads import run_in_daemon_thread

if TYPE_CHECKING:
    from asyncllm.engine.core_proc import CoreFactory
    from asyncllm.engine_config import EngineConfig

logger = logging.getLogger(__name__)
RANK_DEATH_PREFIX = "data-parallel rank "


def make_engine_client(config: EngineConfig) -> EngineCoreClient:
    """The client for `config`: `DPEngineCoreClient` when `data_parallel_size > 1`, else `EngineCoreClient`."""
    if config.parallel.data_parallel_size > 1:
        return DPEngineCoreClient(config)
    return EngineCoreClient(config)


class DPEngineCoreClient(EngineCoreClient):
    """`config.parallel.data_parallel_size` engine-core processes behind one `EngineCoreClient` interface.

    Args:
        config: the engine config (`data_parallel_size` engines; `engine_process` must be True).
        ready_timeout_s: seconds to wait for every engine's handshake.
        core_factory: "pkg.module:callable" building each core (tests); None = `EngineCore`.
    Attributes:
        ready_info: the engines' common `max_model_len` and `vocab_size`; `num_kv_blocks` summed.
    Raises:
        ConfigError: thread mode, or a callable `core_factory`.
        EngineDeadError: an engine failed to start or was not ready in time (every engine is stopped then).
    """

    def __init__(
        self, config: EngineConfig, *, ready_timeout_s: float = READY_TIMEOUT_S, core_factory: CoreFactory = None
    ) -> None:
        if not config.parallel.engine_process:
            raise ConfigError("data_parallel_size > 1 needs engine_process=True (engine cores in processes)")
        if core_factory is not None and not isinstance(core_factory, str):
            raise ConfigError("with data parallelism core_factory must be a 'package.module:callable' string")
        self._config = config
        self._identities: dict[int, bytes] = {}  # rank -> DEALER identity of its engine core
        self._ready_infos: dict[int, EngineReadyInfo] = {}
        self._balancer = LoadBalancer(config.cache.block_size, config.cache.enable_prefix_caching)
        self._lb_lock = threading.RLock()  # the balancer is used by the loop thread and the death watcher
        self._call_ranks: dict[int, int] = {}  # utility call id -> rank
        self._scaling = False
        self._ray_engines: RayEngines | None = None
        super().__init__(config, in_thread=False, ready_timeout_s=ready_timeout_s, core_factory=core_factory)

    # ---- state ---------------------------------------------------------------------------------------

    @property
    def data_parallel_size(self) -> int:
        """Engines serving or draining now."""
        return len(self._identities)

    @property
    def engine_ranks(self) -> list[int]:
        """Ranks of the engines serving or draining now, ascending."""
        return sorted(self._identities)

    def num_in_flight(self, rank: int) -> int:
        """This client's unfinished requests on engine `rank`."""
        with self._lb_lock:
            return self._balancer.num_in_flight(rank)

    # ---- requests ------------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest, data_parallel_rank: int | None = None) -> None:
        """Send a request to the engine the load balancer picks (or to `data_parallel_rank`).

        Raises:
            InvalidRequestError: `data_parallel_rank` is not a serving rank.
            EngineDeadError: the client is dead or shut down.
        """
        self._ensure_alive()
        with self._lb_lock:
            rank = self._balancer.choose(request, data_parallel_rank)
            self._balancer.track(request, rank)
        self._send(EngineCoreRequestType.ADD, request, self._identities[rank])

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests in the engines holding them (unknown ids are ignored). Returns at once."""
        if not request_ids or self._closed or self.errored:
            return
        with self._lb_lock:
            groups = self._balancer.group_by_owner(request_ids)
        for rank, ids in groups.items():
            identity = self._identities.get(rank)
            if identity is not None:
                with contextlib.suppress(EngineDeadError):
                    self._send(EngineCoreRequestType.ABORT, ids, identity)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Call `EngineCore.<method>(*args)` in every engine and combine the results (`UTILITY_COMBINERS`).

        Raises:
            EngineGenerateError: unknown method, a method without a combining rule, or the call failed.
            EngineDeadError: the client is dead or shut down.
        """
        combine = UTILITY_COMBINERS.get(method)
        if combine is None and method in UTILITY_METHODS:
            raise EngineGenerateError(f"{method}: no rule combines its results over engines; use per_engine calls")
        results = await self.call_utility_per_engine_async(method, *args)
        assert combine is not None
        return combine([results[rank] for rank in sorted(results)])

    async def call_utility_per_engine_async(self, method: str, *args: Any) -> dict[int, Any]:
        """Call `EngineCore.<method>(*args)` in every engine; the results by rank.

        Raises: as `EngineCoreClient.call_utility_async` (naming the rank whose call failed).
        """
        self._ensure_alive()
        if method not in UTILITY_METHODS:
            raise EngineGenerateError(f"unknown utility method {method!r}; known: {sorted(UTILITY_METHODS)}")
        calls = {rank: next(self._call_ids) for rank in self.engine_ranks}
        try:
            for rank, call_id in calls.items():
                self._call_ranks[call_id] = rank
                self._pending_calls.add(call_id)
                self._send(
                    EngineCoreRequestType.UTILITY, UtilityCall(call_id, method, list(args)), self._identities[rank]
                )
            await self._wait_until(lambda: all(call_id in self._results for call_id in calls.values()))
            results = {rank: self._results.pop(call_id) for rank, call_id in calls.items()}
        finally:
            for call_id in calls.values():
                self._results.pop(call_id, None)
                self._call_ranks.pop(call_id, None)
                self._pending_calls.discard(call_id)
        return {rank: decode_utility_result(method, rank, result) for rank, result in results.items()}

    def shutdown(self) -> None:
        """Ask every engine to exit, wait (then terminate, then kill), close the sockets, remove the directory."""
        if self._closed:
            return
        self._manager.expect_exits()
        for identity in list(self._identities.values()):
            with contextlib.suppress(EngineDeadError, zmq.ZMQError):
                self._send(EngineCoreRequestType.SHUTDOWN, None, identity)
        super().shutdown()

    # ---- scaling -------------------------------------------------------------------------------------

    async def scale_data_parallel(self, num_engines: int) -> None:
        """Grow to `num_engines` engines (new ones take the lowest free ranks) or shrink to it (the highest ranks
        drain, then stop). Requests on the other engines are untouched.

        Raises:
            ConfigError: `num_engines` < 1, or another scaling is under way.
            EngineDeadError: the client died, or a new engine failed to start (it is stopped again).
        """
        if not isinstance(num_engines, int) or num_engines < 1:
            raise ConfigError(f"scale_data_parallel({num_engines!r}): must be an integer >= 1")
        if self._scaling:
            raise ConfigError("scale_data_parallel: another scaling is under way")
        self._ensure_alive()
        self._scaling = True
        try:
            ranks = self.engine_ranks
            if num_engines > len(ranks):
                free = [r for r in range(num_engines + len(ranks)) if r not in ranks][: num_engines - len(ranks)]
                await run_in_daemon_thread(self._start_ranks, free, num_engines, name="asyncllm-dp-start")
            elif num_engines < len(ranks):
                await self._remove_ranks(ranks[num_engines:])
        finally:
            self._scaling = False

    def _start_ranks(self, ranks: list[int], num_engines: int) -> None:
        self._restore_socket_dir()
        for rank in ranks:
            self._manager.start(rank, num_engines)
        try:
            self._await_handshakes(ranks, READY_TIMEOUT_S)
        except BaseException:
            for rank in ranks:
                self._identities.pop(rank, None)
                launcher = self._manager.retire(rank)
                if launcher is not None:
                    self._manager.stop_retired(launcher, 0)
            raise

    async def _remove_ranks(self, ranks: list[int]) -> None:
        with self._lb_lock:
            for rank in ranks:
                self._balancer.stop_accepting(rank)
        await self._wait_until(lambda: all(self.num_in_flight(rank) == 0 for rank in ranks))
        for rank in ranks:
            launcher = self._manager.retire(rank)
            identity = self._identities.pop(rank)
            with self._lb_lock:
                self._balancer.remove_engine(rank)
            with contextlib.suppress(EngineDeadError):
                self._send(EngineCoreRequestType.SHUTDOWN, None, identity)
            if launcher is not None:
                await run_in_daemon_thread(
                    self._manager.stop_retired, launcher, SHUTDOWN_TIMEOUT_S, name="asyncllm-dp-stop"
                )
        if self._engine_identity not in self._identities.values():
            self._engine_identity = self._identities[min(self._identities)]

    # ---- start-up ------------------------------------------------------------------------------------

    def _start_engines(
        self, config: EngineConfig, input_address: str, in_thread: bool, core_factory: CoreFactory, timeout_s: float
    ) -> EngineProcManager:
        on_death = self._on_engine_death if config.parallel.restart_dead_engines else None
        factory = core_factory if isinstance(core_factory, str) else None
        if self._ray_engines is not None:
            ray_engines, output_address = self._ray_engines, self._engine_output_address

            def launch(engine_config: EngineConfig) -> EngineLauncher:
                return ray_engines.launch(engine_config, input_address, output_address, factory)
        else:

            def launch(engine_config: EngineConfig) -> EngineLauncher:
                return launch_engine(
                    engine_config,
                    input_address,
                    self._output_address,
                    self.ipc_dir,
                    in_thread=False,
                    core_factory=factory,
                )

        self._manager = EngineProcManager(config, launch, on_death)
        self.launcher = self._manager
        num_engines = config.parallel.data_parallel_size
        for rank in range(num_engines):
            self._manager.start(rank, num_engines)
        self._await_handshakes(list(range(num_engines)), timeout_s)
        self._engine_identity = self._identities[0]
        infos = list(self._ready_infos.values())
        self.ready_info = EngineReadyInfo(
            num_kv_blocks=sum(i.num_kv_blocks for i in infos),
            max_model_len=min(i.max_model_len for i in infos),
            vocab_size=infos[0].vocab_size,
            hidden_size=infos[0].hidden_size,
        )
        return self._manager

    def _await_handshakes(self, ranks: list[int], timeout_s: float) -> None:
        """Wait for the handshake of every engine in `ranks`, then let the load balancer use them."""
        ready = receive_handshakes(self._input, self._send_lock, self._manager, ranks, timeout_s)
        for rank, (identity, info) in ready.items():
            self._identities[rank] = identity
            self._ready_infos[rank] = info
        with self._lb_lock:
            for rank in ranks:
                self._balancer.add_engine(rank)

    def _open_sockets(self) -> str:
        """The client's sockets (`EngineCoreClient._open_sockets`); with backend "ray" both are also bound to
        TCP on this node's address as Ray reports it, and engines connect there. Returns the engines' input
        address."""
        input_address = super()._open_sockets()
        self._engine_output_address = self._output_address
        if self._config.parallel.data_parallel_backend != "ray":
            return input_address
        self._ray_engines = RayEngines(self._config.parallel)
        host = self._ray_engines.node_ip()
        input_port = self._input.bind_to_random_port(f"tcp://{host}")
        output_port = self._output.bind_to_random_port(f"tcp://{host}")
        self._engine_output_address = f"tcp://{host}:{output_port}"
        return f"tcp://{host}:{input_port}"

    def _close_resources(self) -> None:
        """As `EngineCoreClient._close_resources`, then shut down a Ray this client started."""
        try:
            super()._close_resources()
        finally:
            ray_engines, self._ray_engines = self._ray_engines, None
            if ray_engines is not None:
                ray_engines.shutdown()

    def _restore_socket_dir(self) -> None:
        """An engine ended by SIGTERM removes the socket directory (see `utils/process.die_with_parent`); make it
        again and rebind, so that new engines can connect (connected ones are unaffected)."""
        if self._ray_engines is not None or os.path.exists(self._output_address.removeprefix("ipc://")):
            return
        os.makedirs(self.ipc_dir, mode=0o700, exist_ok=True)
        input_address = f"ipc://{self.ipc_dir}/input"
        with self._send_lock, self._io_lock:
            for socket, address in ((self._input, input_address), (self._output, self._output_address)):
                with contextlib.suppress(zmq.ZMQError):
                    socket.unbind(address)
                socket.bind(address)

    # ---- receiving -----------------------------------------------------------------------------------

    def _route(self, frames: list[zmq.Frame]) -> None:
        """As `EngineCoreClient._route`, also updating the load balancer; with restarts on, an engine's own death
        message is left to the process watcher (which restarts that engine)."""
        if frames and frames[0].bytes == ENGINE_CORE_DEAD and self._config.parallel.restart_dead_engines:
            reason = frames[1].bytes.decode(errors="replace") if len(frames) > 1 else ""
            if reason.startswith(RANK_DEATH_PREFIX):
                logger.error("engine core died: %s", reason)
                return
        queued = len(self._outputs)
        super()._route(frames)
        if len(self._outputs) > queued:
            with self._lb_lock:
                self._balancer.observe(self._outputs[-1])

    # ---- death and restart (watcher thread) ----------------------------------------------------------

    def _on_engine_death(self, rank: int, description: str) -> None:
        """`restart_dead_engines=True`: fail the dead engine's requests and calls, then start a fresh engine in
        its rank (the client becomes dead only if that fails)."""
        reason = f"the engine core of data-parallel rank {rank} died ({description})"
        logger.error("%s: its requests fail; restarting it", reason)
        with self._lb_lock:
            lost = self._balancer.remove_engine(rank)
        self._identities.pop(rank, None)
        calls = [call_id for call_id, r in list(self._call_ranks.items()) if r == rank]
        self._push_outputs(EngineCoreOutputs(failed_requests=dict.fromkeys(lost, reason), engine_index=rank))
        for call_id in calls:
            self._push_outputs(EngineCoreOutputs(utility_result=UtilityResult(call_id, error=reason)))
        if self._closed:
            return
        try:
            self._start_ranks([rank], max(len(self._identities) + 1, 1))
            if self._engine_identity not in self._identities.values():
                self._engine_identity = self._identities[min(self._identities)]
        except Exception as e:
            message = f"{reason}; restarting it failed: {e}"
            self._mark_dead(message)
            self._push_dead_message(message)

    def _push_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Deliver outputs made here (failures of a dead engine's requests) through our own PULL socket."""
        with contextlib.suppress(zmq.ZMQError):
            socket = self._ctx.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 1000)
            socket.connect(self._wake_address)
            socket.send_multipart(MsgpackEncoder().encode(outputs))
            socket.close()
