"""Data-parallel engine cores as Ray actors (`data_parallel_backend="ray"`; needs `pip install asyncllm[ray]`).

Each engine core runs the same `EngineCoreProc` (busy loop and I/O threads) as in an engine process, inside one
Ray actor. It connects its DEALER and PUSH to the client's ROUTER and PULL over ZeroMQ TCP on the client's node
address as Ray reports it (`ray.util.get_node_ip_address()`), so requests and outputs cross as the same msgspec
frames as in process mode; Ray itself only carries the launch message (msgpack bytes) and the actor's exit code.

Placement: inside a placement group already (e.g. a Ray job started in one), engine `rank` uses bundle `rank` of
it; otherwise each engine gets its own placement group of one bundle of `ray_cpus_per_worker x
tensor_parallel_size` CPUs, which Ray places on any node with room (so engines spread over a cluster's nodes,
and scaling or restarting one engine never touches the others' reservations). A bundle not granted within
`ray_placement_timeout_s` seconds is a `ConfigError` naming the resources. Ray is initialized with `ray_address`
(or `RAY_ADDRESS`) unless it already is; a cluster started here is shut down with the client.
Follows the role of vLLM's `DPEngineCoreActor` and `CoreEngineActorManager` (vllm/v1/engine/utils.py).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import msgspec

from asyncllm.errors import ConfigError
from asyncllm.messages.engine import EngineLaunch

if TYPE_CHECKING:
    from asyncllm.engine_config import EngineConfig, ParallelConfig

logger = logging.getLogger(__name__)


def import_ray() -> Any:
    """The `ray` module. Raises `ConfigError` when Ray is not installed."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError("data_parallel_backend='ray' needs Ray: pip install 'asyncllm[ray]'") from e
    return ray


class RayEngineCoreActor:
    """The body of one engine-core actor: `run` serves until SHUTDOWN (or a failed step) and returns the exit code
    (0 after SHUTDOWN, 1 after a failed start-up or step)."""

    def run(self, launch_bytes: bytes) -> int:
        """Start `EngineCoreProc` from the msgpack `EngineLaunch` and serve; blocks the actor's run thread."""
        from asyncllm.engine.core_proc import EngineCoreProc
        from asyncllm.engine_config import EngineConfig

        logging.basicConfig(level=logging.INFO, format="%(asctime)s engine[%(process)d] %(levelname)s %(message)s")
        launch = msgspec.msgpack.decode(launch_bytes, type=EngineLaunch)
        config = msgspec.msgpack.decode(launch.config, type=EngineConfig)
        try:
            proc = EngineCoreProc(config, launch.input_address, launch.output_address, launch.core_factory)
        except SystemExit:
            return 1  # the handshake carried the error to the client
        return proc.run()

    def get_pid(self) -> int:
        """The actor's process id."""
        return os.getpid()


class RayEngineLauncher:
    """One engine-core actor, as the process manager watches and stops it (the `EngineLauncher` protocol).

    Attributes:
        pid: the actor's process id.
    """

    def __init__(self, ray: Any, actor: Any, launch_bytes: bytes, placement_group: Any | None) -> None:
        self._ray = ray
        self._actor = actor
        self._placement_group = placement_group  # our own, removed on stop; None = the shared current one
        self._run = actor.run.remote(launch_bytes)
        self.pid = int(ray.get(actor.get_pid.remote()))

    def wait(self) -> None:
        self._ray.wait([self._run], num_returns=1, timeout=None)

    def has_exited(self) -> bool:
        ready, _ = self._ray.wait([self._run], num_returns=1, timeout=0)
        return bool(ready)

    def describe_exit(self) -> str:
        try:
            return f"the engine actor returned exit code {self._ray.get(self._run, timeout=0)}"
        except Exception as e:
            return f"the engine actor died ({type(e).__name__})"

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` seconds for `run` to return after SHUTDOWN, then kill the actor; remove its
        placement group."""
        self._ray.wait([self._run], num_returns=1, timeout=timeout_s)
        try:
            self._ray.kill(self._actor, no_restart=True)
        except Exception as e:
            logger.warning("could not kill an engine actor: %s", e)
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._placement_group)
            except Exception as e:
                logger.warning("could not remove an engine's placement group: %s", e)
            self._placement_group = None


class RayEngines:
    """Ray for one data-parallel client: initializes it, places and starts engine-core actors, shuts it down.

    Raises (construction):
        ConfigError: Ray is not installed.
    """

    def __init__(self, parallel: ParallelConfig) -> None:
        self._ray = ray = import_ray()
        self._parallel = parallel
        self._started_ray = False
        if not ray.is_initialized():
            ray.init(address=parallel.ray_address, log_to_driver=False)
            self._started_ray = True

    def node_ip(self) -> str:
        """This (the client's) node address as Ray reports it: engines connect to the client's sockets there."""
        return str(self._ray.util.get_node_ip_address())

    def cpus_per_engine(self) -> float:
        """CPUs each engine's bundle reserves: `ray_cpus_per_worker` per tensor-parallel rank."""
        return self._parallel.ray_cpus_per_worker * self._parallel.tensor_parallel_size

    def launch(
        self, config: EngineConfig, input_address: str, output_address: str, core_factory: str | None = None
    ) -> RayEngineLauncher:
        """Place and start the engine core of `config.parallel.data_parallel_rank`.

        Raises:
            ConfigError: the placement group's bundle was not granted in time (naming the cluster's resources),
                or the current placement group has no bundle for this rank.
        """
        ray = self._ray
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        rank, cpus = config.parallel.data_parallel_rank, self.cpus_per_engine()
        group, own, bundle = get_current_placement_group(), None, rank
        if group is None:
            group = own = placement_group([{"CPU": cpus}], strategy="PACK")
            bundle = 0
        elif len(group.bundle_specs) <= rank:
            raise ConfigError(
                f"the current placement group has {len(group.bundle_specs)} bundles: none for rank {rank}"
            )
        timeout = self._parallel.ray_placement_timeout_s
        try:
            ray.get(group.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError as e:
            if own is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(own)
            raise ConfigError(
                f"Ray could not reserve {{'CPU': {cpus}}} for data-parallel rank {rank} within {timeout} s "
                f"(cluster resources: {ray.cluster_resources()}, available: {ray.available_resources()}); add nodes"
                " or lower data_parallel_size / ray_cpus_per_worker"
            ) from e
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)
        actor_class = ray.remote(num_cpus=cpus, max_concurrency=2, max_restarts=0)(RayEngineCoreActor)
        actor = actor_class.options(scheduling_strategy=strategy, name=None).remote()
        launch = EngineLaunch(
            config=msgspec.Raw(msgspec.msgpack.encode(config)),
            input_address=input_address,
            output_address=output_address,
            ipc_dir="",
            core_factory=core_factory,
        )
        return RayEngineLauncher(ray, actor, msgspec.msgpack.encode(launch), own)

    def shutdown(self) -> None:
        """Shut Ray down if this client started it (after every engine was stopped)."""
        if self._started_ray:
            self._started_ray = False
            self._ray.shutdown()
