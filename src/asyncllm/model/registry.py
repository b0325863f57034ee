"""Architecture name -> model class.

Names are those of `ModelArchConfig.architecture` (GGUF `general.architecture`, or HF `model_type` mapped
through `loading/hf_config.HF_MODEL_TYPES`).
"""

from __future__ import annotations

from torch import nn

from asyncllm.model.gemma3 import Gemma3ForCausalLM
from asyncllm.model.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "gemma2": Gemma3ForCausalLM,  # the same block without q/k norms, with soft-capping (`model/gemma3.py`)
    "gemma3": Gemma3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class for an architecture name.

    Raises:
        ValueError: the architecture is not supported (lists the supported ones).
    """
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(MODEL_CLASSES)}") from None
