"""The Ray actor that hosts one `Worker` (one tensor-parallel rank). Imported only when Ray is used.

Calls arrive as msgspec msgpack bytes (`rpc.RpcRequest`) and results leave as `rpc.RpcResponse` bytes: Ray only
ever carries opaque byte strings for us. The actor runs with `max_concurrency=2` so that `wait_until_stopped` can
block in one thread (the executor's death watcher holds that call open) while RPCs run in the other.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import msgspec

from asyncllm.engine_config import EngineConfig
from asyncllm.executors.worker_rpc import run_rpc
from asyncllm.messages.rpc import RpcRequest


class RayWorkerWrapper:
    """Plain class; `ray.remote(...)` makes it an actor in `executors/ray.py`."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.worker: Any = None
        self._stopped = threading.Event()

    def get_node_address(self) -> tuple[str, int]:
        """(this node's IP, a free TCP port on it): the TP rendezvous when this is rank 0."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def init_worker(self, config_bytes: bytes, distributed_init_method: str) -> int:
        """Build the `Worker` (joins the TP group, loads this rank's shard). Returns this process's pid."""
        from asyncllm.worker.worker import Worker

        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        self.worker = Worker(config, rank=self.rank, distributed_init_method=distributed_init_method)
        return os.getpid()

    def execute(self, frame: bytes) -> bytes | None:
        """Run one `RpcRequest` (`worker_rpc.run_rpc`); returns `RpcResponse` bytes, or None when this rank need
        not reply."""
        response = run_rpc(self.worker, self.rank, msgspec.msgpack.decode(frame, type=RpcRequest))
        return None if response is None else msgspec.msgpack.encode(response)

    def wait_until_stopped(self) -> None:
        """Block until `stop()`; the executor watches this call to learn that the actor died."""
        self._stopped.wait()

    def stop(self) -> None:
        """Shut the worker down and release `wait_until_stopped`."""
        if self.worker is not None:
            self.worker.shutdown()
        self._stopped.set()
