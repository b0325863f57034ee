"""Llama-family decoder for CPU inference in float32: SmolLM2, Llama, Mistral; Qwen2 (q/k/v biases), Qwen3 (per-head
q/k RMSNorm), Phi-3 (fused checkpoint modules, partial rotary), as each architecture's layout (`layouts.py`) says.

Linear weights are stored `[in, out]` contiguous and applied as `x @ W` (about twice the weight-streaming
speed of `F.linear` for matrix-vector products on this CPU); q/k/v are one fused matmul and gate/up another.
Rotary embeddings use a cos/sin cache indexed by positions. The LM head runs only in `compute_logits`, on
the rows the runner samples. Parameters are filled by `load_weights` from HF-named `[out, in]` tensors.

Tensor parallelism (Megatron-LM, Shoeybi et al., 2019): at TP=N each rank holds 1/N of the query heads, KV heads
(column shards of the fused qkv), of the MLP columns (gate/up) and the matching rows of o_proj and down_proj; the
two row-parallel outputs are summed over ranks (`parallel_state.all_reduce`). Embeddings, norms and the LM head are
replicated, so every rank computes the same logits. At TP=1 no collective runs.

Sources: Llama (Touvron et al., 2023); RMSNorm (Zhang & Sennrich, 2019); rotary position embedding,
RoFormer (Su et al., 2021), in HF's "rotate half" layout, with Llama 3 frequency scaling (model/layers/rotary.py);
SwiGLU MLP (Shazeer, 2020); GQA (Ainslie et al., 2023).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.distributed.parallel_state import all_reduce, get_tp_rank, get_tp_size
from asyncllm.distributed.tp_sizes import check_tp_divides
from asyncllm.model.arch import ModelArchConfig
from asyncllm.model.decode_stack import DecodeStacks, StackLayer
from asyncllm.model.kernels.block_quant import (
    BlockQuantWeight,
    FileBlocks,
    block_kernels,
    block_linear,
    block_weight_for,
    fused_block_linear,
)
from asyncllm.model.kernels.choice import KernelChooser
from asyncllm.model.kernels.fp32 import PackedFp32Weight, pack_fp32
from asyncllm.model.kernels.int8 import Int8Weight, int8_matmul, quantize_int8
from asyncllm.model.kernels.linear import Weight, linear, record_input_absmax
from asyncllm.model.kernels.rotary import apply_rotary
from asyncllm.model.kernels.row_kernels import MAX_NORM_COLUMNS, DecodeStack, RowKernels, load_kernels
from asyncllm.model.layers.attention import decode_reads_cache, paged_attention, write_kv_cache
from asyncllm.model.layers.attention_metadata import AttentionMetadata, build_attention_metadata
from asyncllm.model.layers.head_norm import head_rms_norm
from asyncllm.model.layers.rotary import arch_cos_sin
from asyncllm.model.layouts import layout_of
from asyncllm.model.llama_weights import LINEAR_WEIGHTS, LayerWeights, empty_param
from asyncllm.model.smoothquant import smoothing_scale

if TYPE_CHECKING:
    from asyncllm.lora.weights import LayerLoRA, LoRABatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich, 2019): x / sqrt(mean(x^2) + eps) * weight, over the last dim."""
    return F.rms_norm(x, weight.shape, weight, eps)


