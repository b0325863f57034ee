"""Entry point of one `mp` worker process: build a `Worker`, then serve RPCs until "shutdown".

Started as `python -m asyncllm.executors.mp_worker` with a msgpack `WorkerLaunch` on stdin.

Sockets (ZeroMQ, `ipc://` in the executor's private 0700 directory): a PULL for this rank's requests and a PUSH
for replies to the executor. The first message is the start-up report (`call_id = READY_CALL_ID`, with an error
text if the worker could not start). The process exits with its parent (the engine core) via `die_with_parent`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
import zmq

from asyncllm.engine_config import EngineConfig
from asyncllm.executors.worker_rpc import run_rpc
from asyncllm.messages.rpc import READY_CALL_ID, RpcRequest, RpcResponse, WorkerLaunch
from asyncllm.utils.process import die_with_parent, read_launch_message

logger = logging.getLogger(__name__)


def main() -> None:
    """Entry point of `python -m asyncllm.executors.mp_worker`: read the `WorkerLaunch` from stdin and serve."""
    run_worker(msgspec.msgpack.decode(read_launch_message(), type=WorkerLaunch))


def run_worker(launch: WorkerLaunch) -> None:
    """Build this rank's `Worker` and serve RPCs. Exits 0 after "shutdown", 1 if the worker could not start."""
    rank = launch.rank
    die_with_parent(launch.parent_pid, launch.parent_is_main_thread, launch.ipc_dir)
    ctx = zmq.Context(io_threads=1)
    requests = ctx.socket(zmq.PULL)
    requests.connect(launch.request_address)
    replies = ctx.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, 2000)
    replies.connect(launch.response_address)
    try:
        worker = _start_worker(launch.config, rank, launch.distributed_init_method)
    except Exception as e:
        logger.exception("worker %d failed to start", rank)
        replies.send(msgspec.msgpack.encode(RpcResponse(READY_CALL_ID, rank, error=f"{type(e).__name__}: {e}")))
        replies.close()
        ctx.term()
        raise SystemExit(1) from e
    replies.send(
        msgspec.msgpack.encode(RpcResponse(READY_CALL_ID, rank, msgspec.Raw(msgspec.msgpack.encode(os.getpid()))))
    )
    _serve(worker, rank, requests, replies)
    requests.close()
    replies.close()
    ctx.term()


def _start_worker(config_bytes: bytes | msgspec.Raw, rank: int, distributed_init_method: str) -> Any:
    from asyncllm.worker.worker import Worker  # torch is imported here, in the worker process only

    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    return Worker(config, rank=rank, distributed_init_method=distributed_init_method)


def _serve(worker: Any, rank: int, requests: zmq.Socket[Any], replies: zmq.Socket[Any]) -> None:
    decoder = msgspec.msgpack.Decoder(RpcRequest)
    while True:
        request = decoder.decode(requests.recv())
        response = run_rpc(worker, rank, request)
        if response is not None:
            replies.send(msgspec.msgpack.encode(response))
        if request.method == "shutdown":
            return


if __name__ == "__main__":
    main()
