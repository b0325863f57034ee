"""Where a Llama decoder layer's weights go: HF tensors into the fused `[in, out]` parameters of this TP rank's
shard, LoRA pairs sharded like their modules, SmoothQuant factors folded in, and the four linear weights converted
to int8 or to both fp32 layouts. Mixed into `llama.LlamaDecoderLayer`, which owns the attributes declared here.

Source: tensor-parallel shards after Megatron-LM (Shoeybi et al., 2019); SmoothQuant (Xiao et al., 2023).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from asyncllm.model.arch import ModelArchConfig
from asyncllm.model.kernels.choice import KernelChooser
from asyncllm.model.kernels.fp32 import pack_fp32
from asyncllm.model.kernels.int8 import Int8Weight, quantize_int8
from asyncllm.model.kernels.linear import Weight
from asyncllm.model.smoothquant import smoothing_scale

LINEAR_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LayerWeights:
    """Weight placement methods of a decoder layer (this TP rank's shard; `[in, out]` fused weights)."""

    arch: ModelArchConfig
    tp_rank: int
    tp_size: int
    q_size: int  # this rank's query columns
    kv_size: int  # this rank's K (or V) columns
    inter_size: int  # this rank's MLP columns
    input_norm: nn.Parameter
    post_attention_norm: nn.Parameter
    qkv_bias: nn.Parameter | None
    qkv_proj: Weight
    o_proj: Weight
    gate_up_proj: Weight
    down_proj: Weight

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

    def pack_fp32(self, chooser: KernelChooser[torch.Tensor] | None = None) -> None:
        """Prepare the four fused fp32 weights for the kernels `chooser` picks (`model/kernels/fp32.py`)."""
        self._replace_weights(lambda weight: pack_fp32(weight, chooser))

    def _replace_weights(self, convert: Callable[[torch.Tensor], Weight]) -> None:
        for name in LINEAR_WEIGHTS:
            weight = getattr(self, name)
            if not isinstance(weight, torch.Tensor):
                raise RuntimeError(f"{name} is already converted ({type(weight).__name__})")
            delattr(self, name)  # drop the Parameter registration before storing a non-Parameter
            setattr(self, name, convert(weight))

    def fused_slots(self) -> dict[str, tuple[str, int, int]]:
        """HF module path ("self_attn.q_proj") -> (fused param, first output column, width) on this rank."""
        q, kv, inter = self.q_size, self.kv_size, self.inter_size
        return {
            "self_attn.q_proj": ("qkv_proj", 0, q),
            "self_attn.k_proj": ("qkv_proj", q, kv),
            "self_attn.v_proj": ("qkv_proj", q + kv, kv),
            "self_attn.o_proj": ("o_proj", 0, self.arch.hidden_size),
            "mlp.gate_proj": ("gate_up_proj", 0, inter),
            "mlp.up_proj": ("gate_up_proj", inter, inter),
            "mlp.down_proj": ("down_proj", 0, self.arch.hidden_size),
        }

    def shard_lora(self, module: str, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a module's LoRA pair (A `[r, in]`, B `[out, r]`), sharded like the module: q/k/v/gate/up
        (column-parallel) keep A whole and shard B's output rows; o/down (row-parallel) shard A's input columns and
        keep B whole."""
        if module in ("self_attn.o_proj", "mlp.down_proj"):
            return self._shard(f"{module}.weight", lora_a), lora_b
        return lora_a, self._shard(f"{module}.weight", lora_b)

    def load_weight(self, name: str, w: torch.Tensor) -> None:
        """Place one HF layer tensor (name after `model.layers.N.`, `[out, in]`) into the fused [in, out] params."""
        w = self._shard(name, w)
        slots = self.fused_slots()  # weights are transposed to [in, out]
        if name == "input_layernorm.weight":
            self.input_norm.copy_(w)
        elif name == "post_attention_layernorm.weight":
            self.post_attention_norm.copy_(w)
        elif name.endswith(".bias") and name[: -len(".bias")] in slots and self.qkv_bias is not None:
            _, start, width = slots[name[: -len(".bias")]]
            self.qkv_bias[start : start + width].copy_(w)
        elif name.endswith(".weight") and name[: -len(".weight")] in slots:
            param, start, width = slots[name[: -len(".weight")]]
            target = getattr(self, param)
            if not isinstance(target, torch.Tensor):
                raise RuntimeError(f"{param} is already quantized; load weights before quantizing")
            target[:, start : start + width].copy_(w.t())
        else:
            raise KeyError(f"unexpected layer weight {name!r}")

    def _shard(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """This rank's part of an HF `[out, in]` tensor (or `[out]` bias): rows of q/k/v/gate/up, columns of
        o_proj/down_proj; norms whole."""
        if self.tp_size == 1 or "layernorm" in name:
            return w
        rank, d = self.tp_rank, self.arch.head_dim
        rows = {"self_attn.q_proj": self.q_size, "self_attn.k_proj": self.kv_size, "self_attn.v_proj": self.kv_size}
        rows |= {"mlp.gate_proj": self.inter_size, "mlp.up_proj": self.inter_size}
        base = name.rsplit(".", 1)[0]
        if base in rows:
            return w[rank * rows[base] : (rank + 1) * rows[base]]
        cols = {"self_attn.o_proj": self.arch.num_attention_heads // self.tp_size * d, "mlp.down_proj": self.inter_size}
        return w[:, rank * cols[base] : (rank + 1) * cols[base]] if base in cols else w
