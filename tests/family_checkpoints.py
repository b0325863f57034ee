"""Test helper: small random-weight checkpoints of each supported family, written by HF `transformers`' own class for
that family (so the reference is HF's implementation), with the family's real shape features and few layers."""

from __future__ import annotations

import math
import pathlib
from typing import Any

import torch

COMMON: dict[str, Any] = {"vocab_size": 160, "num_hidden_layers": 2, "max_position_embeddings": 128}
# family -> (transformers config class, its keys). Each keeps what makes the family itself:
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 3.2: tied embeddings, GQA, llama3 rope scaling.
    "llama": (
        "LlamaConfig",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # Qwen2.5: q/k/v biases, theta 1e6, tied, a sliding window configured but not used (as published).
    "qwen2": (
        "Qwen2Config",
        {
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "use_sliding_window": False,
            "sliding_window": 32,
            "max_window_layers": 1,
        },
    ),
    # Qwen3: per-head q/k RMSNorm, head_dim 32 != hidden / heads = 16, no biases, theta 1e6, tied.
    "qwen3": (
        "Qwen3Config",
        {
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "attention_bias": False,
        },
    ),
    # Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, partial rotary 0.75 (24 of 32 dims), GQA, untied.
    "phi3": (
        "Phi3Config",
        {
            "hidden_size": 96,
            "intermediate_size": 160,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 128,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}


def hf_family_model(family: str, seed: int = 0) -> Any:
    """HF's model of `family` at the sizes above, float32, eval, with random weights that make a sharp language
    model: matrices N(0, 1/fan_in), norm weights 1 + N(0, 0.2), biases N(0, 0.5)."""
    import transformers

    class_name, keys = FAMILIES[family]
    config = getattr(transformers, class_name)(**COMMON, **keys)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 1 / math.sqrt(param.shape[1]), generator=generator)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5, generator=generator)
            else:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=generator))
    return model


def write_family_checkpoint(family: str, path: pathlib.Path, seed: int = 0) -> Any:
    """Write `family`'s HF directory (config.json + model.safetensors) to `path`; returns HF's model."""
    model = hf_family_model(family, seed)
    model.save_pretrained(path)
    return model
