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
    # Mistral: a sliding window on every layer, shorter than the test sequences (a 12-token prompt + 32 decodes), GQA,
    # untied.
    "mistral": (
        "MistralConfig",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_window": 8,
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
    # Phi-4-mini: as Phi-3, tied, with LongRoPE (long factors from position 64 on, of a 128-token context).
    "phi4mini": (
        "Phi3Config",
        {
            "hidden_size": 96,
            "intermediate_size": 160,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 64,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + 0.05 * i for i in range(12)],
                "long_factor": [1.0 + 0.3 * i for i in range(12)],
            },
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}
ARCHITECTURES = {"phi4mini": "phi3", "mistral": "llama"}  # family -> asyncllm's architecture name, where they differ


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


def write_family_checkpoint(family: str, path: pathlib.Path, seed: int = 0, tokenizer: bool = False) -> Any:
    """Write `family`'s HF directory (config.json + model.safetensors; with `tokenizer` also a word-level
    tokenizer, so an engine can serve it) to `path`; returns HF's model."""
    model = hf_family_model(family, seed)
    model.save_pretrained(path)
    if tokenizer:
        write_word_tokenizer(path, model.config.vocab_size, model.config.to_dict())
    return model


def write_word_tokenizer(path: pathlib.Path, vocab_size: int, config: dict[str, Any]) -> None:
    """A word-level tokenizer.json of `vocab_size` words ("w0", "w1", ...; whitespace-separated, unknown words are
    "w0") and a tokenizer_config.json naming BOS/EOS/padding (the padding token: the config's, else EOS, else
    "w0")."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    names = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        if isinstance(value, int) and value < vocab_size:
            names[key.removesuffix("_id")] = f"w{value}"
    names.setdefault("pad_token", names.get("eos_token", "w0"))  # HF's batched generate pads the prompts
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20, **names})
    )


def _llama_cpp_permute(weight: Any, num_heads: int) -> Any:
    """llama.cpp's converter's Q/K row permutation for its interleaved rotary (`LlamaModel.permute`)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _llama3_rope_factors(config: Any, head_dim: int) -> Any:
    """The `rope_freqs` tensor llama.cpp's converter writes for llama3 rope scaling: per frequency, the divisor."""
    import numpy as np

    rope = config.rope_parameters
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi / (1.0 / base ** (i / head_dim))
        if wavelength < old / high:
            factors.append(1.0)
        elif wavelength > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_family_gguf(family: str, model: Any, path: pathlib.Path) -> pathlib.Path:
    """Write HF's `model` of `family` as a float32 GGUF file with `gguf`'s writer, llama.cpp's tensor names
    (`gguf.TensorNameMap`) and metadata keys, Q/K rows permuted for "llama" (Mistral's GGUF architecture too) as
    llama.cpp's converter does."""
    import gguf

    config = model.config
    arch_name = ARCHITECTURES.get(family, family)
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}
    arch |= {"mistral": gguf.MODEL_ARCH.LLAMA}
    arch |= {"phi3": gguf.MODEL_ARCH.PHI3, "phi4mini": gguf.MODEL_ARCH.PHI3}
    names = gguf.TensorNameMap(arch[family], config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = gguf.GGUFWriter(str(path), arch_name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "sliding_window", None) is not None and family == "mistral":
        writer.add_sliding_window(config.sliding_window)
    if family == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch_name == "phi3":
        writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
    if config.rope_parameters.get("rope_type") == "longrope":  # as llama.cpp's Phi-3 converter writes LongRoPE
        import numpy as np

        original = config.rope_parameters["original_max_position_embeddings"]
        factor = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(original)))
        writer.add_rope_scaling_orig_ctx_len(original)
        for kind in ("long", "short"):
            factors = np.array(config.rope_parameters[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if family == "llama":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(config, head_dim))
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy()
        if arch_name == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            array = _llama_cpp_permute(array, heads if "q_proj" in hf_name else kv_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(f"gguf.TensorNameMap has no name for {hf_name}")
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
