"""Entry point of one `mp` worker process: build a `Worker`, then serve RPCs until "shutdown".

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

from asyncllm.config import EngineConfig
from asyncllm.messages.rpc import READY_CALL_ID, REPLY_ALL, RpcRequest, RpcResponse, decode_args
from asyncllm.utils.process import die_with_parent

logger = logging.getLogger(__name__)


def run_worker(
    config_bytes: bytes,
    *,
    rank: int,
    request_address: str,
    response_address: str,
    distributed_init_method: str,
    ipc_dir: str,
    parent_pid: int,
    parent_is_main_thread: bool,
) -> None:
    """Process target (spawn). Exits 0 after "shutdown", 1 if the worker could not start."""
    die_with_parent(parent_pid, parent_is_main_thread, ipc_dir)
    ctx = zmq.Context(io_threads=1)
    requests = ctx.socket(zmq.PULL)
    requests.connect(request_address)
    replies = ctx.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, 2000)
    replies.connect(response_address)
    try:
        worker = _start_worker(config_bytes, rank, distributed_init_method)
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


def _start_worker(config_bytes: bytes, rank: int, distributed_init_method: str) -> Any:
    from asyncllm.worker.worker import Worker  # torch is imported here, in the worker process only

    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    return Worker(config, rank=rank, distributed_init_method=distributed_init_method)


def _serve(worker: Any, rank: int, requests: zmq.Socket[Any], replies: zmq.Socket[Any]) -> None:
    decoder = msgspec.msgpack.Decoder(RpcRequest)
    while True:
        request = decoder.decode(requests.recv())
        response = RpcResponse(request.call_id, rank)
        try:
            args, kwargs = decode_args(request)
            result = getattr(worker, request.method)(*args, **kwargs)
            if request.reply_rank in (REPLY_ALL, rank):
                response.result = msgspec.Raw(msgspec.msgpack.encode(result))
        except Exception as e:
            logger.exception("worker %d failed in %s", rank, request.method)
            response.error = f"{type(e).__name__}: {e}"
        if response.error is not None or request.reply_rank in (REPLY_ALL, rank):
            replies.send(msgspec.msgpack.encode(response))
        if request.method == "shutdown":
            return
