"""The compiled decode stacks of a Llama-family model: every layer of a decode-only step in one C++ call.

A decode step of a 135M model at batch 1 spends about a millisecond in the Python around its ~11 kernel calls per
layer (30 layers); a stack makes the same calls, in the same order on the same inputs, from C++ (the same bits;
`csrc/row_kernels.cpp` `BlockDecodeStack`, `Int8DecodeStack`). Two kinds:

- block weights (`quantization="gguf"`, "q8_0", "q4_0"): one stack for every row count, on the block kernels the
  start-up check chose (`block_kernels`);
- int8 weights: one stack per row class (`model/kernels/choice.py` `ROW_CLASSES`), since each weight's product
  runs the kernel its choice names for the step's rows. A class whose choice names a kernel the stack cannot call
  from C++ (oneDNN, `torch._int_mm`: large row counts) has no stack, and its steps take the per-layer calls.

A stack exists only at TP=1, without per-head q/k norms (Qwen3) or partial rotary (Phi-3), where every layer's
weights are of the one kind; `DecodeStacks` builds each on its first decode-only step and keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import torch

from asyncllm.model.arch import ModelArchConfig
from asyncllm.model.kernels.block_quant import KIND_CODES, BlockQuantWeight, block_kernels
from asyncllm.model.kernels.choice import row_class
from asyncllm.model.kernels.int8 import Int8Weight
from asyncllm.model.kernels.row_kernels import DecodeStack, RowKernels
from asyncllm.model.llama_weights import LINEAR_WEIGHTS

BLOCK_STACK_KEY = -1  # the block stack's key: one stack for every row count
INT8_STACK_KERNELS = {"vnni": 0, "avx2": 1}  # the int8 kernels a stack calls, by `Int8DecodeStack`'s codes


class StackLayer(Protocol):
    """What a stack reads of a decoder layer (`model/llama.py` `LlamaDecoderLayer` has it); its four linear weights
    are read by name (`LINEAR_WEIGHTS`); the first layer's `qkv_proj` tells the kind of stack."""

    @property
    def arch(self) -> ModelArchConfig: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def q_size(self) -> int: ...
    @property
    def kv_size(self) -> int: ...
    @property
    def rotary_dim(self) -> int: ...
    @property
    def window(self) -> int | None: ...
    @property
    def q_norm(self) -> torch.Tensor | None: ...
    @property
    def qkv_bias(self) -> torch.Tensor | None: ...
    @property
    def input_norm(self) -> torch.Tensor: ...
    @property
    def post_attention_norm(self) -> torch.Tensor: ...
    @property
    def qkv_proj(self) -> object: ...


class DecodeStacks:
    """A model's decode stacks, each built at its first decode-only step and kept (None: that step's layers cannot
    take a stack). `last` is the stack of the latest decode-only step asked for, or None (tests read it). A deep copy
    of the model gets none built: a stack holds the original's weights and cannot be copied."""

    def __init__(self) -> None:
        self._built: dict[int, DecodeStack | None] = {}
        self.last: DecodeStack | None = None

    def for_rows(
        self, rows: int, layers: Sequence[StackLayer], final_norm: torch.Tensor, kernels: RowKernels | None
    ) -> DecodeStack | None:
        """The stack for a decode-only step of `rows` sequences (>= 1) over `layers` and the final RMSNorm's weight
        `final_norm`, building it the first time."""
        key = row_class(rows) if isinstance(layers[0].qkv_proj, Int8Weight) else BLOCK_STACK_KEY
        if key not in self._built:
            self._built[key] = build_decode_stack(rows, layers, final_norm, kernels)
        self.last = self._built[key]
        return self.last

    def __deepcopy__(self, memo: dict[int, object]) -> DecodeStacks:
        return DecodeStacks()


