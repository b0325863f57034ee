"""`MultiprocExecutor` (`distributed_executor_backend="mp"`): one worker process per tensor-parallel rank.

Workers are `python -m asyncllm.executors.mp_worker` subprocesses that read a msgpack `WorkerLaunch` on stdin.
Each call is one msgspec `RpcRequest` frame pushed to every worker over ZeroMQ (`ipc://` sockets in a private
0700 directory); replies come back on one PULL socket. At TP>1 the ranks form a gloo group (rendezvous file in
the same directory) and all-reduce inside the forward pass; only rank 0 replies to `execute_model`.

Failure: a watcher thread waits on the workers' process sentinels; when one exits unexpectedly the executor
is marked failed, every registered failure callback runs (the engine core turns that into `EngineDeadError` in
every stream), and calls in flight or later raise `ExecutorError` within `POLL_INTERVAL_S`. Every call has a
timeout (default `DEFAULT_RPC_TIMEOUT_S`; start-up `STARTUP_TIMEOUT_S`). Design follows vLLM v1's
`vllm/v1/executor/multiproc_executor.py`, with msgpack instead of pickle.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import wait
from typing import Any

import msgspec
import zmq

from asyncllm.distributed.tp_sizes import check_tp_divides
from asyncllm.errors import ExecutorError
from asyncllm.executors.base import Executor
from asyncllm.messages.rpc import READY_CALL_ID, REPLY_ALL, RpcResponse, WorkerLaunch, encode_request
from asyncllm.utils.process import (
    ChildProcess,
    launched_from_main_thread,
    make_ipc_dir,
    remove_ipc_dir,
    start_module_process,
)

logger = logging.getLogger(__name__)
POLL_INTERVAL_S = 0.1
DEFAULT_RPC_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 3.0
WORKER_MODULE = "asyncllm.executors.mp_worker"


class MultiprocExecutor(Executor):
    """`tensor_parallel_size` worker processes on this machine.

    Raises (construction):
        ConfigError: the TP size does not divide the model's heads / MLP columns.
        ExecutorError: a worker failed to start or load the model (its error text), or start-up timed out.
    """

    def _init_executor(self) -> None:
        from asyncllm.model.loading.arch_config import read_arch_config

        self.world_size = self.config.parallel.tensor_parallel_size
        arch = read_arch_config(self.config.model.model_path)
        check_tp_divides(arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size, self.world_size)
        self._call_ids = itertools.count()
        self._lock = threading.Lock()  # one call at a time (the engine core is single-threaded; tools may not be)
        self._shutting_down = threading.Event()
        self._ipc_dir = make_ipc_dir()
        self._ctx = zmq.Context(io_threads=1)
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(f"ipc://{self._ipc_dir}/replies")
        self._requests: list[zmq.Socket[Any]] = []
        self.processes: list[ChildProcess] = []
        try:
            self._start_workers()
            self.worker_pids = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._watcher = threading.Thread(target=self._watch_workers, name="asyncllm-worker-watch", daemon=True)
        self._watcher.start()

    def _start_workers(self) -> None:
        config = msgspec.Raw(msgspec.msgpack.encode(self.config))
        for rank in range(self.world_size):
            address = f"ipc://{self._ipc_dir}/requests_{rank}"
            socket = self._ctx.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind(address)
            self._requests.append(socket)
            launch = WorkerLaunch(
                config=config,
                rank=rank,
                request_address=address,
                response_address=f"ipc://{self._ipc_dir}/replies",
                distributed_init_method=f"file://{self._ipc_dir}/tp_store",
                ipc_dir=self._ipc_dir,
                parent_pid=os.getpid(),
                parent_is_main_thread=launched_from_main_thread(),
            )
            encoded = msgspec.msgpack.encode(launch)
            self.processes.append(start_module_process(WORKER_MODULE, encoded, f"asyncllm-worker-{rank}"))

    def _wait_ready(self) -> list[int]:
        """Wait for every rank's start-up report; returns the worker pids by rank."""
        pids: dict[int, int] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(pids) < self.world_size:
            response = self._receive(deadline, "start-up")
            if response.error is not None:
                raise ExecutorError(f"worker {response.rank} failed to start: {response.error}")
            if response.call_id == READY_CALL_ID:
                pids[response.rank] = int(msgspec.msgpack.decode(response.result))
        return [pids[rank] for rank in range(self.world_size)]

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> list[Any]:
        """Send `Worker.<method>(*args, **kwargs)` to every worker process and gather the replies.

        Args:
            timeout: seconds to wait for the replies (default `DEFAULT_RPC_TIMEOUT_S`).
            unique_reply_rank: only this rank replies (the others only on error).
        Returns:
            Results by rank, or `[result of unique_reply_rank]`.
        Raises:
            ExecutorError: a worker raised (its error text), died, or did not answer within `timeout`; or the
                executor was shut down.
        """
        deadline = time.monotonic() + (DEFAULT_RPC_TIMEOUT_S if timeout is None else timeout)
        reply_rank = REPLY_ALL if unique_reply_rank is None else unique_reply_rank
        with self._lock:
            self._check_usable(method)
            call_id = next(self._call_ids)
            frame = encode_request(call_id, method, tuple(args), kwargs or {}, reply_rank)
            for socket in self._requests:
                socket.send(frame, copy=False)
            expected = self.world_size if reply_rank == REPLY_ALL else 1
            return self.gather_results(method, self._responses_to(call_id, expected, deadline, method))

    def _responses_to(self, call_id: int, expected: int, deadline: float, method: str) -> Iterator[RpcResponse]:
        """Yield the `expected` replies to `call_id` (late replies to earlier, timed-out calls are dropped)."""
        received = 0
        while received < expected:
            response = self._receive(deadline, method)
            if response.call_id == call_id:
                received += 1
                yield response

    def _check_usable(self, method: str) -> None:
        if self._shutting_down.is_set():
            raise ExecutorError(f"collective_rpc({method!r}) after shutdown")
        self.check_health()

    def _receive(self, deadline: float, what: str) -> RpcResponse:
        """The next reply; checks for dead workers every POLL_INTERVAL_S seconds."""
        while not self._replies.poll(int(POLL_INTERVAL_S * 1000)):
            self.check_health()
            dead = [p for p in self.processes if p.exitcode is not None]
            if dead:
                raise ExecutorError(f"worker process {dead[0].pid} exited (code {dead[0].exitcode}) during {what}")
            if time.monotonic() > deadline:
                raise ExecutorError(f"workers did not answer {what} in time")
        return msgspec.msgpack.decode(self._replies.recv(), type=RpcResponse)

    def _watch_workers(self) -> None:
        sentinels = {p.sentinel: p for p in self.processes}
        ready = wait([*sentinels, self._wake_r])
        if self._shutting_down.is_set():
            return
        dead = [sentinels[s] for s in ready if s in sentinels]
        if not dead:
            return
        process = dead[0]
        self._report_failure(f"worker process {process.pid} ({process.name}) died with exit code {process.exitcode}")

    def shutdown(self) -> None:
        """Ask every worker to exit, wait up to SHUTDOWN_TIMEOUT_S seconds, then terminate/kill; close sockets and
        remove the socket directory. Idempotent; returns within about SHUTDOWN_TIMEOUT_S + 4 seconds."""
        if self._shutting_down.is_set():
            return
        self._shutting_down.set()
        if hasattr(self, "_wake_w"):
            with contextlib.suppress(OSError):
                self._wake_w.send_bytes(b"")
        frame = encode_request(-2, "shutdown", (), {}, REPLY_ALL)
        for socket, process in zip(self._requests, self.processes, strict=False):
            if process.exitcode is None:
                with contextlib.suppress(zmq.ZMQError):
                    socket.send(frame, flags=zmq.NOBLOCK)
        _stop_all(self.processes, SHUTDOWN_TIMEOUT_S)
        for process in self.processes:
            process.close()
        for socket in [*self._requests, self._replies]:
            socket.close(linger=0)
        self._ctx.term()
        remove_ipc_dir(self._ipc_dir)


def _stop_all(processes: list[ChildProcess], timeout_s: float) -> None:
    """Wait up to `timeout_s` seconds for all to exit, then SIGTERM the rest, then SIGKILL (2 s each step, all
    processes at once: a rank stuck in a collective does not delay the others)."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for signal_name in ("terminate", "kill"):
        alive = [p for p in processes if p.exitcode is None]
        if not alive:
            return
        logger.warning("%d worker process(es) still running: %s", len(alive), signal_name)
        for process in alive:
            getattr(process, signal_name)()
        deadline = time.monotonic() + 2.0
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
