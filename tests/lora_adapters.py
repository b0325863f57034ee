"""Test helpers: write a random PEFT LoRA adapter (safetensors + json, no `peft` needed) and merge one into a
model's weights (W' = W + scale * B @ A), the reference the per-row LoRA path is compared with."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch
from safetensors.torch import save_file

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PREFIX = "base_model.model.model.layers"


def module_path(module: str) -> str:
    return f"self_attn.{module}" if module in ATTENTION else f"mlp.{module}"


def write_peft_adapter(
    directory: pathlib.Path,
    arch: Any,
    rank: int = 8,
    alpha: float = 16.0,
    modules: tuple[str, ...] = ATTENTION + MLP,
    seed: int = 0,
    std: float = 0.05,
    config_overrides: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Write `adapter_config.json` and `adapter_model.safetensors` (PEFT layout) of a random rank-`rank` adapter on
    every layer's `modules`; A and B ~ N(0, std) (float32), so it clearly changes the model's outputs. Returns the
    tensors by their file key."""
    from asyncllm.lora.peft import model_module_shapes

    shapes = model_module_shapes(
        arch.hidden_size, arch.intermediate_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    )
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for module in modules:
            in_features, out_features = shapes[module_path(module)]
            key = f"{PREFIX}.{layer}.{module_path(module)}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(modules),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "rank_pattern": {},
        "alpha_pattern": {},
        **(config_overrides or {}),
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return tensors


@torch.no_grad()
def merge_adapter(model: Any, tensors: dict[str, torch.Tensor], scale: float) -> None:
    """Add scale * B @ A of every adapted module into a TP=1 `LlamaForCausalLM`'s fused [in, out] weights, in
    place. The column ranges follow the layout documented in model/llama.py (q | k | v, gate | up)."""
    arch = model.arch
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    inter = arch.intermediate_size
    columns = {
        "self_attn.q_proj": ("qkv_proj", 0, q),
        "self_attn.k_proj": ("qkv_proj", q, q + kv),
        "self_attn.v_proj": ("qkv_proj", q + kv, q + 2 * kv),
        "self_attn.o_proj": ("o_proj", 0, arch.hidden_size),
        "mlp.gate_proj": ("gate_up_proj", 0, inter),
        "mlp.up_proj": ("gate_up_proj", inter, 2 * inter),
        "mlp.down_proj": ("down_proj", 0, arch.hidden_size),
    }
    for key, lora_a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        layer_index, path = key[len(PREFIX) + 1 : -len(".lora_A.weight")].split(".", 1)
        lora_b = tensors[key.replace("lora_A", "lora_B")]
        param, start, end = columns[path]
        weight = getattr(model.layers[int(layer_index)], param)
        weight[:, start:end] += (scale * lora_b.float() @ lora_a.float()).t()
