"""`RayExecutor` (`distributed_executor_backend="ray"`): one Ray actor per tensor-parallel rank.

Needs `pip install asyncllm[ray]` (`ray>=2.40`). Connects to `ParallelConfig.ray_address` ("auto", or
"ray://host:10001", or a GCS address), else to the cluster in `RAY_ADDRESS`, else to the Ray already initialized
in this process, else starts a local cluster (shut down again with the executor). The actors are placed in the
current placement group when the engine already runs inside one, else in a new one of `tensor_parallel_size`
bundles of `ray_cpus_per_worker` CPUs (strategy PACK), waited for `ray_placement_timeout_s` seconds.

Calls are msgspec msgpack bytes (`rpc.RpcRequest`), so Ray carries only opaque byte strings. A killed actor
surfaces as `ExecutorError` in the call in flight and, through a watcher thread holding one
`wait_until_stopped` call per actor, as a failure callback (the engine core -> `EngineDeadError`) when idle.
At TP>1 the ranks form a gloo group over TCP at rank 0's node IP. Design follows vLLM's `ray_distributed_executor`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

import msgspec

from asyncllm.distributed.tp_sizes import check_tp_divides
from asyncllm.errors import ConfigError, ExecutorError
from asyncllm.executors.base import Executor
from asyncllm.messages.rpc import REPLY_ALL, RpcResponse, encode_request

logger = logging.getLogger(__name__)
DEFAULT_RPC_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 600.0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ConfigError("distributed_executor_backend='ray' needs Ray: pip install 'asyncllm[ray]'") from e
    return ray


class RayExecutor(Executor):
    """`tensor_parallel_size` Ray actors, each holding one `Worker`.

    Raises (construction):
        ConfigError: Ray is not installed, or the TP size does not divide the model's heads.
        ExecutorError: the placement group's resources did not become available in time (naming them), or an
            actor failed to start or load the model.
    """

    def _init_executor(self) -> None:
        from asyncllm.model.loading.arch_config import read_arch_config

        ray = self._ray = _import_ray()
        parallel = self.config.parallel
        self.world_size = parallel.tensor_parallel_size
        arch = read_arch_config(self.config.model.model_path)
        check_tp_divides(arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size, self.world_size)
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._started_ray = False
        self._placement_group: Any = None
        self._own_placement_group = False
        self.actors: list[Any] = []
        if not ray.is_initialized():
            ray.init(address=parallel.ray_address, log_to_driver=False)
            self._started_ray = True
        try:
            self._place_actors()
            self.worker_pids = self._init_workers()
        except BaseException:
            self.shutdown()
            raise
        self._watch_refs = [actor.wait_until_stopped.remote() for actor in self.actors]
        self._watcher = threading.Thread(target=self._watch_actors, name="asyncllm-ray-watch", daemon=True)
        self._watcher.start()

    def _place_actors(self) -> None:
        ray = self._ray
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from asyncllm.executors.ray_worker import RayWorkerWrapper

        group = get_current_placement_group()
        if group is None:
            bundles = [{"CPU": self.config.parallel.ray_cpus_per_worker} for _ in range(self.world_size)]
            group = placement_group(bundles, strategy="PACK", name="")
            self._own_placement_group = True
        self._placement_group = group
        timeout = self.config.parallel.ray_placement_timeout_s
        try:
            ray.get(group.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise ExecutorError(
                f"Ray could not reserve {self.world_size} bundle(s) of "
                f"{{'CPU': {self.config.parallel.ray_cpus_per_worker}}} within {timeout} s "
                f"(cluster resources: {ray.cluster_resources()}); add nodes or lower tensor_parallel_size"
            ) from e
        if len(group.bundle_specs) < self.world_size:
            raise ExecutorError(
                f"the current placement group has {len(group.bundle_specs)} bundles; {self.world_size} are needed"
            )
        cpus = self.config.parallel.ray_cpus_per_worker
        actor_class = ray.remote(num_cpus=cpus, max_concurrency=2, max_restarts=0)(RayWorkerWrapper)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank)
            self.actors.append(actor_class.options(scheduling_strategy=strategy).remote(rank))

    def _init_workers(self) -> list[int]:
        ray = self._ray
        try:
            host, port = ray.get(self.actors[0].get_node_address.remote(), timeout=STARTUP_TIMEOUT_S)
            config_bytes = msgspec.msgpack.encode(self.config)
            refs = [a.init_worker.remote(config_bytes, f"tcp://{host}:{port}") for a in self.actors]
            return [int(pid) for pid in ray.get(refs, timeout=STARTUP_TIMEOUT_S)]
        except (ray.exceptions.RayError, TimeoutError) as e:
            raise ExecutorError(f"a Ray worker failed to start: {e}") from e

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> list[Any]:
        """Call `Worker.<method>(*args, **kwargs)` in every actor.

        Args:
            timeout: seconds to wait (default `DEFAULT_RPC_TIMEOUT_S`).
            unique_reply_rank: return only this rank's result.
        Returns:
            Results by rank, or `[result of unique_reply_rank]`.
        Raises:
            ExecutorError: a worker raised, an actor died, the call timed out, or the executor was shut down.
        """
        ray = self._ray
        reply_rank = REPLY_ALL if unique_reply_rank is None else unique_reply_rank
        with self._lock:
            if self._stopping.is_set():
                raise ExecutorError(f"collective_rpc({method!r}) after shutdown")
            self.check_health()
            frame = encode_request(next(self._call_ids), method, tuple(args), kwargs or {}, reply_rank)
            refs = [actor.execute.remote(frame) for actor in self.actors]
            try:
                frames = ray.get(refs, timeout=DEFAULT_RPC_TIMEOUT_S if timeout is None else timeout)
            except ray.exceptions.GetTimeoutError as e:
                raise ExecutorError(f"Ray workers did not answer {method} in time") from e
            except ray.exceptions.RayError as e:
                raise ExecutorError(f"a Ray worker died during {method}: {type(e).__name__}") from e
        responses = (msgspec.msgpack.decode(data, type=RpcResponse) for data in frames if data is not None)
        return self.gather_results(method, responses)

    def _watch_actors(self) -> None:
        ray = self._ray
        ready, _ = ray.wait(self._watch_refs, num_returns=1, timeout=None)
        if self._stopping.is_set():
            return
        try:
            ray.get(ready[0])
            reason = "a Ray worker actor stopped"
        except ray.exceptions.RayError as e:
            reason = f"a Ray worker actor died: {type(e).__name__}"
        self._report_failure(reason)

    def shutdown(self) -> None:
        """Stop the workers, kill the actors, remove our placement group, and shut Ray down if we started it.
        Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        ray = self._ray
        if self._failed is None and self.actors:
            try:
                ray.get([a.stop.remote() for a in self.actors], timeout=5.0)
            except Exception as e:  # dead or stuck actors are killed below
                logger.warning("Ray workers did not stop cleanly: %s", e)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:
                logger.warning("could not kill a Ray actor: %s", e)
        if self._own_placement_group and self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._placement_group)
            except Exception as e:
                logger.warning("could not remove the placement group: %s", e)
        if self._started_ray:
            ray.shutdown()
