"""A checkpoint's architecture config from an HF directory's config.json (`read_hf_config`): every key read into
`ModelArchConfig`, accepted only at the one value the model implements, or on `HF_NO_MATH_KEYS` (each with its
reason), else a `ConfigError` naming key and value (the policy is `arch_config.py`'s).

Both generations of transformers' files: `rope_parameters` (5) or top-level `rope_theta` + `rope_scaling` (4).
Gemma: `gemma3_text` and `gemma2` (per-layer-type RoPE, `layer_types` or the sliding pattern,
`query_pre_attn_scalar`, soft-capping for Gemma 2). Torch-free.

Sources: HF `LlamaConfig`, `MistralConfig`, `Qwen2Config`, `Qwen3Config`, `Phi3Config`, `Gemma2Config`,
`Gemma3TextConfig` (transformers 5: `layer_types`, `rope_parameters`).
"""

from __future__ import annotations

import json
import math
import pathlib
import struct
from typing import Any

from asyncllm.errors import ConfigError
from asyncllm.model.arch import Llama3RopeScaling, LongRopeScaling, ModelArchConfig, gemma_layer_pattern

# HF config.json `model_type` -> architecture name (`model/registry.py`).
HF_MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}
_HF_READ_COMMON = frozenset(
    {
        "model_type",
        "architectures",  # must name a ...ForCausalLM (the LM head this model has)
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    }
)
# Keys read only for some families: how HF's modeling code for that family applies a sliding window.
_HF_READ_FAMILY: dict[str, frozenset[str]] = {
    "llama": frozenset(),
    "mistral": frozenset({"sliding_window"}),
    "qwen2": frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}),
    "qwen3": frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}),
    # Phi-3: a window on every layer; partial rotary (top-level in older files, else in rope_parameters); the
    # original context, which parametrizes only LongRoPE (`read_hf_rope`).
    "phi3": frozenset({"sliding_window", "partial_rotary_factor", "original_max_position_embeddings"}),
    # Gemma 3: windowed layers from `layer_types`, else from the pattern (transformers 4 wrote
    # `sliding_window_pattern`, 5 writes `_sliding_window_pattern` beside `layer_types`); per-layer-type RoPE.
    "gemma3_text": frozenset(
        {
            "sliding_window",
            "layer_types",
            "sliding_window_pattern",
            "_sliding_window_pattern",
            "rope_local_base_freq",
            "query_pre_attn_scalar",
        }
    ),
    # Gemma 2: alternating windowed layers (`layer_types`, else every other layer from the first), soft-capping.
    "gemma2": frozenset(
        {
            "sliding_window",
            "layer_types",
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
        }
    ),
}
# Keys accepted only at the one value this model implements; any other value changes the math.
_HF_ONLY_AT_COMMON: dict[str, Any] = {
    "hidden_act": "silu",  # the MLP's activation: SiLU(gate) * up
    "is_encoder_decoder": False,
    "rope_interleaved": False,  # nanotron's export flag (SmolLM2): rotary in HF's "rotate half" layout
}
_HF_ONLY_AT_FAMILY: dict[str, dict[str, Any]] = {
    "llama": {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
    "mistral": {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
    "qwen2": {},  # q/k/v biases always (read from the checkpoint), no others
    "qwen3": {"attention_bias": False},
    # Phi-4-mini's config.json carries full_attn_mod and interpolate_factor at 1 (for its own modeling code); HF's
    # Phi-3 class, the implementation asyncllm is checked against, does not read them: other values are refused.
    "phi3": {
        "attention_bias": False,
        "mlp_bias": False,
        "lm_head_bias": False,
        "full_attn_mod": 1,
        "interpolate_factor": 1,
    },
    "gemma2": {
        "hidden_activation": "gelu_pytorch_tanh",  # GeGLU
        "hidden_act": "gelu_pytorch_tanh",  # transformers 4's second name for it (HF's Gemma 2 reads the first)
        "attention_bias": False,
        "use_bidirectional_attention": None,
    },
    "gemma3_text": {
        "hidden_activation": "gelu_pytorch_tanh",  # GeGLU
        "hidden_act": "gelu_pytorch_tanh",
        "attention_bias": False,
        "attn_logit_softcapping": None,  # Gemma 2's soft-capping: not in Gemma 3
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,  # EmbeddingGemma's encoder mode
    },
}
# Keys that do not change the logits, whatever their value.
HF_NO_MATH_KEYS = frozenset(
    {
        # Provenance and bookkeeping.
        "transformers_version",
        "_name_or_path",
        "is_llama_config",  # nanotron's export marker (SmolLM2)
        "transformers.js_config",  # transformers.js's own settings (SmolLM2)
        # Storage dtype: weights are read as stored and computed in float32 (or requantized to int8).
        "torch_dtype",
        "dtype",
        # What HF's forward returns or caches, not the values it computes.
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        # Training only: weight initialization, and dropout (inactive at inference).
        "initializer_range",
        "attention_dropout",
        "resid_pdrop",  # Phi-3
        "embd_pdrop",  # Phi-3
        # The padding token: asyncllm never pads a sequence with tokens.
        "pad_token_id",
        # Which KV cache class HF's generate() builds (Gemma 2's "hybrid"): not the values attention computes.
        "cache_implementation",
        # Classification heads only (`architectures` must name a ...ForCausalLM).
        "id2label",
        "label2id",
        "problem_type",
        # HF's chunked feed-forward computes the same values in pieces (and HF's Llama does not use it).
        "chunk_size_feed_forward",
        # The checkpoint's own modeling code, for `trust_remote_code` (Phi-4-mini names its copy of Phi3): asyncllm
        # never runs it and computes `model_type`'s math, as HF `transformers` does for a model type it knows
        # without `trust_remote_code`, and as vLLM does.
        "auto_map",
    }
)

SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_ROPE_KEYS = {"default": frozenset({"rope_theta", "rope_type", "type"})}
_ROPE_KEYS["llama3"] = _ROPE_KEYS["default"] | frozenset(_LLAMA3_ROPE_KEYS)
_LONGROPE_KEYS = ("short_factor", "long_factor", "factor", "attention_factor", "original_max_position_embeddings")
_ROPE_KEYS["longrope"] = _ROPE_KEYS["default"] | frozenset(_LONGROPE_KEYS)


def hf_read_keys(model_type: str) -> frozenset[str]:
    """The config.json keys `read_arch_config` reads for an HF `model_type` (any value accepted if well-formed)."""
    return _HF_READ_COMMON | _HF_READ_FAMILY.get(model_type, frozenset())


def read_hf_config(path: pathlib.Path) -> ModelArchConfig:
    """Architecture hyper-parameters from `path/config.json`; `tie_word_embeddings`, when absent, from the
    safetensors headers (tied exactly when no `lm_head.weight` is stored). See `arch_config.read_arch_config`.

    Raises:
        ConfigError: not a JSON object, a required key missing, or a key this model does not implement (named,
            with its value).
    """
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path / 'config.json'}: not JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path / 'config.json'}: not a JSON object")
    if "tie_word_embeddings" not in cfg:
        cfg["tie_word_embeddings"] = "lm_head.weight" not in _safetensors_names(path)
    return _arch_from_hf(cfg)


