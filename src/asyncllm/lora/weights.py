"""An adapter's tensors in the model's fused layout, and the per-step `LoRABatch` the decoder layers add.

The model fuses q/k/v into one `[in, out]` weight (`qkv_proj`) and gate/up into another (`gate_up_proj`). An
adapter's pairs for the modules of one fused weight become one `FusedLoRA`: `a` is the modules' A^T side by side
(`[in, sum of ranks]`, so x @ a is one matmul) and `b` is block-diagonal (`[sum of ranks, fused out]`: module m's
scale * B_m^T at its rows and at its output columns), so `(x @ a) @ b` is every module's delta in its slice.

Tensor parallelism (as the base weights, `model/llama.py`): q/k/v/gate/up are column-parallel, so B's output rows
are this rank's shard and A is whole; o/down are row-parallel, so A's input columns are sharded and B is whole: each
rank's delta is then a partial sum that the layer's all-reduce adds up with the base output's.

Applying per row (no weight merging): the rows of each adapter in the step get `(x[rows] @ a) @ b` added to the
base output. Rows are grouped by adapter (one pair of matmuls per adapter present) rather than gathering A and B
per token (`[num_tokens, r, in]`), which on a CPU would copy the adapter once per token; the result is the same.
Sources: LoRA (Hu et al., 2021); multi-adapter batching as in Punica (Chen et al., 2023) and vLLM's LoRA layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from asyncllm.lora.peft import WEIGHTS_NAME, AdapterSpec, read_adapter
from asyncllm.lora.request import LoRARequest
from asyncllm.model.arch import ModelArchConfig
from asyncllm.model.layouts import layout_of

Rows = slice | torch.Tensor  # the flat token rows of one adapter: a range, or [num_rows] int64 indices


class LoRALayerLike(Protocol):
    """What loading needs of a decoder layer (`model.llama.LlamaDecoderLayer` is one)."""

    def fused_slots(self) -> dict[str, tuple[str, int, int]]:
        """Part (`model.layouts.FUSED_PARTS`) -> (fused weight name, first output column, width) of this rank."""
        ...

    def shard_lora(
        self, module: str, lora_a: torch.Tensor, lora_b: torch.Tensor
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """This rank's (part, A, B) of a module's `[r, in]` / `[out, r]` pair, split by the module's parts."""
        ...


@dataclass(frozen=True)
class FusedLoRA:
    """One adapter's delta for one fused weight of one layer (this rank's shard).

    Fields:
        a: [in_features, sum of the modules' ranks] float32 (A^T of each module, side by side).
        b: [sum of ranks, fused out_features] float32, block-diagonal, scale included.
    """

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class AdapterWeights:
    """A loaded adapter: per layer, fused weight name ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") ->
    `FusedLoRA`, for the fused weights it adapts."""

    lora_int_id: int
    layers: list[dict[str, FusedLoRA]]


def arch_module_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """The model's (in, out) of each adaptable module, unsharded (its architecture's layout, `model/layouts.py`)."""
    return layout_of(arch.architecture).module_shapes(arch)


def load_adapter(
    request: LoRARequest, arch: ModelArchConfig, layers: Sequence[LoRALayerLike], max_lora_rank: int
) -> AdapterWeights:
    """Check an adapter directory against the model again (`peft.read_adapter`), read its tensors (safetensors,
    any float dtype -> float32) and lay them out for this rank.

    Raises:
        InvalidRequestError: the directory is missing, malformed or refused (see `asyncllm.lora.peft`).
    """
    from safetensors.torch import load_file

    spec = read_adapter(request.lora_path, max_lora_rank, arch_module_shapes(arch), len(layers))
    tensors = load_file(f"{request.lora_path}/{WEIGHTS_NAME}")
    return AdapterWeights(
        request.lora_int_id, [_fuse_layer(spec, tensors, index, layer) for index, layer in enumerate(layers)]
    )


