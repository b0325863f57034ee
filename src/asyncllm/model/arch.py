"""`ModelArchConfig`: the facts of a Llama-family checkpoint, read from GGUF metadata or config.json."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncllm.model.layers.rotary import Llama3RopeScaling, rope_inv_freq


@dataclass(frozen=True)
class ModelArchConfig:
    """Architecture hyper-parameters (names follow HF `LlamaConfig`).

    Fields:
        architecture: "llama" (SmolLM2, Llama, Mistral) or "qwen2" (q/k/v biases).
        vocab_size: logits width.
        hidden_size: model width.
        intermediate_size: MLP width.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: K/V heads (GQA when fewer than query heads).
        head_dim: per-head width.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: rotary base frequency.
        max_position_embeddings: the model's context length, tokens.
        tie_word_embeddings: LM head shares the token embedding.
        bos_token_id, eos_token_id: special ids (None when absent).
        rope_scaling: Llama 3 frequency scaling (HF `rope_type: "llama3"`), None for plain RoPE.
        rope_freq_divisors: per-frequency divisors, [head_dim // 2] (a GGUF `rope_freqs` tensor, which
            llama.cpp's converter writes for Llama 3 scaling), None when absent.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    rope_scaling: Llama3RopeScaling | None = None
    rope_freq_divisors: tuple[float, ...] | None = None

    def rope_inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies, [head_dim // 2] float64, radians per token, with any scaling applied."""
        inv_freq = rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)
        if self.rope_freq_divisors is not None:
            inv_freq = inv_freq / torch.tensor(self.rope_freq_divisors, dtype=torch.float64)
        return inv_freq

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one KV cache block over all layers (float32 K and V)."""
        return self.num_hidden_layers * 2 * block_size * self.num_key_value_heads * self.head_dim * 4
