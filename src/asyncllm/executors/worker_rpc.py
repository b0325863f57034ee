"""The one worker-side RPC dispatcher: `mp` worker processes and Ray actors both serve calls with `run_rpc`.

Follows vLLM's `WorkerWrapperBase.execute_method` / `run_method`: one function decodes the typed arguments,
calls the worker's public method, and encodes the reply (or the error text); nothing is pickled.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from asyncllm.messages.rpc import REPLY_ALL, RpcRequest, RpcResponse, decode_args

logger = logging.getLogger(__name__)


def run_rpc(worker: Any, rank: int, request: RpcRequest) -> RpcResponse | None:
    """Call `worker.<request.method>(*args, **kwargs)` and build this rank's reply.

    Args:
        worker: the `Worker` of this rank.
        rank: this worker's tensor-parallel rank.
        request: the decoded call.
    Returns:
        The reply, or None when this rank need not reply (`request.reply_rank` names another rank and the call
        succeeded). A failed call always replies, with `error` = "ExceptionType: message".
    """
    response = RpcResponse(request.call_id, rank)
    must_reply = request.reply_rank in (REPLY_ALL, rank)
    try:
        if request.method.startswith("_"):
            raise AttributeError(f"{request.method!r} is not a public worker method")
        args, kwargs = decode_args(request)
        result = getattr(worker, request.method)(*args, **kwargs)
        if must_reply:
            response.result = msgspec.Raw(msgspec.msgpack.encode(result))
    except Exception as e:
        logger.exception("worker %d failed in %s", rank, request.method)
        response.error = f"{type(e).__name__}: {e}"
    if response.error is None and not must_reply:
        return None
    return response
