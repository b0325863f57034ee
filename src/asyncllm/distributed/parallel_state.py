"""Tensor-parallel state of this process: rank, world size, and the all-reduce between ranks.

At TP=1 (the default, and every `uni` worker) nothing here touches `torch.distributed`: `all_reduce` returns
its input. At TP>1 each worker process calls `init_tensor_parallel` once, which joins a gloo process group
(CPU collectives) through a rendezvous URL (`file://` in the executor's private directory, or `tcp://`).
Design follows vLLM's `vllm/distributed/parallel_state.py` (one global TP group per process).
"""

from __future__ import annotations

import datetime

import torch

_TP_RANK = 0
_TP_SIZE = 1
COLLECTIVE_TIMEOUT_S = 120.0


def init_tensor_parallel(rank: int, world_size: int, init_method: str) -> None:
    """Join the gloo group of `world_size` ranks as `rank` (no-op at world_size 1).

    Args:
        rank: this process's rank, 0 <= rank < world_size.
        world_size: number of tensor-parallel ranks.
        init_method: rendezvous URL, e.g. "file:///tmp/asyncllm-x/tp_store" or "tcp://10.0.0.1:29500".
    Raises:
        RuntimeError: from torch.distributed when the group cannot form within 120 seconds.
    """
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, world_size
    if world_size == 1:
        return
    import torch.distributed as dist

    dist.init_process_group(
        backend="gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def destroy_tensor_parallel() -> None:
    """Leave the process group (if any) and reset to TP=1."""
    global _TP_RANK, _TP_SIZE
    if _TP_SIZE > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _TP_RANK, _TP_SIZE = 0, 1


def get_tp_rank() -> int:
    """This process's tensor-parallel rank (0 at TP=1)."""
    return _TP_RANK


def get_tp_size() -> int:
    """The tensor-parallel world size (1 unless `init_tensor_parallel` joined a group)."""
    return _TP_SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over every rank, in place (any shape, float32); returns `x` unchanged at TP=1."""
    if _TP_SIZE == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x
