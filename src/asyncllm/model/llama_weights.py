"""Where a decoder layer's weights go, as its architecture's layout (`layouts.py`) says: HF tensors into the fused
`[in, out]` parameters of this TP rank's shard, LoRA pairs sharded like their modules, SmoothQuant factors folded in,
and the four linear weights converted to int8, to blocks (Q8_0 / Q4_0 / Q4_1) or to both fp32 layouts. `LayerWeights` is
the base of every decoder layer (`llama.LlamaDecoderLayer`, `gemma3.Gemma3DecoderLayer`) and creates the parameters it
places.

Source: tensor-parallel shards after Megatron-LM (Shoeybi et al., 2019); SmoothQuant (Xiao et al., 2023).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from asyncllm.model.arch import ModelArchConfig
from asyncllm.model.kernels.block_quant import BlockQuantWeight, FileBlocks, block_weight_for
from asyncllm.model.kernels.choice import KernelChooser
from asyncllm.model.kernels.fp32 import pack_fp32
from asyncllm.model.kernels.int8 import Int8Weight, quantize_int8
from asyncllm.model.kernels.linear import Weight
from asyncllm.model.layouts import COLUMN_PARALLEL, FUSED_PARTS, layout_of, part_inputs, part_widths
from asyncllm.model.smoothquant import smoothing_scale

LINEAR_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def empty_param(*shape: int) -> nn.Parameter:
    """An uninitialized float32 parameter of `shape` (no gradient): filled by the loader."""
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


class LayerWeights(nn.Module):
    """The weights every decoder layer has, in this TP rank's shard, and where checkpoint tensors go in them.

    Args:
        arch: the model's hyper-parameters (`num_*_heads` and `intermediate_size` divisible by `tp_size`).
        tp_rank, tp_size: this rank's shard.
    Attributes:
        arch, layout: the hyper-parameters and the architecture's weight layout (`layouts.layout_of`).
        tp_rank, tp_size: as given.
        q_size, kv_size, inter_size: this rank's query, K (or V) and MLP columns.
        input_norm, post_attention_norm: `[hidden_size]` weights of the norms feeding the attention and the MLP.
        qkv_bias: `[q_size + 2 kv_size]` when the layout has q/k/v biases (Qwen2), else None.
        qkv_proj: `[hidden_size, q_size + 2 kv_size]`; o_proj: `[q_size, hidden_size]`;
        gate_up_proj: `[hidden_size, 2 inter_size]`; down_proj: `[inter_size, hidden_size]` (fp32 parameters
            until `quantize_int8` / `pack_fp32` replace them).
    """

    def __init__(self, arch: ModelArchConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.arch = arch
        self.layout = layout_of(arch.architecture)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        h, d = arch.hidden_size, arch.head_dim
        self.q_size = arch.num_attention_heads // tp_size * d
        self.kv_size = arch.num_key_value_heads // tp_size * d
        self.inter_size = arch.intermediate_size // tp_size
        self.input_norm = empty_param(h)
        self.post_attention_norm = empty_param(h)
        biased = bool(self.layout.biased_parts)
        self.qkv_bias: nn.Parameter | None = empty_param(self.q_size + 2 * self.kv_size) if biased else None
        # Created in this order: dummy weights draw from one generator in parameter order.
        self.qkv_proj: Weight = empty_param(h, self.q_size + 2 * self.kv_size)
        self.o_proj: Weight = empty_param(self.q_size, h)
        self.gate_up_proj: Weight = empty_param(h, 2 * self.inter_size)
        self.down_proj: Weight = empty_param(self.inter_size, h)
        # fused param -> part -> a GGUF file's own blocks, loaded but not yet placed (`quantize_blocks`)
        self.file_blocks: dict[str, dict[str, FileBlocks]] = {}

    def smooth(self, input_absmax: dict[int, torch.Tensor]) -> None:
        """Apply SmoothQuant factors (`model/kernels/int8.py`) to the four linear inputs, exactly in fp32: each input
        channel of a weight is scaled by s and the tensor producing that input (norm weight, V columns, up
        columns) by 1 / s. Needs the recorded input max |x| of every weight of this layer."""
        qkv, o, gate_up, down = (cast(torch.Tensor, getattr(self, n)) for n in LINEAR_WEIGHTS)
        s = smoothing_scale(input_absmax[id(qkv)], qkv.abs().amax(1))
        self.input_norm.div_(s)
        qkv.mul_(s[:, None])
        s = smoothing_scale(input_absmax[id(gate_up)], gate_up.abs().amax(1))
        self.post_attention_norm.div_(s)
        gate_up.mul_(s[:, None])
        s = smoothing_scale(input_absmax[id(down)], down.abs().amax(1))
        gate_up[:, self.inter_size :].div_(s)  # up columns: silu(gate) * up is linear in up
        down.mul_(s[:, None])
        # o_proj's input channel (head h, dim j) is V column (h // per_kv, j) mixed by attention: one factor per
        # KV head and dim, shared by the query heads of its group.
        d, num_kv = self.arch.head_dim, self.kv_size // self.arch.head_dim
        act = input_absmax[id(o)].view(num_kv, -1, d).amax(1)
        s_kv = smoothing_scale(act.flatten(), o.abs().amax(1).view(num_kv, -1, d).amax(1).flatten())
        v_cols = slice(self.q_size + self.kv_size, self.q_size + 2 * self.kv_size)
        qkv[:, v_cols].div_(s_kv)
        if self.qkv_bias is not None:
            self.qkv_bias[v_cols].div_(s_kv)
        o.mul_(s_kv.view(num_kv, 1, d).expand(num_kv, self.q_size // self.kv_size, d).reshape(-1, 1))

    def quantize_int8(self, chooser: KernelChooser[Int8Weight] | None = None) -> None:
        """Replace the four fused fp32 weights by int8 ones (this rank's shard, per output channel) prepared for the
        kernels `chooser` picks; forward then runs the fused int8 kernels (`model/kernels/row_kernels.py`) where they
        build and no LoRA adapter is in the step."""
        self._replace_weights(lambda weight: quantize_int8(weight, chooser))

    def quantize_blocks(self, mode: str) -> list[str]:
        """Replace the four fused fp32 weights by block-quantized ones (`model/kernels/block_quant.py`,
        `block_weight_for`; this rank's shard); forward then runs them through `linear` with the fp32 row kernels
        around. Returns how each was stored ("kept q4_1", ...)."""
        hows: list[str] = []
        kept = self._take_file_blocks(keep=mode == "gguf")

        def convert(weight: torch.Tensor) -> Weight:
            if id(weight) in kept:
                hows.append(f"kept {kept[id(weight)].kind}")
                return kept[id(weight)]
            blocks, how = block_weight_for(weight, mode)
            hows.append(how)
            return blocks

        self._replace_weights(convert)
        return hows

    def _take_file_blocks(self, keep: bool) -> dict[int, BlockQuantWeight]:
        """Place the GGUF blocks `load_weight` held: with `keep`, a fused weight whose parts are all blocks of one
        kind becomes those blocks (by id of its fp32 param; no values are computed, and they are the blocks
        `block_weight_for(..., "gguf")` finds in the dequantized values); every other part is dequantized into its
        slot of the fp32 param."""
        kept: dict[int, BlockQuantWeight] = {}
        slots = self.fused_slots()
        for fused, parts in self.file_blocks.items():
            target = cast(torch.Tensor, getattr(self, fused))
            ordered = [parts[p] for p in FUSED_PARTS[fused] if p in parts]
            whole = FileBlocks.concat(ordered) if keep and len(ordered) == len(FUSED_PARTS[fused]) else None
            if whole is not None:
                kept[id(target)] = whole.to_weight()
                continue
            for part, blocks in parts.items():
                _, start, width = slots[part]
                target[:, start : start + width].copy_(blocks.dequantize().t())
        self.file_blocks = {}
        return kept

    def pack_fp32(self, chooser: KernelChooser[torch.Tensor] | None = None) -> None:
        """Prepare the four fused fp32 weights for the kernels `chooser` picks (`model/kernels/fp32.py`)."""
        self._replace_weights(lambda weight: pack_fp32(weight, chooser))

    def _replace_weights(self, convert: Callable[[torch.Tensor], Weight]) -> None:
        if self.file_blocks:  # only `quantize_blocks` places them
            raise RuntimeError("the layer holds a GGUF file's blocks: only quantize_blocks can store its weights")
        for name in LINEAR_WEIGHTS:
            weight = getattr(self, name)
            if not isinstance(weight, torch.Tensor):
                raise RuntimeError(f"{name} is already converted ({type(weight).__name__})")
            delattr(self, name)  # drop the Parameter registration before storing a non-Parameter
            setattr(self, name, convert(weight))

    def fused_slots(self) -> dict[str, tuple[str, int, int]]:
        """Part ("q", "k", ..., `layouts.FUSED_PARTS`) -> (fused param, first output column, width) on this rank."""
        widths = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size, "o": self.arch.hidden_size}
        widths |= {"gate": self.inter_size, "up": self.inter_size, "down": self.arch.hidden_size}
        slots = {}
        for fused, parts in FUSED_PARTS.items():
            start = 0
            for part in parts:
                slots[part] = (fused, start, widths[part])
                start += widths[part]
        return slots

    def shard_lora(
        self, module: str, lora_a: torch.Tensor, lora_b: torch.Tensor
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """This rank's (part, A, B) of a module's LoRA pair (A `[r, in]`, B `[out, r]`), split by the module's parts
        and sharded like them: q/k/v/gate/up (column-parallel) share A whole and shard B's output rows; o/down
        (row-parallel) shard A's input columns and keep B whole.

        Raises:
            KeyError: the layout has no such module.
        """
        parts = self.layout.module_parts(module)
        if parts[0] in COLUMN_PARALLEL:
            return [(part, lora_a, self._shard(part, b)) for part, b in self._split(parts, lora_b)]
        return [(parts[0], self._shard(parts[0], lora_a), lora_b)]

    def hold_file_blocks(self, name: str, blocks: FileBlocks) -> None:
        """Take one layer tensor (name as `load_weight`'s) as a GGUF file's own blocks: a module's weight at TP=1 is
        split into its parts and held for `quantize_blocks`; anything else is dequantized into `load_weight`.

        Raises:
            KeyError: as `load_weight`.
        """
        base, _, kind = name.rpartition(".")
        if self.tp_size > 1 or kind != "weight" or base not in self.layout.modules:
            self.load_weight(name, blocks.dequantize())
            return
        slots = self.fused_slots()
        for part, piece in self._split(self.layout.modules[base], blocks.raw):
            self.file_blocks.setdefault(slots[part][0], {})[part] = FileBlocks(blocks.kind, piece)

    def load_weight(self, name: str, w: torch.Tensor) -> None:
        """Place one HF layer tensor (name after `model.layers.N.`, `[out, in]` or `[out]`) into this rank's params:
        a norm whole, a module split into its parts (`layouts.py`), each part sharded into its fused slot (weights
        transposed to `[in, out]`).

        Raises:
            KeyError: a tensor the layout does not have (or a bias on a part without one).
        """
        base, _, kind = name.rpartition(".")
        if base in self.layout.norms and kind == "weight":
            cast(torch.Tensor, getattr(self, self.layout.norms[base])).copy_(w)
            return
        if base not in self.layout.modules or kind not in ("weight", "bias"):
            raise KeyError(f"unexpected layer weight {name!r}")
        slots = self.fused_slots()
        for part, piece in self._split(self.layout.modules[base], w):
            fused, start, width = slots[part]
            shard = self._shard(part, piece)
            if kind == "bias":
                if part not in self.layout.biased_parts or self.qkv_bias is None:
                    raise KeyError(f"unexpected layer weight {name!r}")
                self.qkv_bias[start : start + width].copy_(shard)
                continue
            target = getattr(self, fused)
            if not isinstance(target, torch.Tensor):
                raise RuntimeError(f"{fused} is already quantized; load weights before quantizing")
            target[:, start : start + width].copy_(shard.t())

    def _split(self, parts: tuple[str, ...], w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """An unsharded module tensor's rows by part (one part: the tensor itself)."""
        if len(parts) == 1:
            return [(parts[0], w)]
        widths = part_widths(self.arch)
        if w.shape[0] != sum(widths[p] for p in parts):
            raise ValueError(f"a tensor of parts {parts} has {w.shape[0]} rows, not {sum(widths[p] for p in parts)}")
        return list(zip(parts, w.split([widths[p] for p in parts]), strict=True))

    def _shard(self, part: str, w: torch.Tensor) -> torch.Tensor:
        """This rank's part of one part's unsharded `[out, in]` tensor (or `[out]` bias; or a LoRA A `[r, in]` of a
        row-parallel part): output rows of a column-parallel part, input columns of a row-parallel one."""
        if self.tp_size == 1:
            return w
        rank = self.tp_rank
        if part in COLUMN_PARALLEL:
            rows = part_widths(self.arch)[part] // self.tp_size
            return w[rank * rows : (rank + 1) * rows]
        cols = part_inputs(self.arch)[part] // self.tp_size
        return w[:, rank * cols : (rank + 1) * cols]
