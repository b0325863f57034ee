"""A checkpoint's architecture config (`read_arch_config`): GGUF metadata or an HF config.json, every key read, on
a short list of keys that do not change the math, or refused with a `ConfigError` naming it; and the check of the
resulting `ModelArchConfig` against the engine's `max_model_len` (`check_max_model_len`).

Torch-free, so the frontend reads and checks the config before any engine process starts (`EngineArgs.
create_engine_config`); the worker reads it again when it builds the model (`loader.load_model`). The readers are
`hf_config.py` (config.json) and `gguf_config.py` (GGUF metadata); this module picks one by the path.

Both readers hold every key to the same policy. A key is one of:
- read: it sets a field of `ModelArchConfig` (or is checked against one, as GGUF `rope.dimension_count`);
- accepted only at the one value the model implements (`hf_config._HF_ONLY_AT_COMMON` / `_HF_ONLY_AT_FAMILY`,
  `gguf_config._GGUF_ONLY_AT`: `hidden_act` "silu", `attention_bias` false, ...), refused at any other;
- on the no-math lists (`hf_config.HF_NO_MATH_KEYS`, `gguf_config.GGUF_NO_MATH_PREFIXES`,
  `gguf_config.GGUF_NO_MATH_ARCH_KEYS`), each with its reason;
- anything else: refused. A sliding attention window is read; for an architecture whose model does not apply it
  (not in `WINDOWED_ARCHITECTURES`) it is accepted only when it covers every sequence (`check_max_model_len`).
"""

from __future__ import annotations

import pathlib
from typing import Any

from asyncllm.errors import ConfigError
from asyncllm.model.arch import WINDOWED_ARCHITECTURES, LongRopeScaling, ModelArchConfig
from asyncllm.model.loading.gguf_config import read_gguf_config
from asyncllm.model.loading.gguf_metadata import GGUFTensorInfo
from asyncllm.model.loading.hf_config import read_hf_config


def read_arch_config(
    model_path: str | pathlib.Path, gguf_header: tuple[dict[str, Any], list[GGUFTensorInfo]] | None = None
) -> ModelArchConfig:
    """Architecture hyper-parameters from a `.gguf` file's metadata or an HF directory's config.json.

    A hyper-parameter the checkpoint lacks is an error unless the format itself defines its value (GGUF spec:
    `head_count_kv` = `head_count`, `key_length` = `embedding_length / head_count`; llama.cpp: `rope.freq_base`
    = 10000; HF `LlamaConfig`/`Qwen2Config`: `num_key_value_heads` = `num_attention_heads`, `head_dim` =
    `hidden_size / num_attention_heads`). HF `tie_word_embeddings`, when absent, is read from the checkpoint:
    tied exactly when no `lm_head.weight` is stored. Every other key is checked as the module docstring says.
    `gguf_header`: a `.gguf` file's header already read (`gguf_config.read_checked_gguf_header`), not read again.

    Raises:
        ConfigError: the path is neither, a required key is missing, a key this model does not implement (named,
            with its value), or a RoPE variant that cannot be honoured.
    """
    path = pathlib.Path(model_path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return read_gguf_config(path, gguf_header)
    if (path / "config.json").is_file():
        return read_hf_config(path)
    raise ConfigError(f"{model_path}: not a .gguf file or a directory with config.json")


def check_max_model_len(arch: ModelArchConfig, max_model_len: int | None) -> None:
    """Refuse a sliding attention window that a sequence of `max_model_len` tokens could outgrow, for an architecture
    whose model does not apply the window (not in `WINDOWED_ARCHITECTURES`).

    Such a model attends to the whole sequence. With a window of `w` tokens (a query sees itself and the `w - 1`
    tokens before it, as HF's `sliding_window_overlay`), that is the same math while no sequence is longer than
    `w`. `max_model_len` None means the model's context length, as the worker resolves it.

    Raises:
        ConfigError: naming the window and the sequence length it does not cover.
    """
    context = arch.max_position_embeddings
    length = min(max_model_len or context, context)
    if arch.architecture in WINDOWED_ARCHITECTURES:
        return
    if arch.sliding_window is not None and arch.sliding_window < length:
        raise ConfigError(
            f"sliding_window={arch.sliding_window} < max_model_len {length}: asyncllm applies sliding windows only "
            f"for {sorted(WINDOWED_ARCHITECTURES)}, not {arch.architecture!r}, so tokens beyond the window would "
            "attend to more than the model was trained to; "
            f"set EngineArgs.max_model_len <= {arch.sliding_window}"
        )


def max_prompt_len(arch: ModelArchConfig) -> int | None:
    """The longest prompt, tokens, this checkpoint computes as HF does, when that is shorter than its context: a
    LongRoPE checkpoint's `original_max_position_embeddings` (HF rotates a longer prompt with the long factors from
    its first position, asyncllm by position alone: `arch.LongRopeScaling`); None: only `max_model_len` limits it.
    `EngineArgs.create_engine_config` puts it in `ModelConfig.max_prompt_len`, which the frontend enforces."""
    if isinstance(arch.rope_scaling, LongRopeScaling):
        return arch.rope_scaling.original_max_position_embeddings
    return None