def _arch_from_hf(cfg: dict[str, Any]) -> ModelArchConfig:
    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ConfigError(f"config.json lacks required key {key!r}")
        return cfg[key]

    model_type = need("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ConfigError(f"unsupported model_type {model_type!r}; supported: {sorted(HF_MODEL_TYPES)}")
    _check_hf_keys(cfg, model_type)
    _check_layer_types(cfg)
    heads = need("num_attention_heads")
    gemma: dict[str, Any] = {}
    if model_type == "gemma3_text":
        rope_theta, local_theta = _gemma3_hf_rope(cfg)
        rope_scaling = None
        scalar = need("query_pre_attn_scalar")
        gemma = {
            "layer_types": _gemma_layer_types(cfg, default_pattern=6),
            "rope_local_theta": local_theta,
            "query_pre_attn_scalar": float(scalar),
            "hidden_act": "gelu_pytorch_tanh",
        }
    else:
        rope_theta, rope_scaling = read_hf_rope(cfg, phi3=model_type == "phi3")
    if model_type == "gemma2":
        if rope_scaling is not None:
            raise ConfigError("config.json: Gemma 2 with rope scaling is not supported")
        gemma = {
            "layer_types": _gemma_layer_types(cfg, default_pattern=2),
            "query_pre_attn_scalar": float(need("query_pre_attn_scalar")),
            "hidden_act": "gelu_pytorch_tanh",
            "attn_logit_softcapping": _optional_positive(cfg, "attn_logit_softcapping"),
            "final_logit_softcapping": _optional_positive(cfg, "final_logit_softcapping"),
        }
    head_dim = cfg.get("head_dim") or need("hidden_size") // heads
    rotary_dim = _hf_rotary_dim(cfg, head_dim) if model_type == "phi3" else None
    if isinstance(rope_scaling, LongRopeScaling) and len(rope_scaling.short_factor) != (rotary_dim or head_dim) // 2:
        raise ConfigError(
            f"config.json: LongRoPE short_factor and long_factor have {len(rope_scaling.short_factor)} values; the "
            f"model rotates {rotary_dim or head_dim} dims of each head, so needs {(rotary_dim or head_dim) // 2}"
        )
    eos = cfg.get("eos_token_id")
    return ModelArchConfig(
        architecture=HF_MODEL_TYPES[model_type],
        vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"),
        intermediate_size=need("intermediate_size"),
        num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(need("rms_norm_eps")),
        rope_theta=rope_theta,
        max_position_embeddings=need("max_position_embeddings"),
        tie_word_embeddings=bool(need("tie_word_embeddings")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        rope_scaling=rope_scaling,
        sliding_window=_hf_sliding_window(cfg, model_type),
        rotary_dim=rotary_dim,
        **gemma,
    )


def _hf_rotary_dim(cfg: dict[str, Any], head_dim: int) -> int | None:
    """Phi-3's rotated dims per head, `int(head_dim * partial_rotary_factor)` as HF's Phi-3 rotary computes them
    (the factor top-level or in `rope_parameters`); None for the whole head.

    Raises:
        ConfigError: the two places disagree, or the factor gives no even width in (0, head_dim].
    """
    params = cfg.get("rope_parameters") or {}
    factors = {
        float(v) for v in (cfg.get("partial_rotary_factor"), params.get("partial_rotary_factor")) if v is not None
    }
    if len(factors) > 1:
        raise ConfigError(f"config.json: partial_rotary_factor values disagree: {sorted(factors)}")
    factor = factors.pop() if factors else 1.0
    dim = int(head_dim * factor)
    if not 0 < dim <= head_dim or dim % 2:
        raise ConfigError(f"config.json partial_rotary_factor={factor}: {dim} rotated dims of {head_dim} is not even")
    return None if dim == head_dim else dim


def _optional_positive(cfg: dict[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"config.json {key}={value!r}: must be null or a number > 0")
    return float(value)


def _gemma_layer_types(cfg: dict[str, Any], default_pattern: int) -> tuple[str, ...]:
    """Gemma's per-layer attention kinds: `layer_types`, else from the sliding-window pattern (Gemma 3: 6, Gemma 2:
    2), as HF's `Gemma3TextConfig` / `Gemma2Config` derive them."""
    types = cfg.get("layer_types")
    if types is not None:
        return tuple(types)
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", default_pattern))
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ConfigError(f"config.json sliding_window_pattern={pattern!r}: must be an integer >= 1")
    return gemma_layer_pattern(cfg["num_hidden_layers"], pattern)


def _gemma3_hf_rope(cfg: dict[str, Any]) -> tuple[float, float]:
    """(global, local) rotary bases of a Gemma 3 config: transformers 5's `rope_parameters` keyed by layer type, or
    transformers 4's `rope_theta` + `rope_local_base_freq` (+ `rope_scaling`); defaults 1e6 and 1e4 (HF's).

    Raises:
        ConfigError: a rope type other than "default" (e.g. the linear scaling of Gemma 3 4B and up), or an
            unknown key.
    """
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if params is None:
        if scaling is not None:
            raise ConfigError(f"config.json rope_scaling={_short(scaling)} is not supported for Gemma 3 (only null)")
        return float(cfg.get("rope_theta", 1e6)), float(cfg.get("rope_local_base_freq", 1e4))
    if not isinstance(params, dict) or set(params) - {"full_attention", "sliding_attention"}:
        raise ConfigError(f"config.json rope_parameters={_short(params)}: need full_attention/sliding_attention")
    thetas = []
    for kind, default in (("full_attention", 1e6), ("sliding_attention", 1e4)):
        entry = params.get(kind) or {}
        rope_type = entry.get("rope_type", "default")
        extra = set(entry) - {"rope_theta", "rope_type"}
        if rope_type != "default" or extra or scaling is not None:
            raise ConfigError(
                f"config.json rope_parameters.{kind}={_short(entry)} is not supported (only rope_type 'default')"
            )
        thetas.append(float(entry.get("rope_theta", default)))
    for key, value in (("rope_theta", thetas[0]), ("rope_local_base_freq", thetas[1])):
        if key in cfg and float(cfg[key]) != value:
            raise ConfigError(f"config.json {key}={cfg[key]!r} disagrees with rope_parameters ({value})")
    return thetas[0], thetas[1]


def _check_hf_keys(cfg: dict[str, Any], model_type: str) -> None:
    """Every key is read, accepted at its one implemented value, or not math; else a ConfigError naming it."""
    read = hf_read_keys(model_type)
    only_at = {**_HF_ONLY_AT_COMMON, **_HF_ONLY_AT_FAMILY[model_type]}
    for key, value in cfg.items():
        if key in read or key in HF_NO_MATH_KEYS:
            continue
        if key in only_at:
            if value != only_at[key] or type(value) is not type(only_at[key]):
                raise ConfigError(
                    f"config.json {key}={value!r} is not supported (only {only_at[key]!r}): it would change the math"
                )
            continue
        raise ConfigError(
            f"config.json key {key}={_short(value)} is not read by asyncllm for model_type {model_type!r} "
            "(it may change the math)"
        )
    architectures = cfg.get("architectures")
    if architectures is not None and (
        not isinstance(architectures, list)
        or not all(isinstance(a, str) and a.endswith("ForCausalLM") for a in architectures)
    ):
        raise ConfigError(f"config.json architectures={architectures!r}: only ...ForCausalLM models are supported")


def _hf_sliding_window(cfg: dict[str, Any], model_type: str) -> int | None:
    """The attention window of the windowed layers, or None when no layer has one, as HF's modeling applies it.

    Mistral, Phi-3: `sliding_window` on every layer (null: none). Qwen2, Qwen3: only with `use_sliding_window`, on
    the layers `layer_types` marks "sliding_attention", or when that is absent on layers from `max_window_layers` on.
    """
    if model_type == "llama":
        return None
    window = cfg.get("sliding_window")
    pattern = {"gemma3_text": 6, "gemma2": 2}.get(model_type)
    if pattern is not None and window is not None and "sliding_attention" not in _gemma_layer_types(cfg, pattern):
        return None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"config.json sliding_window={window!r}: must be null or an integer >= 1")
    if model_type in ("mistral", "phi3", "gemma3_text", "gemma2") or window is None:  # every layer (or per type)
        return window
    use = cfg.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise ConfigError(f"config.json use_sliding_window={use!r}: must be true or false")
    if not use:
        return None
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", layers)
        return window if isinstance(first, int) and first < layers else None
    return window if "sliding_attention" in types else None


def _check_layer_types(cfg: dict[str, Any]) -> None:
    types = cfg.get("layer_types")
    if types is None:
        return
    allowed = ("full_attention", "sliding_attention")
    if (
        not isinstance(types, list)
        or len(types) != cfg.get("num_hidden_layers")
        or any(t not in allowed for t in types)
    ):
        raise ConfigError(
            f"config.json layer_types={_short(types)}: must list {allowed} once per layer "
            f"({cfg.get('num_hidden_layers')} layers)"
        )


def read_hf_rope(cfg: dict[str, Any], phi3: bool = False) -> tuple[float, Llama3RopeScaling | LongRopeScaling | None]:
    """Rotary base and scaling from an HF config.json, in either generation.

    Current transformers writes `"rope_parameters": {"rope_theta": ..., "rope_type": ..., ...}` and no top-level
    `rope_theta`; older versions write a top-level `rope_theta` and an optional `rope_scaling` dict (whose type key
    is `rope_type`, or `type` in the oldest files).

    With `phi3`, a `partial_rotary_factor` key is allowed (read by `_hf_rotary_dim`), and so is the rope type
    "longrope" (or its old name "su"), as HF's Phi-3 applies it: the short and long factors (`arch.LongRopeScaling`
    says which positions take which) and the attention factor.

    Returns:
        (rope_theta, the Llama 3 or LongRoPE scaling, or None for plain RoPE).
    Raises:
        ConfigError: no rotary base in either place, the two places disagree, a `rope_type` other than
            "default"/"llama3" (and Phi-3's "longrope"), a parameter of the type missing or malformed, or a key the
            rope type does not have (e.g. `partial_rotary_factor` outside Phi-3).
    """
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"config.json: rope_parameters/rope_scaling must be objects, got {params!r}, {scaling!r}")
    thetas = {float(v) for v in (cfg.get("rope_theta"), params.get("rope_theta")) if v is not None}
    if not thetas:
        raise ConfigError("config.json has no rope_theta (neither top-level nor in rope_parameters)")
    if len(thetas) > 1:
        raise ConfigError(f"config.json: rope_theta and rope_parameters.rope_theta disagree: {sorted(thetas)}")
    merged = {**scaling, **params}
    key = "rope_parameters" if params else "rope_scaling"
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if phi3 and rope_type == "su":  # LongRoPE's first name (HF's Phi3Config renames it)
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES + (("longrope",) if phi3 else ()):
        raise ConfigError(
            f"config.json: {key}.rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    allowed = _ROPE_KEYS[rope_type] | ({"partial_rotary_factor"} if phi3 else set())
    for name, value in merged.items():
        if name not in allowed and value is not None:
            raise ConfigError(f"config.json {key}.{name}={value!r} is not read for rope_type {rope_type!r}")
    if rope_type == "default":
        return thetas.pop(), None
    if rope_type == "longrope":
        return thetas.pop(), _longrope(cfg, merged, key)
    missing = [n for n in _LLAMA3_ROPE_KEYS if merged.get(n) is None]
    if missing:
        raise ConfigError(f"config.json: {key} with rope_type 'llama3' lacks {missing}")
    return thetas.pop(), Llama3RopeScaling(
        factor=float(merged["factor"]),
        low_freq_factor=float(merged["low_freq_factor"]),
        high_freq_factor=float(merged["high_freq_factor"]),
        original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
    )


def _longrope(cfg: dict[str, Any], merged: dict[str, Any], key: str) -> LongRopeScaling:
    """LongRoPE as HF's `_compute_longrope_parameters` computes it: the short and long factors, and `factor` (default
    `max_position_embeddings / original_max_position_embeddings`) giving the attention factor
    `sqrt(1 + ln(factor) / ln(original))` (1 when factor <= 1) unless `attention_factor` is given."""
    short, long = merged.get("short_factor"), merged.get("long_factor")
    original = merged.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not isinstance(short, list) or not isinstance(long, list) or len(short) != len(long) or not short:
        raise ConfigError(f"config.json: {key} with rope_type 'longrope' needs short_factor and long_factor lists")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ConfigError(f"config.json: LongRoPE needs original_max_position_embeddings, got {original!r}")
    factor = merged.get("factor") or cfg["max_position_embeddings"] / original
    attention = merged.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRopeScaling(
        short_factor=tuple(float(f) for f in short),
        original_max_position_embeddings=original,
        attention_factor=float(attention),
        long_factor=tuple(float(f) for f in long),
    )


def _safetensors_names(path: pathlib.Path) -> set[str]:
    """Tensor names stored in an HF directory's *.safetensors files, from their headers (safetensors format: a
    little-endian uint64 header length, then the JSON header; torch-free)."""
    names: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            names.update(k for k in json.loads(f.read(length)) if k != "__metadata__")
    return names


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
