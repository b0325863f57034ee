"""Loaded weights moved onto huge pages (`utils/huge_pages.py`), where the host grants them.

A decode step streams every weight once (int8 SmolLM2: ~135 MB) from tensors allocated one by one on 4 KiB pages,
so the products miss the TLB every 4 KiB. After loading, the worker copies the weights' tensors into one mapping on
2 MiB pages and points each tensor at its copy (`Tensor.set_`: every holder of the tensor, the decode stacks
included, then reads the copy; the values are the same bits). Measured on this model's decode-step products (AMD
EPYC, 2 threads, int8 VNNI, distinct weights per layer): 167 -> 191 GMAC/s at 8 rows, 294 -> 314 at 32, 376 -> 382 at
128 (`benchmarks/analysis.md`). torch's own `THP_MEM_ALLOC_ENABLE=1` does not reach them: it only advises single
allocations of 2 MiB or more, and all but the LM head of this model's int8 weights are smaller.

What moves: the model's parameters and buffers, and the tensors of its linear weights (`Int8Weight`: the plain
weight, its scales and our kernels' packed copies; `BlockQuantWeight`: `qs`, `d`, `m`; `PackedFp32Weight`: the
plain weight only), each tensor once, when it is strided, contiguous and alone in its storage (a view of another
tensor stays). What stays: MKL's packed float32 data (it must not move after packing) and oneDNN's prepacked
operands.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from asyncllm.model.kernels.block_quant import BlockQuantWeight
from asyncllm.model.kernels.fp32 import PackedFp32Weight
from asyncllm.model.kernels.int8 import Int8Weight
from asyncllm.utils.huge_pages import HUGE_PAGE_BYTES, huge_page_bytes, transparent_huge_pages_granted

logger = logging.getLogger(__name__)

MIN_TENSOR_BYTES = 4096  # smaller tensors (norm weights of a small model) stay where they are
ALIGN_BYTES = 64  # each tensor's start in the mapping: a cache line, as torch's allocator aligns
MOVABLE_INT8_OPERANDS = ("vnni", "avx2")  # our kernels' packed copies (oneDNN's "onednn" operand is opaque)


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Move `model`'s weight tensors into one mapping on huge pages (see the module docstring), if the host grants
    huge pages to advised memory; logs how much moved at INFO.

    Returns:
        Bytes moved (0 where the host grants no huge pages, or nothing was movable).
    Raises:
        OSError: the operating system refuses the mapping (`mmap`).
    """
    if not transparent_huge_pages_granted():
        return 0
    tensors = movable_tensors(model)
    if not tensors:
        return 0
    slots = [_round_up(t.nbytes, ALIGN_BYTES) for t in tensors]
    arena = huge_page_bytes(sum(slots), align=HUGE_PAGE_BYTES)
    offset = 0
    with torch.inference_mode():
        for tensor, slot in zip(tensors, slots, strict=True):
            _move(tensor, arena, offset)
            offset += slot
    logger.info("weights: %.1f MB in %d tensors moved onto huge pages", offset / 1e6, len(tensors))
    return offset


def movable_tensors(model: nn.Module) -> list[torch.Tensor]:
    """`model`'s weight tensors that `move_weights_to_huge_pages` moves, each once, in module order."""
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    for tensor in _weight_tensors(model):
        if id(tensor) not in seen and _movable(tensor):
            seen.add(id(tensor))
            found.append(tensor)
    return found


def _weight_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    for module in model.modules():
        yield from (t for t in module._parameters.values() if t is not None)
        yield from (t for t in module._buffers.values() if t is not None)
        for value in vars(module).values():
            yield from _tensors_of(value)


def _tensors_of(value: object) -> Iterable[torch.Tensor]:
    """The movable parts of one attribute of a module: a tensor, or a linear weight's tensors."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Int8Weight):
        operands = [value.operands[name] for name in MOVABLE_INT8_OPERANDS if name in value.operands]
        return [value.qweight, value.scale, *(t for op in operands for t in op if isinstance(t, torch.Tensor))]
    if isinstance(value, BlockQuantWeight):
        return [t for t in (value.qs, value.d, value.m) if t is not None]
    if isinstance(value, PackedFp32Weight):
        return [value.weight]
    return []


def _movable(tensor: torch.Tensor) -> bool:
    """Strided, contiguous, alone in its storage, not a leaf that needs gradients, and large enough to matter."""
    return (
        tensor.layout == torch.strided
        and tensor.device.type == "cpu"
        and not tensor.requires_grad
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes
        and tensor.nbytes >= MIN_TENSOR_BYTES
    )


def _move(tensor: torch.Tensor, arena: torch.Tensor, offset: int) -> None:
    """Copy `tensor` to `arena[offset:]` and point it there (every holder of the tensor object follows)."""
    place = arena[offset : offset + tensor.nbytes]
    place.copy_(tensor.reshape(-1).view(torch.uint8))
    tensor.set_(place.untyped_storage(), place.storage_offset() // tensor.element_size(), tensor.shape, tensor.stride())


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
