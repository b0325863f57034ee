"""Gemma 3 decoder (text only; e.g. Gemma 3 270M), and Gemma 2, for CPU inference in float32.

Differences from the Llama family (`model/llama.py`), whose LM head, embedding, weight conversion (fp32 packing,
int8 with SmoothQuant) and tensor-parallel sharding it reuses:
- the token embedding is scaled by sqrt(hidden_size);
- four RMSNorms per block: before and after attention, before and after the MLP (the "after" ones normalize the
  sublayer's output before the residual add), and an RMSNorm over each query and key head before the rotary
  embedding; every norm multiplies by `(1 + w)` (stored here as that sum, so SmoothQuant can fold into it);
- GeGLU MLP: gelu (tanh approximation) of the gate times up;
- softmax scale `query_pre_attn_scalar ** -0.5`;
- local layers attend within a sliding window (`layers/attention.py`) and use their own rotary base; global layers
  attend to the whole sequence. Which layer is which comes from `ModelArchConfig.layer_types`.
Gemma 2 (`arch.architecture == "gemma2"`) is the same block without the q/k norms, with one rotary base, and with
soft-capped attention scores and final logits (`c * tanh(x / c)`; HF config only: GGUF gemma2 is refused).

GGUF files written by llama.cpp's converter store every norm weight as `1 + w`; `hf_tensor_from_gguf` maps the
names to HF's and subtracts the 1, as transformers' GGUF loader does, so both checkpoints load through the HF
convention. Q/K rows are not permuted for this architecture.

Sources: Gemma 3 technical report (Gemma Team, 2025): interleaved local/global attention, QK-norm, the norms; Gemma 2
technical report (Gemma Team, 2024): logit soft-capping, alternating local/global layers; GeGLU
(Shazeer, 2020); RMSNorm (Zhang & Sennrich, 2019); RoPE (Su et al., 2021) in HF's "rotate half" layout.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.distributed.parallel_state import all_reduce, get_tp_rank, get_tp_size
from asyncllm.distributed.tp_sizes import check_tp_divides
from asyncllm.model.arch import ModelArchConfig
from asyncllm.model.kernels.linear import Weight, linear
from asyncllm.model.kernels.rotary import apply_rotary
from asyncllm.model.kernels.row_kernels import RowKernels, load_kernels
from asyncllm.model.layers.attention import decode_reads_cache, paged_attention, write_kv_cache
from asyncllm.model.layers.attention_metadata import AttentionMetadata
from asyncllm.model.layers.rotary import rope_inv_freq, rotary_cos_sin
from asyncllm.model.llama import LlamaForCausalLM, rms_norm
from asyncllm.model.llama_weights import LayerWeights, empty_param

if TYPE_CHECKING:
    from asyncllm.lora.weights import LoRABatch

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N."), llama.cpp's Gemma 3 names.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",  # on the attention output, before the residual add
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# HF layer norm name -> parameter (all hold `1 + w`).
_LAYER_NORMS = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "attn_out_norm",
    "pre_feedforward_layernorm.weight": "post_attention_norm",
    "post_feedforward_layernorm.weight": "mlp_out_norm",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}


class Gemma3DecoderLayer(LayerWeights):
    """One Gemma 3 block with fused `[in, out]` weights, holding this TP rank's shard.

    Norm parameters (each holds `1 + w` of HF's weight `w`): `input_norm` (HF `input_layernorm`), `attn_out_norm`
    (`post_attention_layernorm`, on the attention output), `post_attention_norm` (`pre_feedforward_layernorm`: the
    norm feeding the MLP, named as `LayerWeights` expects for SmoothQuant), `mlp_out_norm`
    (`post_feedforward_layernorm`), `q_norm` / `k_norm` ([head_dim], per head; Gemma 3 only, None for Gemma 2).

    Args:
        arch: the model's hyper-parameters.
        layer_index: this layer's index (its window and rotary base come from `arch.layer_types`).
        tp_rank, tp_size: this rank's shard.
        attention_kernels: the compiled kernels for the K/V writes and the decode attention read straight from the
            paged cache (`layers/attention.decode_reads_cache`), or None for torch ops; the rest of the block is
            torch ops.
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        layer_index: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        attention_kernels: RowKernels | None = None,
    ) -> None:
        super().__init__(arch, tp_rank, tp_size)
        self.attention_kernels = attention_kernels
        self.window = arch.layer_window(layer_index)
        self.local_rope = arch.layer_types is not None and arch.layer_types[layer_index] == "sliding_attention"
        h, d = arch.hidden_size, arch.head_dim
        self.scale = (arch.query_pre_attn_scalar or d) ** -0.5
        self.attn_out_norm = empty_param(h)
        self.mlp_out_norm = empty_param(h)
        self.q_norm = empty_param(d) if arch.architecture == "gemma3" else None
        self.k_norm = empty_param(d) if arch.architecture == "gemma3" else None
        self.softcap = arch.attn_logit_softcapping

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """[num_tokens, hidden_size] -> [num_tokens, hidden_size]; writes this step's K/V into `kv_cache`.

        `cos`/`sin`: [num_tokens, 1, head_dim] tables of this layer's rotary base at the tokens' positions."""
        eps = self.arch.rms_norm_eps
        attn = self._attention(rms_norm(hidden, self.input_norm, eps), cos, sin, kv_cache, meta)
        hidden = hidden + rms_norm(attn, self.attn_out_norm, eps)
        mlp = self._mlp(rms_norm(hidden, self.post_attention_norm, eps))
        return hidden + rms_norm(mlp, self.mlp_out_norm, eps)

    def _attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n, d, eps = x.shape[0], self.arch.head_dim, self.arch.rms_norm_eps
        qkv = linear(x, self.qkv_proj)
        q = qkv[:, : self.q_size].view(n, -1, d)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(n, -1, d)
        v = qkv[:, self.q_size + self.kv_size :].view(n, -1, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        kernels = self.attention_kernels
        write_kv_cache(kv_cache, k, v, meta.slot_mapping, meta.slot_blocks, kernels)
        attn = paged_attention(q, kv_cache, meta, self.scale, (k, v), kernels, window=self.window, softcap=self.softcap)
        return all_reduce(linear(attn, self.o_proj))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return all_reduce(linear(F.gelu(gate, approximate="tanh") * up, self.down_proj))

    def load_weight(self, name: str, w: torch.Tensor) -> None:
        """Place one HF layer tensor (name after `model.layers.N.`): norms as `1 + w`, linear weights as
        `LayerWeights.load_weight` does.

        Raises:
            KeyError: a tensor this layer does not have.
        """
        norm = getattr(self, _LAYER_NORMS[name]) if name in _LAYER_NORMS else None
        if norm is not None:
            norm.copy_(1.0 + w)
        else:
            super().load_weight(name, w)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Decoder-only Gemma 3 (or Gemma 2: `arch.architecture`) language model (text), tied or untied LM head.

    Same interface as `LlamaForCausalLM` (forward, compute_logits, pack_fp32, quantize_int8, load_weights); LoRA is
    not supported.

    Attributes:
        arch: the architecture config it was built from (`hidden_act` must be "gelu_pytorch_tanh").
    """

    rope_local_cos: torch.Tensor  # the sliding layers' tables (their own rotary base), as rope_cos / rope_sin
    rope_local_sin: torch.Tensor

    def __init__(self, arch: ModelArchConfig) -> None:
        nn.Module.__init__(self)
        if arch.hidden_act != "gelu_pytorch_tanh" or arch.architecture not in ("gemma2", "gemma3"):
            raise ValueError(f"not a Gemma 2/3 config: {arch.architecture!r} with hidden_act {arch.hidden_act!r}")
        self.arch = arch
        tp_rank, tp_size = get_tp_rank(), get_tp_size()
        check_tp_divides(arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size, tp_size)
        self.fused_kernels = None  # torch ops: the fused row kernels implement Llama's block
        kernels = load_kernels()  # only for the K/V writes and decode attention (no soft-capping in the kernel)
        self.decode_reads_cache = arch.attn_logit_softcapping is None and decode_reads_cache(kernels, arch.head_dim)
        attention_kernels = kernels if self.decode_reads_cache else None
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(arch, i, tp_rank, tp_size, attention_kernels) for i in range(arch.num_hidden_layers)
        )
        self.norm = empty_param(arch.hidden_size)
        self.lm_head: Weight = empty_param(arch.hidden_size, arch.vocab_size)
        self.embed_tokens: nn.Parameter | None = (
            None if arch.tie_word_embeddings else empty_param(arch.vocab_size, arch.hidden_size)
        )
        self.embed_scale = float(torch.tensor(arch.hidden_size**0.5, dtype=torch.float32))
        for prefix, theta in (("rope", arch.rope_theta), ("rope_local", arch.rope_local_theta or arch.rope_theta)):
            cos, sin = rotary_cos_sin(rope_inv_freq(arch.head_dim, theta), arch.max_position_embeddings)
            self.register_buffer(f"{prefix}_cos", cos, persistent=False)
            self.register_buffer(f"{prefix}_sin", sin, persistent=False)

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
        """Run every layer over a flat batch of tokens; arguments and result as `LlamaForCausalLM.forward`
        (`embeds_override` values replace the scaled token embeddings, as HF's `inputs_embeds`).

        Raises:
            ValueError: `lora` is given (not supported for Gemma 3).
        """
        if lora is not None:
            raise ValueError("LoRA adapters are not supported for Gemma 3")
        hidden = self.embed(input_ids).mul_(self.embed_scale)
        if embeds_override is not None:
            rows, values = embeds_override
            hidden[rows] = values
        tables = {
            False: (self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)),
            True: (self.rope_local_cos[positions].unsqueeze(1), self.rope_local_sin[positions].unsqueeze(1)),
        }
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos, sin = tables[cast(Gemma3DecoderLayer, layer).local_rope]
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return rms_norm(hidden, self.norm, self.arch.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_sampled, hidden_size] -> [num_sampled, vocab_size] float32 logits (soft-capped for Gemma 2)."""
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits.div_(cap)).mul_(cap)

    def _load_one(self, name: str, w: torch.Tensor) -> None:
        if name == "model.norm.weight":
            self.norm.copy_(1.0 + w)
            return
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if match is not None:
            cast(Gemma3DecoderLayer, self.layers[int(match[1])]).load_weight(match[2], w)
            return
        super()._load_one(name, w)

    @staticmethod
    def hf_tensor_from_gguf(gguf_name: str, weight: torch.Tensor) -> tuple[str, torch.Tensor]:
        """A GGUF `gemma3` tensor as HF's (name, tensor): llama.cpp's names mapped, and the `+ 1` its converter
        adds to every norm weight taken off again.

        Raises:
            KeyError: a tensor name Gemma 3 does not have.
        """
        stem, _, kind = gguf_name.rpartition(".")
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
        if match and match[2] in GGUF_LAYER_NAMES:
            name = f"model.layers.{match[1]}.{GGUF_LAYER_NAMES[match[2]]}.{kind}"
        elif stem in GGUF_TOP_NAMES:
            name = f"{GGUF_TOP_NAMES[stem]}.{kind}"
        else:
            raise KeyError(f"unexpected GGUF tensor {gguf_name!r} for gemma3")
        return name, (weight - 1.0 if stem.endswith("norm") else weight)
