"""A checkpoint's architecture config from GGUF metadata (`read_gguf_config`): every key after `{arch}.` read into
`ModelArchConfig`, accepted only at its harmless value, or not math (the lists below, each with its reason), else a
`ConfigError` naming key and value (the policy is `arch_config.py`'s).

GGUF `gemma3` does not store its sliding pattern, local rotary base and softmax scale: llama.cpp fixes them
(`GGUF_GEMMA3_SLIDING_PATTERN`, ...). Llama 3 rope scaling comes as the `rope_freqs` tensor. Torch-free.

Sources: GGUF keys as llama.cpp's `gguf` package names them (`gguf.constants.Keys`); llama.cpp's
`src/llama-model.cpp` for what an architecture fixes.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

from asyncllm.errors import ConfigError
from asyncllm.model.arch import ModelArchConfig, gemma_layer_pattern
from asyncllm.model.loading.gguf_metadata import GGUFTensorInfo, read_gguf_header

# GGUF `general.architecture` values read (`model/registry.py`; GGUF gemma2: no file checked against it).
GGUF_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3", "phi3", "gemma3"})
# What a GGUF `gemma3` file does not store because llama.cpp fixes it for the architecture (llama.cpp
# src/llama-model.cpp, LLM_ARCH_GEMMA3 hyper-parameters; transformers' Gemma3TextConfig defaults agree, which is how
# it loads these files): every 6th layer global (full attention), the others sliding-window; the sliding layers'
# rotary base; the GeGLU activation; the softmax scale 1/sqrt(key_length) (all sizes but 27B, refused).
GGUF_GEMMA3_SLIDING_PATTERN = 6
GGUF_GEMMA3_LOCAL_ROPE_THETA = 10000.0

# GGUF keys after "{arch}." read into `ModelArchConfig` (or checked against it).
GGUF_READ_KEYS = frozenset(
    {
        "vocab_size",
        "context_length",
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.key_length",
        "attention.value_length",  # must equal key_length (head_dim)
        "attention.layer_norm_rms_epsilon",
        "attention.sliding_window",
        "rope.freq_base",
        "rope.dimension_count",  # head_dim, or Phi-3's partial rotary dims
        "rope.scaling.type",  # must be "none": Llama 3 scaling comes as the rope_freqs tensor
    }
)
# GGUF keys after "{arch}." accepted only at values that leave the math unchanged.
_GGUF_ONLY_AT: dict[str, tuple[Any, ...]] = {
    "rope.scaling.factor": (0.0, 1.0),  # llama.cpp reads 0 as 1
    "expert_count": (0,),  # a dense model
    "expert_used_count": (0,),
    "attention.causal": (True,),
}
# GGUF keys after "{arch}." that do not change the logits: they only parametrize a scaling type other than "none",
# which is refused.
GGUF_NO_MATH_ARCH_KEYS = frozenset({"rope.scaling.original_context_length", "rope.scaling.finetuned"})
# Whole GGUF namespaces that do not change the logits: file description (`general.alignment` is read by the header
# reader), the tokenizer (read by `tokenizer.py`), and how the weights were quantized (they are what they are).
GGUF_NO_MATH_PREFIXES = ("general.", "tokenizer.", "quantize.")
# A split GGUF: only a file that is the whole model is accepted.
_GGUF_SPLIT_ONLY_AT: dict[str, tuple[Any, ...]] = {"split.count": (1,), "split.no": (0,)}
_GGUF_SPLIT_NO_MATH = frozenset({"split.tensors.count"})


def read_gguf_config(
    path: pathlib.Path, header: tuple[dict[str, Any], list[GGUFTensorInfo]] | None = None
) -> ModelArchConfig:
    """Architecture hyper-parameters from a `.gguf` file's metadata (and its `rope_freqs` tensor); see
    `arch_config.read_arch_config` for the defaults the format defines. `header`: the file's header as
    `read_checked_gguf_header` gave it (a loader that also reads the tensors reads it once), else read here.

    Raises:
        ConfigError: not GGUF or a truncated header, a required key missing, or a key this model does not
            implement (named, with its value).
    """
    metadata, tensors = header if header is not None else read_checked_gguf_header(path)
    return _arch_from_gguf(metadata, tensors, path)


def read_checked_gguf_header(path: pathlib.Path) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    """`gguf_metadata.read_gguf_header`, its errors as `ConfigError`.

    Raises:
        ConfigError: not GGUF, or a truncated header.
    """
    try:
        return read_gguf_header(path)
    except ValueError as e:  # not GGUF, or a truncated header
        raise ConfigError(str(e) if str(path) in str(e) else f"{path}: {e}") from e


def check_gguf_keys(meta: dict[str, Any]) -> None:
    """Every GGUF metadata key is read, accepted at its harmless value, or not math; RoPE metadata is honoured.

    Raises:
        ConfigError: an unsupported architecture, or a key this model does not implement (named, with its value).
    """
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"GGUF general.architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    for key, value in meta.items():
        if key.startswith(GGUF_NO_MATH_PREFIXES) or key in _GGUF_SPLIT_NO_MATH:
            continue
        if key in _GGUF_SPLIT_ONLY_AT:
            if value not in _GGUF_SPLIT_ONLY_AT[key]:
                raise ConfigError(f"GGUF {key}={value!r}: a split GGUF file is not supported (only the whole model)")
            continue
        name = key.removeprefix(f"{arch}.")
        if name == key:
            raise ConfigError(
                f"GGUF metadata key {key}={_short(value)} is not read by asyncllm (it may change the math)"
            )
        if name in GGUF_READ_KEYS or name in GGUF_NO_MATH_ARCH_KEYS:
            continue
        if name in _GGUF_ONLY_AT:
            if value not in _GGUF_ONLY_AT[name]:
                raise ConfigError(f"GGUF {key}={value!r} is not supported (only {list(_GGUF_ONLY_AT[name])})")
            continue
        raise ConfigError(f"GGUF metadata key {key}={_short(value)} is not read by asyncllm (it may change the math)")
    hidden, heads = meta.get(f"{arch}.embedding_length"), meta.get(f"{arch}.attention.head_count")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
        value_length = meta.get(f"{arch}.attention.value_length", head_dim)
        if value_length != head_dim:
            raise ConfigError(f"GGUF {arch}.attention.value_length={value_length} != key_length {head_dim}")
        _check_gguf_rope(meta, arch, head_dim)


def _arch_from_gguf(meta: dict[str, Any], tensors: list[GGUFTensorInfo], path: pathlib.Path) -> ModelArchConfig:
    check_gguf_keys(meta)
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    rotary_dim = get("rope.dimension_count", head_dim)  # checked by check_gguf_keys
    longrope = sorted(t.name for t in tensors if t.name.startswith("rope_factors_"))
    if longrope:
        raise ConfigError(f"GGUF tensors {longrope}: LongRoPE is not supported")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    if not vocab:
        raise ConfigError(f"GGUF metadata lacks {arch}.vocab_size and tokenizer.ggml.tokens")
    gemma: dict[str, Any] = {}
    if arch == "gemma3":
        gemma = _gguf_gemma3_fixed(get("block_count"), hidden, heads, head_dim, get("attention.sliding_window"))
    return ModelArchConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),  # llama.cpp's default when the key is absent
        max_position_embeddings=get("context_length"),
        tie_word_embeddings=all(t.name != "output.weight" for t in tensors),  # no LM head: tied to token_embd
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        rope_freq_divisors=_read_rope_freqs(tensors, path, head_dim),
        sliding_window=meta.get(f"{arch}.attention.sliding_window"),
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        **gemma,
    )


def _gguf_gemma3_fixed(layers: int, hidden: int, heads: int, head_dim: int, window: int) -> dict[str, Any]:
    """The `ModelArchConfig` fields llama.cpp fixes for GGUF `gemma3` (see `GGUF_GEMMA3_SLIDING_PATTERN`).

    Raises:
        ConfigError: the 27B geometry (5376 wide, 32 heads), whose softmax scale llama.cpp sets apart.
    """
    if (hidden, heads) == (5376, 32):
        raise ConfigError("GGUF gemma3 27B (embedding 5376, 32 heads) scales attention by hidden/heads: unsupported")
    pattern = GGUF_GEMMA3_SLIDING_PATTERN
    return {
        "layer_types": gemma_layer_pattern(layers, pattern),
        "rope_local_theta": GGUF_GEMMA3_LOCAL_ROPE_THETA,
        "query_pre_attn_scalar": float(head_dim),
        "hidden_act": "gelu_pytorch_tanh",
    }


def _check_gguf_rope(meta: dict[str, Any], arch: str, head_dim: int) -> None:
    """Reject GGUF RoPE metadata this model cannot honour (ggml docs: `rope.scaling.type`, `rope.dimension_count`).

    Llama 3 scaling is stored by llama.cpp's converter as a `rope_freqs` tensor (read by `_read_rope_freqs`), with
    no scaling type; linear/YaRN scaling types are rejected, and partial rotary dimensions outside Phi-3.
    """
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none":
        raise ConfigError(f"GGUF {arch}.rope.scaling.type {scaling_type!r} is not supported (only 'none')")
    dims = meta.get(f"{arch}.rope.dimension_count", head_dim)
    partial_ok = arch == "phi3" and isinstance(dims, int) and 0 < dims < head_dim and dims % 2 == 0
    if dims != head_dim and not partial_ok:
        raise ConfigError(f"GGUF {arch}.rope.dimension_count {dims} != head_dim {head_dim}: partial RoPE unsupported")


def _read_rope_freqs(tensors: list[GGUFTensorInfo], path: pathlib.Path, head_dim: int) -> tuple[float, ...] | None:
    """The float32 `rope_freqs.weight` tensor ([head_dim // 2] per-frequency divisors) if the file has one."""
    info = next((t for t in tensors if t.name == "rope_freqs.weight"), None)
    if info is None:
        return None
    if info.ggml_type != 0 or info.shape != (head_dim // 2,):  # 0: GGML_TYPE_F32
        raise ConfigError(
            f"GGUF rope_freqs.weight: type {info.ggml_type}, shape {info.shape}; need F32 [{head_dim // 2}]"
        )
    data = np.fromfile(path, dtype="<f4", count=head_dim // 2, offset=info.offset)
    return tuple(float(x) for x in data)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