class LlamaDecoderLayer(LayerWeights):
    """Pre-norm attention + SwiGLU MLP block with fused [in, out] weights, holding this TP rank's shard.

    What the architecture's layout (`layouts.py`) has, the layer has: q/k/v biases (Qwen2), per-head RMSNorm on q
    and k before rotary (Qwen3); rotary on the first `arch.rotary_dim` dims of each head (Phi-3's partial rotary).

    Args:
        arch: the model's hyper-parameters.
        tp_rank, tp_size: this rank's shard (`num_*_heads` and `intermediate_size` divisible by `tp_size`).
        kernels: the fused row kernels (`model/kernels/row_kernels.py`), or None for torch ops only (same values).
        window: this layer's sliding attention window, tokens (`ModelArchConfig.layer_window`: Mistral's, Phi-3's),
            or None for full attention.
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        tp_rank: int = 0,
        tp_size: int = 1,
        kernels: RowKernels | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__(arch, tp_rank, tp_size)
        self.window = window
        self.fused_kernels = kernels
        d = arch.head_dim
        self.q_norm: nn.Parameter | None = empty_param(d) if self.layout.qk_norm else None
        self.k_norm: nn.Parameter | None = empty_param(d) if self.layout.qk_norm else None
        self.rotary_dim = arch.rotary_dim or d

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LayerLoRA | None = None,
    ) -> torch.Tensor:
        """[num_tokens, hidden_size] -> [num_tokens, hidden_size]; writes this step's K/V into `kv_cache`. With
        `lora`, each adapter's delta is added to its rows' outputs of the four linear weights."""
        kernels = self.fused_kernels
        if kernels is not None and lora is None and isinstance(self.qkv_proj, Int8Weight):
            return self._forward_fused_int8(hidden, cos, sin, kv_cache, meta, kernels)
        if kernels is not None and lora is None and self.tp_size == 1 and isinstance(self.qkv_proj, BlockQuantWeight):
            return self._forward_blocks(hidden, cos, sin, kv_cache, meta, kernels)
        hidden = hidden + self._attention(self._rms_norm(hidden, self.input_norm), cos, sin, kv_cache, meta, lora)
        return hidden + self._mlp(self._rms_norm(hidden, self.post_attention_norm), lora)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused_kernels is None:
            return rms_norm(x, weight, self.arch.rms_norm_eps)
        return self.fused_kernels.rms_norm(x.contiguous(), weight, self.arch.rms_norm_eps)

    def _forward_fused_int8(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kernels: RowKernels,
    ) -> torch.Tensor:
        """`forward` with int8 weights in 7 fused kernel calls around the products instead of ~55 small torch ops,
        giving the same values bit for bit (`model/kernels/row_kernels.py`)."""
        qkv_proj, o_proj, gate_up_proj, down_proj = (cast(Int8Weight, getattr(self, n)) for n in LINEAR_WEIGHTS)
        eps = self.arch.rms_norm_eps
        qx, scale = kernels.rms_norm_quantize(hidden, self.input_norm, eps)
        attn = self._attend(int8_matmul(qx, qkv_proj), cos, sin, kv_cache, meta, row_scale=scale)
        qx, scale = kernels.quantize_rows(attn.contiguous())
        hidden = self._add_scaled(kernels, hidden, int8_matmul(qx, o_proj), scale)
        qx, scale = kernels.rms_norm_quantize(hidden, self.post_attention_norm, eps)
        qx, scale = kernels.silu_mul_quantize(int8_matmul(qx, gate_up_proj), scale)
        return self._add_scaled(kernels, hidden, int8_matmul(qx, down_proj), scale)

    def _forward_blocks(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kernels: RowKernels,
    ) -> torch.Tensor:
        """`forward` with block weights at TP=1 and no LoRA: the four products straight on the block kernels, each
        RMSNorm / SiLU x mul run inside its product's call and each residual added there (`out + hidden` is
        `hidden + out` bit for bit; `fused_block_linear`), without `linear`'s dispatch, the all-reduce calls or a new
        tensor per norm and add; where the block kernels failed their check, the same steps as separate calls."""
        qkv_proj, o_proj = cast(BlockQuantWeight, self.qkv_proj), cast(BlockQuantWeight, self.o_proj)
        gate_up_proj, down_proj = cast(BlockQuantWeight, self.gate_up_proj), cast(BlockQuantWeight, self.down_proj)
        eps = self.arch.rms_norm_eps
        checked = block_kernels()
        if checked is not None:  # each norm, SiLU x mul and residual add inside its product's call: 4 calls, not 9
            module, path = checked
            hidden = hidden.contiguous()
            qkv = fused_block_linear(module, path, hidden, qkv_proj, "rms_norm", self.input_norm, eps)
            attn = self._attend(qkv, cos, sin, kv_cache, meta).contiguous()
            hidden = fused_block_linear(module, path, attn, o_proj, residual=hidden)
            gate_up = fused_block_linear(module, path, hidden, gate_up_proj, "rms_norm", self.post_attention_norm, eps)
            return fused_block_linear(module, path, gate_up, down_proj, "silu_mul", residual=hidden)
        qkv = block_linear(kernels.rms_norm(hidden.contiguous(), self.input_norm, eps), qkv_proj)
        hidden = block_linear(self._attend(qkv, cos, sin, kv_cache, meta), o_proj).add_(hidden)
        gate_up = block_linear(kernels.rms_norm(hidden, self.post_attention_norm, eps), gate_up_proj)
        return block_linear(kernels.silu_mul(gate_up), down_proj).add_(hidden)

    def _add_scaled(
        self, kernels: RowKernels, hidden: torch.Tensor, out: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        """`hidden + all_reduce(out * scale)`: one fused kernel at TP=1."""
        if self.tp_size == 1:
            return kernels.add_scaled_(hidden, out, scale)
        return hidden + all_reduce(out.mul_(scale))

    def _attention(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LayerLoRA | None = None,
    ) -> torch.Tensor:
        qkv = linear(x, self.qkv_proj)
        if lora is not None:
            lora.add(x, qkv, "qkv_proj")
        attn = self._attend(qkv, cos, sin, kv_cache, meta)
        out = linear(attn, self.o_proj)
        return all_reduce(out if lora is None else lora.add(attn, out, "o_proj"))

    def _attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        row_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[num_tokens, q + 2 kv columns] projections (times `row_scale` [num_tokens, 1] if given; modified in
        place) -> [num_tokens, q columns] attention output: bias, rotary, this step's K/V written into
        `kv_cache`, paged attention."""
        n, d = qkv.shape[0], self.arch.head_dim
        rotated = self.q_size + self.kv_size  # q and k heads rotated in one pass
        kernels = self.fused_kernels
        heads = [self.q_size // d, self.kv_size // d]
        if kernels is not None and self.q_norm is None and self.rotary_dim == d:
            qkv = qkv.contiguous()
            kernels.scale_bias_rotate_(qkv, row_scale, self.qkv_bias, cos, sin, rotated)
            # the same views of qkv as the slices below, in two ops instead of five
            q, k, v = qkv.view(n, -1, d).split_with_sizes([*heads, heads[1]], dim=1)
        else:
            if row_scale is not None:
                qkv.mul_(row_scale)
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias
            qk = qkv[:, :rotated].view(n, -1, d)
            if self.q_norm is not None and self.k_norm is not None:
                eps, q_heads = self.arch.rms_norm_eps, self.q_size // d
                q_normed = head_rms_norm(qk[:, :q_heads], self.q_norm, eps, kernels)
                qk = torch.cat([q_normed, head_rms_norm(qk[:, q_heads:], self.k_norm, eps, kernels)], dim=1)
            q, k = self._rotate(qk, cos, sin).split(heads, dim=1)
            v = qkv[:, rotated:].view(n, -1, d)
        write_kv_cache(kv_cache, k, v, meta.slot_mapping, meta.slot_blocks, kernels)
        return paged_attention(q, kv_cache, meta, new_kv=(k, v), kernels=kernels, window=self.window)

    def _rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary on the first `rotary_dim` dims of each [num_tokens, heads, head_dim] head (the tables are that
        wide); the rest pass through (Phi-3's partial rotary, as HF's `apply_rotary_pos_emb` on `[..., :dim]`)."""
        if self.rotary_dim == qk.shape[-1]:
            return apply_rotary(qk, cos, sin)
        return torch.cat([apply_rotary(qk[..., : self.rotary_dim], cos, sin), qk[..., self.rotary_dim :]], dim=-1)

    def _mlp(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj)
        if lora is not None:
            lora.add(x, gate_up, "gate_up_proj")
        if self.fused_kernels is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        else:
            act = self.fused_kernels.silu_mul(gate_up.contiguous())
        out = linear(act, self.down_proj)
        return all_reduce(out if lora is None else lora.add(act, out, "down_proj"))


class LlamaForCausalLM(nn.Module):
    """Decoder-only Llama-family language model.

    Attributes:
        arch: the architecture config it was built from.
    """

    rope_cos: torch.Tensor  # [max_position_embeddings, head_dim] buffers: [cos, cos] and [-sin, sin] (rope.py)
    rope_sin: torch.Tensor
    head_file_blocks: FileBlocks | None = None  # the LM head as a GGUF file's blocks, until `quantize_blocks`
    # Decode-only steps of a block or int8 model at TP=1 run every layer in one call (`model/decode_stack.py`; the
    # same bits as the per-layer calls). False: the per-layer calls (tests compare the two).
    fuse_decode_layers: bool = True

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.arch = arch
        tp_rank, tp_size = get_tp_rank(), get_tp_size()  # from parallel_state: (0, 1) unless a TP group was joined
        check_tp_divides(arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size, tp_size)
        self.fused_kernels = load_kernels() if arch.hidden_size <= MAX_NORM_COLUMNS else None
        # decode steps read the paged cache directly: the model runner keeps no dense K/V mirror for them
        self.decode_reads_cache = decode_reads_cache(self.fused_kernels, arch.head_dim)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, tp_rank, tp_size, self.fused_kernels, arch.layer_window(i))
            for i in range(arch.num_hidden_layers)
        )
        self.norm = empty_param(arch.hidden_size)
        self.lm_head: Weight = empty_param(arch.hidden_size, arch.vocab_size)  # [in, out]
        # Tied: embeddings are columns of lm_head (no second 113 MB copy); untied: their own [vocab, hidden].
        self.embed_tokens: nn.Parameter | None = (
            None if arch.tie_word_embeddings else empty_param(arch.vocab_size, arch.hidden_size)
        )
        self._decode_stacks = DecodeStacks()
        cos, sin = arch_cos_sin(arch)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
        embeds_override: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run every layer over a flat batch of tokens.

        Args:
            input_ids: [num_tokens] int64.
            positions: [num_tokens] int64 absolute positions (< max_position_embeddings).
            kv_caches: one [num_blocks, 2, block_size, num_kv_heads, head_dim] float32 tensor per layer;
                written in place at `meta.slot_mapping`.
            meta: attention metadata of this step (`build_attention_metadata`).
            lora: the step's LoRA adapters by rows (`asyncllm.lora.weights.LoRABatch`), or None.
            embeds_override: (rows [n] int64, values [n, hidden_size] float32): those rows of the first layer's
                input are the given vectors instead of their token embeddings (prompt embeddings); None = none.
        Returns:
            [num_tokens, hidden_size] float32 final-normed hidden states.
        """
        hidden = self.embed(input_ids)
        if embeds_override is not None:
            rows, values = embeds_override
            hidden[rows] = values
        stack = self._decode_stack(meta, input_ids.shape[0]) if lora is None else None
        if stack is not None and meta.slot_blocks is not None:
            group = meta.groups[0]
            blocks, offsets = meta.slot_blocks
            return stack.forward(
                hidden, positions, self.rope_cos, self.rope_sin, kv_caches, blocks, offsets, group.block_tables,
                group.seq_lens,
            )  # fmt: skip
        cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = layer(hidden, cos, sin, kv_cache, meta, None if lora is None else lora.layer(index))
        if self.fused_kernels is None:
            return rms_norm(hidden, self.norm, self.arch.rms_norm_eps)
        return self.fused_kernels.rms_norm(hidden.contiguous(), self.norm, self.arch.rms_norm_eps)

    def _decode_stack(self, meta: AttentionMetadata, rows: int) -> DecodeStack | None:
        """The compiled stack of layers for this step if it is decode-only (`rows` sequences) and every layer's
        per-layer calls would read the cache with the decode kernel (`fuse_decode_layers`; `model/decode_stack.py`),
        else None."""
        if not (self.fuse_decode_layers and self.decode_reads_cache and len(meta.groups) == 1):
            return None
        if meta.groups[0].max_query_len != 1:
            return None
        layers = cast("Sequence[StackLayer]", self.layers)
        return self._decode_stacks.for_rows(rows, layers, self.norm, self.fused_kernels)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64 -> [num_tokens, hidden_size] float32 token embeddings."""
        if self.embed_tokens is None and isinstance(self.lm_head, BlockQuantWeight):
            return self.lm_head.dequantize_columns(input_ids)
        if self.embed_tokens is None:
            return self._fp32_head().index_select(1, input_ids).t().contiguous()
        return self.embed_tokens[input_ids]

    def _fp32_head(self) -> torch.Tensor:
        """The plain [hidden_size, vocab_size] float32 LM head (its columns are the tied embeddings)."""
        if isinstance(self.lm_head, PackedFp32Weight):
            return self.lm_head.weight
        if not isinstance(self.lm_head, torch.Tensor):
            raise RuntimeError("the LM head is quantized; weights must be loaded before quantize_int8")
        return self.lm_head

    @torch.no_grad()
    def pack_fp32(self, chooser: KernelChooser[torch.Tensor] | None = None) -> None:
        """Prepare every linear weight and the LM head for the float32 kernels `chooser` picks for their shapes
        (`model/kernels/fp32.py`; default: measured on this host): a packed kernel keeps a second copy."""
        for layer in self.layers:
            cast(LlamaDecoderLayer, layer).pack_fp32(chooser)
        head = self._fp32_head()
        del self.lm_head
        self.lm_head = pack_fp32(head, chooser)

    @torch.inference_mode()
    def quantize_blocks(self, mode: str) -> str:
        """Store every linear weight and the LM head in blocks of 32 (`model/kernels/block_quant.py`) for
        `EngineArgs.quantization=mode` ("q8_0", "q4_0" (the LM head at Q8_0) or "gguf": a GGUF file's own Q4_0 /
        Q4_1 / Q8_0 blocks kept, other types requantized to Q8_0). No SmoothQuant. A tied model looks its embeddings
        up in the block LM head (`BlockQuantWeight.dequantize_columns`: the file's own values under "gguf"), keeping
        no float32 copy.

        Returns:
            One log line: how the weights were stored, their bytes, and the kernel path.
        Raises:
            BlockShapeError: a weight's input features are not a multiple of 32 (at TP=N: of this rank's shard).
        """
        self._decode_stacks = DecodeStacks()  # a stack holds the weights: built again at the next decode step
        hows: dict[str, int] = {}
        for layer in self.layers:
            for how in cast(LlamaDecoderLayer, layer).quantize_blocks(mode):
                hows[how] = hows.get(how, 0) + 1
        head_blocks, self.head_file_blocks = self.head_file_blocks, None
        if head_blocks is not None and mode != "gguf":
            self._fp32_head().copy_(head_blocks.dequantize().t())
        head = self._fp32_head()
        del self.lm_head
        if head_blocks is not None and mode == "gguf":
            self.lm_head, head_how = head_blocks.to_weight(), f"kept {head_blocks.kind}"
        else:
            self.lm_head, head_how = block_weight_for(head, mode, lm_head=True)
        weights = [getattr(layer, name) for layer in self.layers for name in LINEAR_WEIGHTS] + [self.lm_head]
        megabytes = sum(cast(BlockQuantWeight, w).nbytes for w in weights) / 1e6
        chosen = block_kernels()
        path = f"{chosen[1]} kernels" if chosen is not None else "NO KERNELS: dequantized at each product"
        layers = ", ".join(f"{count} {how}" for how, count in sorted(hows.items()))
        return f"block-quantized weights ({mode}; {path}): layers {layers}; LM head {head_how}; {megabytes:.1f} MB"

    @torch.inference_mode()
    def quantize_int8(self, calibration_ids: list[int], chooser: KernelChooser[Int8Weight] | None = None) -> None:
        """Store every linear weight and the LM head as int8 per output channel (`model/kernels/int8.py`), after
        SmoothQuant smoothing calibrated on one forward pass over `calibration_ids` (a few hundred tokens of
        ordinary text), prepared for the int8 kernels `chooser` picks (default: measured on this host). At TP=N
        every rank runs this together (the pass all-reduces) and quantizes its shard. Embeddings stay float32: a
        tied model keeps a float32 `[vocab, hidden]` copy of the embedding table, read only at the rows of the
        step's tokens.

        Raises:
            ValueError: `calibration_ids` is empty or longer than the model's context.
        """
        if not 0 < len(calibration_ids) <= self.arch.max_position_embeddings:
            raise ValueError(f"calibration needs 1..{self.arch.max_position_embeddings} tokens")
        head = self._fp32_head()
        if self.embed_tokens is None:
            self.embed_tokens = nn.Parameter(head.t().contiguous(), requires_grad=False)
        with record_input_absmax() as input_absmax:
            self._calibration_pass(calibration_ids)
        for layer in self.layers:
            cast(LlamaDecoderLayer, layer).smooth(input_absmax)
        s = smoothing_scale(input_absmax[id(head)], head.abs().amax(1))
        self.norm.div_(s)
        head.mul_(s[:, None])
        self._decode_stacks = DecodeStacks()  # a stack holds the weights: built again at the next decode step
        for layer in self.layers:
            cast(LlamaDecoderLayer, layer).quantize_int8(chooser)
        del self.lm_head
        self.lm_head = quantize_int8(head, chooser)

    def _calibration_pass(self, token_ids: list[int], block_size: int = 16) -> None:
        """One prefill of `token_ids` in a scratch KV cache, then the LM head on every row."""
        n, layer0 = len(token_ids), cast(LlamaDecoderLayer, self.layers[0])
        num_blocks = -(-n // block_size)
        shape = (num_blocks, 2, block_size, layer0.kv_size // self.arch.head_dim, self.arch.head_dim)
        kv_caches = [torch.zeros(shape) for _ in self.layers]
        meta = build_attention_metadata([n], [n], [list(range(num_blocks))], block_size)
        self.compute_logits(self(torch.tensor(token_ids), torch.arange(n), kv_caches, meta))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_sampled, hidden_size] -> [num_sampled, vocab_size] float32 logits."""
        if self.fused_kernels is not None and isinstance(self.lm_head, Int8Weight):
            qx, scale = self.fused_kernels.quantize_rows(hidden.contiguous())  # bit for bit `linear`'s
            return int8_matmul(qx, self.lm_head).mul_(scale)
        return linear(hidden, self.lm_head)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | FileBlocks]]) -> None:
        """Copy HF-named tensors (`model.layers.N.self_attn.q_proj.weight`, `[out, in]`) into the fused params. A
        GGUF file's own blocks (`FileBlocks`: the loader's `quantization="gguf"`) of the layers' modules and the LM
        head are held as they are for `quantize_blocks`; other such tensors are dequantized.

        Raises:
            KeyError: for a tensor name this model does not have.
            ValueError: the checkpoint lacks a tensor the model needs (named; an unfilled parameter would hold
                whatever memory it was given).
        """
        loaded = set()
        for name, tensor in weights:
            if isinstance(tensor, FileBlocks):
                self._hold_file_blocks(name, tensor)
            else:
                self._load_one(name, tensor.to(torch.float32))
            loaded.add(name)
        missing = sorted(self.expected_weights() - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}")

    def expected_weights(self) -> set[str]:
        """The HF names a checkpoint must hold for this model: the embedding, final norm, the LM head when untied,
        and every layer's norms, modules and biases as the architecture's layout lists them."""
        layout = layout_of(self.arch.architecture)
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        names |= set() if self.arch.tie_word_embeddings else {"lm_head.weight"}
        per_layer = {f"{norm}.weight" for norm in layout.norms}
        for module, parts in layout.modules.items():
            per_layer.add(f"{module}.weight")
            if set(parts) & layout.biased_parts:
                per_layer.add(f"{module}.bias")
        return names | {f"model.layers.{i}.{n}" for i in range(self.arch.num_hidden_layers) for n in per_layer}

    def _hold_file_blocks(self, name: str, blocks: FileBlocks) -> None:
        """The LM head's (a tied model's embeddings') and the layers' modules' blocks held; others dequantized."""
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if name == ("lm_head.weight" if self.embed_tokens is not None else "model.embed_tokens.weight"):
            self.head_file_blocks = blocks
        elif match is not None:
            cast(LlamaDecoderLayer, self.layers[int(match[1])]).hold_file_blocks(match[2], blocks)
        else:
            self._load_one(name, blocks.dequantize())

    def _load_one(self, name: str, w: torch.Tensor) -> None:
        if name == "model.embed_tokens.weight":
            if self.embed_tokens is None:
                self._fp32_head().copy_(w.t())
            else:
                self.embed_tokens.copy_(w)
        elif name == "lm_head.weight":
            if self.embed_tokens is not None:  # tied models ignore a duplicated head
                self._fp32_head().copy_(w.t())
        elif name == "model.norm.weight":
            self.norm.copy_(w)
        else:
            match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
            if match is None:
                raise KeyError(f"unexpected weight {name!r}")
            cast(LlamaDecoderLayer, self.layers[int(match[1])]).load_weight(match[2], w)
