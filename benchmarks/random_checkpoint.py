"""Write a random-weight HF checkpoint with a published model's shapes, for `throughput.py --model DIR` (issue 28).

HF `transformers`' own class for the family builds the model from the published config.json's hyper-parameters
(optionally with fewer layers), draws its weights (matrices N(0, 1/fan_in), norm weights 1 + N(0, 0.1), biases
N(0, 0.1)), and saves it as safetensors in bfloat16 (half the file; asyncllm and the HF reference both compute in
float32 from the same rounded values). The tokenizer is word-level over `vocab_size` words ("w0", "w1", ...): each
whitespace-separated word of a prompt is one token (unknown words map to "w0"), so prompt lengths match a real
tokenizer's roughly, while the vocabulary (and so the LM head) has the model's real size.

    .venv/bin/python benchmarks/random_checkpoint.py qwen3-0.6b /tmp/qwen3-0.6b-random [--layers N]

Presets (published config.json values): qwen3-0.6b, qwen2.5-0.5b, llama-3.2-1b, phi-4-mini (LongRoPE: prompts of
at most 4096 tokens, its original context), and `tiny-<family>` (the tests' shapes, for a smoke run).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from typing import Any

import torch

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": (
        "Qwen3Config",
        {
            "vocab_size": 151936,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
        },
    ),
    "qwen2.5-0.5b": (
        "Qwen2Config",
        {
            "vocab_size": 151936,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
        },
    ),
    "llama-3.2-1b": (
        "LlamaConfig",
        {
            "vocab_size": 128256,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "rope_theta": 500000.0,
            "bos_token_id": 128000,
            "eos_token_id": 128009,
        },
    ),
    "phi-4-mini": (
        "Phi3Config",
        {
            "vocab_size": 200064,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "partial_rotary_factor": 0.75,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            # LongRoPE with neutral short factors (the published ones are 48 measured values; the benchmark times
            # the same computation either way).
            "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48},
            "sliding_window": 262144,
            "pad_token_id": 199999,
            "bos_token_id": 199999,
            "eos_token_id": 199999,
        },
    ),
}


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests.family_checkpoints import COMMON, FAMILIES, write_word_tokenizer  # noqa: E402


def _tiny_presets() -> dict[str, tuple[str, dict[str, Any]]]:
    return {f"tiny-{family}": (cls, {**COMMON, **keys}) for family, (cls, keys) in FAMILIES.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    presets = {**PRESETS, **_tiny_presets()}
    parser.add_argument("preset", choices=sorted(presets))
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import transformers

    class_name, keys = presets[args.preset]
    keys = {**keys, **({"num_hidden_layers": args.layers} if args.layers else {})}
    config = getattr(transformers, class_name)(**keys)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 1 / math.sqrt(param.shape[1]), generator=generator)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1, generator=generator)
            else:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    write_word_tokenizer(args.out, config.vocab_size, keys)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {args.preset}, {config.num_hidden_layers} layers, {params / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main()