def build_decode_stack(
    rows: int, layers: Sequence[StackLayer], final_norm: torch.Tensor, kernels: RowKernels | None
) -> DecodeStack | None:
    """The stack of `layers` as they are now for decode steps of `rows` rows, or None where a layer would not take
    it: no kernels, TP > 1, per-head q/k norms or partial rotary, weights neither all blocks nor all int8, no
    checked block kernels, or an int8 weight whose kernel for `rows` the stack cannot call."""
    if kernels is None or any(not _plain_layer(layer) for layer in layers):
        return None
    weights = [getattr(layer, name) for layer in layers for name in LINEAR_WEIGHTS]
    if all(isinstance(w, BlockQuantWeight) for w in weights):
        return _block_stack(layers, final_norm)
    if all(isinstance(w, Int8Weight) for w in weights):
        return _int8_stack(layers, final_norm, kernels, rows)
    return None


def _plain_layer(layer: StackLayer) -> bool:
    """Whether the layer's step is the one a stack makes: TP=1, no per-head q/k norms, rotary on whole heads."""
    return layer.tp_size == 1 and layer.q_norm is None and layer.rotary_dim == layer.arch.head_dim


def _stack_geometry(layers: Sequence[StackLayer]) -> tuple[float, int, int, int, float]:
    """(RMSNorm eps, head_dim, q_size, kv_size, softmax scale) of the stack."""
    arch = layers[0].arch
    return arch.rms_norm_eps, arch.head_dim, layers[0].q_size, layers[0].kv_size, arch.head_dim**-0.5


def _bias_or_empty(layer: StackLayer) -> torch.Tensor:
    return layer.qkv_bias if layer.qkv_bias is not None else torch.empty(0)


def _block_stack(layers: Sequence[StackLayer], final_norm: torch.Tensor) -> DecodeStack | None:
    """`BlockDecodeStack` over block layers, on the checked block kernels' path (None: no checked kernels)."""
    checked = block_kernels()
    if checked is None:
        return None
    module, path = checked
    tensors: list[torch.Tensor] = []
    ints: list[int] = []
    for layer in layers:
        weights = [cast(BlockQuantWeight, getattr(layer, name)) for name in LINEAR_WEIGHTS]
        tensors += [layer.input_norm, layer.post_attention_norm, _bias_or_empty(layer)]
        for w in weights:
            tensors += [w.qs, w.d, w.m if w.m is not None else torch.empty(0, dtype=torch.float16)]
        ints += [KIND_CODES[w.kind] for w in weights] + [w.out_features for w in weights] + [layer.window or 0]
    return module.BlockDecodeStack(tensors, ints, final_norm, *_stack_geometry(layers), path)


def _int8_stack(
    layers: Sequence[StackLayer], final_norm: torch.Tensor, kernels: RowKernels, rows: int
) -> DecodeStack | None:
    """`Int8DecodeStack` over int8 layers with each product on the kernel its weight's choice names for `rows`
    (None: a choice names a kernel the stack cannot call)."""
    tensors: list[torch.Tensor] = []
    ints: list[int] = []
    for layer in layers:
        weights = [cast(Int8Weight, getattr(layer, name)) for name in LINEAR_WEIGHTS]
        names = [w.choice.kernel_for(rows) if w.choice is not None else "int_mm" for w in weights]
        if any(name not in INT8_STACK_KERNELS for name in names):
            return None
        tensors += [layer.input_norm, layer.post_attention_norm, _bias_or_empty(layer)]
        for w, name in zip(weights, names, strict=True):
            tensors += _int8_operands(w, name)
        in_out = [w.qweight.shape for w in weights]
        ints += [INT8_STACK_KERNELS[n] for n in names] + [s[0] for s in in_out] + [s[1] for s in in_out]
        ints += [layer.window or 0]
    return kernels.Int8DecodeStack(tensors, ints, final_norm, *_stack_geometry(layers))


def _int8_operands(weight: Int8Weight, name: str) -> list[torch.Tensor]:
    """[packed, correction (empty for AVX2), scale] of `weight` prepared for kernel `name` ("vnni" or "avx2")."""
    if name == "vnni":
        packed, correction, scale, _, _ = weight.operands["vnni"]
        return [packed, correction, scale]
    packed, scale, _, _ = weight.operands["avx2"]
    return [packed, torch.empty(0, dtype=torch.int32), scale]