def _fuse_layer(
    spec: AdapterSpec, tensors: dict[str, torch.Tensor], index: int, layer: LoRALayerLike
) -> dict[str, FusedLoRA]:
    """The `FusedLoRA` of each fused weight of layer `index` that the adapter touches."""
    by_fused: dict[str, list[tuple[torch.Tensor, torch.Tensor, int, int]]] = {}
    slots = layer.fused_slots()
    for (layer_index, module), keys in spec.modules.items():
        if layer_index != index:
            continue
        a, b = (tensors[k].to(torch.float32) for k in keys)
        for part, a_part, b_part in layer.shard_lora(module, a, b):
            fused, start, width = slots[part]
            by_fused.setdefault(fused, []).append((a_part, b_part * spec.scale, start, width))
    out_widths: dict[str, int] = {}
    for fused, start, width in slots.values():
        out_widths[fused] = max(out_widths.get(fused, 0), start + width)
    result = {}
    for fused, parts in by_fused.items():
        out_width = out_widths[fused]
        a_cat = torch.cat([a.t() for a, _, _, _ in parts], dim=1).contiguous()
        b_diag = torch.zeros(a_cat.shape[1], out_width)
        row = 0
        for a, b, start, width in parts:
            b_diag[row : row + a.shape[0], start : start + width] = b.t()
            row += a.shape[0]
        result[fused] = FusedLoRA(a_cat, b_diag)
    return result


@dataclass(frozen=True)
class LayerLoRA:
    """The adapters of one step for one layer: (rows, that adapter's fused deltas of this layer) per adapter."""

    groups: list[tuple[Rows, dict[str, FusedLoRA]]]

    def add(self, x: torch.Tensor, out: torch.Tensor, fused: str) -> torch.Tensor:
        """Add each adapter's delta of weight `fused` to its rows of `out`, in place.

        Args:
            x: [num_tokens, in_features] the weight's input.
            out: [num_tokens, out_features] the base output `x @ W` (this rank's shard).
            fused: "qkv_proj", "o_proj", "gate_up_proj" or "down_proj".
        Returns:
            `out`.
        """
        for rows, weights in self.groups:
            delta = weights.get(fused)
            if delta is None:
                continue
            if isinstance(rows, slice):
                out[rows].addmm_(x[rows] @ delta.a, delta.b)
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ delta.a) @ delta.b)
        return out


class LoRABatch:
    """Which flat token rows of a step use which loaded adapter (rows of requests without one get nothing).

    Args:
        groups: (rows, adapter) per adapter present in the step.
    """

    def __init__(self, groups: list[tuple[Rows, AdapterWeights]]) -> None:
        self.groups = groups

    def layer(self, index: int) -> LayerLoRA:
        """The step's adapters for decoder layer `index`."""
        return LayerLoRA([(rows, adapter.layers[index]) for rows, adapter in self.groups])

    @classmethod
    def from_requests(
        cls, adapter_ids: Sequence[int], query_lens: np.ndarray, adapters: dict[int, AdapterWeights]
    ) -> LoRABatch | None:
        """Group the rows of a step by adapter.

        Args:
            adapter_ids: each scheduled request's `lora_int_id` (0 = none), in batch order.
            query_lens: [num_requests] tokens of each request this step (its rows follow the previous ones').
            adapters: lora_int_id -> loaded adapter, for every non-zero id.
        Returns:
            None when no request has an adapter.
        """
        ends = np.cumsum(query_lens)
        starts = ends - query_lens
        ids = np.asarray(adapter_ids, dtype=np.int64)
        groups: list[tuple[Rows, AdapterWeights]] = []
        for lora_id in sorted(set(adapter_ids) - {0}):
            chosen = np.flatnonzero(ids == lora_id)
            first, last = int(chosen[0]), int(chosen[-1])
            if last - first + 1 == len(chosen):  # consecutive requests: one range of rows
                rows: Rows = slice(int(starts[first]), int(ends[last]))
            else:
                rows = torch.from_numpy(np.concatenate([np.arange(starts[i], ends[i]) for i in chosen]))
            groups.append((rows, adapters[lora_id]))
        return cls(groups) if groups else None
