"""`ModelArchConfig`: the facts of a Llama-family checkpoint, read from GGUF metadata or config.json."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3 RoPE frequency scaling (`rope_type: "llama3"`; applied by `layers/rotary.py`).

    Fields:
        factor: divisor of the low frequencies (e.g. 8.0 for Llama 3.1, 32.0 for Llama 3.2).
        low_freq_factor, high_freq_factor: wavelength band edges, as fractions of the original context.
        original_max_position_embeddings: the context length the model was pre-trained with, tokens.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LongRopeScaling:
    """Phi-3's LongRoPE (`rope_type: "longrope"`; applied by `layers/rotary.py`): the rotary frequencies divided by
    the short factors at positions below `original_max_position_embeddings`, by the long factors from there on.

    HF's Phi-3 picks one set per forward call, by the call's largest position + 1 (short while it is at most the
    original context). Its `generate` prefills the prompt in one call, then decodes one token per call and
    recomputes nothing: a token at position p is rotated with the long factors iff p >= the original context, as
    here, for every prompt of at most `original_max_position_embeddings` tokens (the keys cached before the switch
    keep their short rotation in both). A longer prompt HF rotates with the long factors from its first token;
    asyncllm, whose rotation depends on the position alone (so chunked prefill, prefix caching and preemption see
    the same keys), refuses it (`ModelConfig.max_prompt_len`, from `loading/arch_config.max_prompt_len`).

    Fields:
        short_factor: per-frequency divisors below the original context, [rotary_dim // 2].
        long_factor: per-frequency divisors from the original context on, [rotary_dim // 2].
        original_max_position_embeddings: the pre-training context, tokens; where the long factors start.
        attention_factor: multiplies the cos and sin tables in both regimes (HF: `sqrt(1 + ln(factor) /
            ln(original context))`, factor = `max_position_embeddings / original_max_position_embeddings`, unless
            given).
    """

    short_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float
    long_factor: tuple[float, ...]


# Architectures whose models apply `ModelArchConfig.sliding_window` on their windowed layers (`layer_window`):
# Mistral (HF `mistral` maps to "llama") and Phi-3 on every layer, Gemma 2/3 on their local layers. For the others
# (Qwen2/Qwen3 with `use_sliding_window`) a window is accepted only when it covers every sequence
# (`loading/arch_config.check_max_model_len`), where applying it would change nothing.
WINDOWED_ARCHITECTURES = frozenset({"llama", "phi3", "gemma2", "gemma3"})


@dataclass(frozen=True)
class ModelArchConfig:
    """Architecture hyper-parameters (names follow HF `LlamaConfig`).

    Fields:
        architecture: "llama" (SmolLM2, Llama, Mistral), "qwen2" (q/k/v biases), "qwen3" (q/k norms), "phi3"
            (fused checkpoint modules): their weight layout is `layouts.LAYOUTS[architecture]`; "gemma2" or "gemma3"
            (`model/gemma3.py`).
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
        rope_scaling: Llama 3 frequency scaling (HF `rope_type: "llama3"`), Phi-3's LongRoPE (short and long
            factors), None for plain RoPE.
        rope_freq_divisors: per-frequency divisors, [head_dim // 2] (a GGUF `rope_freqs` tensor, which
            llama.cpp's converter writes for Llama 3 scaling), None when absent.
        sliding_window: the attention window of the checkpoint's windowed layers, tokens (a query sees itself and
            the `sliding_window - 1` tokens before it), None when no layer has one. Only the architectures in
            `WINDOWED_ARCHITECTURES` apply it; for the others
            `loading/arch_config.check_max_model_len` accepts a window only when it covers every sequence.
        layer_types: "sliding_attention" or "full_attention" per layer (HF `layer_types`), None when every layer
            is alike (windowed iff `sliding_window` is set).
        rope_local_theta: rotary base of the sliding-window layers (Gemma 3's `rope_local_base_freq`), None when
            they use `rope_theta`.
        query_pre_attn_scalar: the softmax scale is `query_pre_attn_scalar ** -0.5` (Gemma), None: `head_dim`.
        hidden_act: the MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma).
        attn_logit_softcapping: attention scores become `c * tanh(scores / c)` before the mask and softmax
            (Gemma 2), None: not capped.
        final_logit_softcapping: the logits become `c * tanh(logits / c)` (Gemma 2), None: not capped.
        rotary_dim: dims of each head that rotary rotates (the first ones; HF Phi-3's `partial_rotary_factor *
            head_dim`, GGUF `rope.dimension_count`), None for the whole head.

    Torch-free: the frontend reads it before any engine process starts.
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
    rope_scaling: Llama3RopeScaling | LongRopeScaling | None = None
    rope_freq_divisors: tuple[float, ...] | None = None
    sliding_window: int | None = None
    rotary_dim: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window the model applies on decoder layer `layer` (0-based), tokens, or None for full
        attention (also for an architecture not in `WINDOWED_ARCHITECTURES`, whose window covers every sequence)."""
        if self.sliding_window is None or self.architecture not in WINDOWED_ARCHITECTURES:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def kv_cache_bytes_per_block(self, block_size: int, itemsize: int = 4) -> int:
        """Bytes of one KV cache block over all layers: K and V of `itemsize` bytes per element (4: float32, the
        default; 2: bfloat16, `CacheConfig.cache_itemsize`)."""
        return self.num_hidden_layers * 2 * block_size * self.num_key_value_heads * self.head_dim * itemsize


def gemma_layer_pattern(layers: int, pattern: int) -> tuple[str, ...]:
    """Gemma's interleaving, as `ModelArchConfig.layer_types`: layer i is global ("full_attention") when
    (i + 1) % pattern == 0, else "sliding_attention" (HF's `Gemma3TextConfig` / `Gemma2Config`, llama.cpp's gemma3)."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers))
