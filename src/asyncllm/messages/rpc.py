"""Executor <-> worker-process messages (msgspec msgpack; nothing is pickled).

A call is one `RpcRequest` frame sent to every worker; arguments and results travel as nested msgpack
(`msgspec.Raw`) and are decoded with the method's declared types (`ARG_TYPES`, `RESULT_TYPES`), so a
`SchedulerOutput` arrives as a `SchedulerOutput`. Methods not listed take and return plain msgpack values.
"""

from __future__ import annotations

from typing import Any

import msgspec

from asyncllm.messages.scheduler import ModelRunnerOutput, SchedulerOutput

REPLY_ALL = -1
READY_CALL_ID = -1  # the worker's start-up report uses this call id

ARG_TYPES: dict[str, Any] = {"execute_model": tuple[SchedulerOutput]}
RESULT_TYPES: dict[str, Any] = {
    "execute_model": ModelRunnerOutput,
    "get_model_info": tuple[int, int],
    "get_hidden_size": int,
    "get_kv_cache_bytes": int,
}


class RpcRequest(msgspec.Struct, array_like=True, gc=False):
    """Call `Worker.<method>(*args, **kwargs)`.

    Fields:
        call_id: increasing id; the reply carries it.
        method: a public `Worker` method name (or "shutdown", which also ends the worker process).
        args, kwargs: msgpack of the positional list and keyword map.
        reply_rank: the one rank that replies (others reply only on error), or REPLY_ALL.
    """

    call_id: int
    method: str
    args: msgspec.Raw
    kwargs: msgspec.Raw
    reply_rank: int = REPLY_ALL


class RpcResponse(msgspec.Struct, array_like=True, gc=False):
    """A worker's reply: `result` (msgpack) or `error` (exception type and message)."""

    call_id: int
    rank: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    error: str | None = None


def encode_request(call_id: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], reply_rank: int) -> bytes:
    """One request frame. Raises TypeError for arguments msgpack cannot carry."""
    raw_args = msgspec.Raw(msgspec.msgpack.encode(list(args)))
    raw_kwargs = msgspec.Raw(msgspec.msgpack.encode(kwargs))
    return msgspec.msgpack.encode(RpcRequest(call_id, method, raw_args, raw_kwargs, reply_rank))


def decode_args(request: RpcRequest) -> tuple[list[Any], dict[str, Any]]:
    """The request's arguments, typed by `ARG_TYPES[method]` when listed."""
    args = msgspec.msgpack.decode(request.args, type=ARG_TYPES.get(request.method, list[Any]))
    return list(args), msgspec.msgpack.decode(request.kwargs, type=dict[str, Any])


def decode_result(method: str, raw: msgspec.Raw) -> Any:
    """A reply's result, typed by `RESULT_TYPES[method]` when listed."""
    return msgspec.msgpack.decode(raw, type=RESULT_TYPES.get(method, Any))


class WorkerLaunch(msgspec.Struct, array_like=True, gc=False):
    """What an `mp` worker process reads on stdin (`python -m asyncllm.executors.mp_worker`).

    Fields:
        config: the `EngineConfig` as msgpack.
        rank: this worker's tensor-parallel rank.
        request_address, response_address: the executor's PUSH (requests) and PULL (replies) addresses.
        distributed_init_method: the gloo rendezvous ("file://..." in the executor's socket directory).
        ipc_dir: the executor's private socket directory.
        parent_pid, parent_is_main_thread: to exit with the engine process (see `utils.process.die_with_parent`).
    """

    config: msgspec.Raw
    rank: int
    request_address: str
    response_address: str
    distributed_init_method: str
    ipc_dir: str
    parent_pid: int
    parent_is_main_thread: bool
