"""Every config.json key and GGUF metadata key is read, on the documented no-math list, or refused with a
`ConfigError` naming it, before any engine process starts (issue 28). The two silent wrong answers that started
it (a GELU checkpoint run with SiLU; a Mistral window ignored) are the first tests."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import pytest
from safetensors.numpy import save_file

from asyncllm.async_llm import AsyncLLM
from asyncllm.config import EngineArgs, ModelConfig
from asyncllm.errors import ConfigError
from asyncllm.model.loading.arch_config import check_max_model_len, read_arch_config
from asyncllm.model.loading.gguf_config import GGUF_READ_KEYS, check_gguf_keys
from asyncllm.model.loading.gguf_metadata import read_gguf_metadata
from asyncllm.model.loading.hf_config import HF_MODEL_TYPES, HF_NO_MATH_KEYS, hf_read_keys
from asyncllm.model.loading.loader import load_model

SIZES: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rope_theta": 1e4, **SIZES}


def _hf_dir(path: pathlib.Path, cfg: dict[str, Any]) -> pathlib.Path:
    """An HF directory `EngineArgs` resolves: config.json, a (never read: dummy weights) safetensors file and a
    word-level tokenizer.json of the config's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    import numpy as np

    save_file({"unused": np.zeros(1, dtype=np.float32)}, str(path / "model.safetensors"))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(SIZES["vocab_size"])}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def _start_up(path: pathlib.Path, **args: Any) -> Any:
    """What the frontend checks before any process starts."""
    return EngineArgs(model=str(path), load_format="dummy", **args).create_engine_config()


def test_gelu_activation_is_refused_not_run_as_silu(tmp_path: pathlib.Path) -> None:
    path = _hf_dir(tmp_path, {**TINY_LLAMA, "hidden_act": "gelu_pytorch_tanh"})
    with pytest.raises(ConfigError, match=r"hidden_act.*'gelu_pytorch_tanh'"):
        read_arch_config(path)
    with pytest.raises(ConfigError, match="hidden_act"):
        _start_up(path)
    assert read_arch_config(_hf_dir(tmp_path / "silu", {**TINY_LLAMA, "hidden_act": "silu"})).hidden_size == 32


def test_mistral_sliding_window_is_applied_not_refused(tmp_path: pathlib.Path) -> None:
    """The first silent wrong answer of issue 28 (a Mistral window ignored): the window is now applied on every
    layer (HF parity over sequences longer than it: `tests/unit/test_families.py`, family "mistral")."""
    path = _hf_dir(tmp_path, {**TINY_LLAMA, "model_type": "mistral", "sliding_window": 16})
    assert _start_up(path).model.max_model_len is None
    model = load_model(ModelConfig(model="m", model_path=str(path), load_format="dummy"))
    assert [layer.window for layer in model.layers] == [16, 16]
    assert read_arch_config(path).sliding_window == 16


@pytest.mark.parametrize("window", [None, 128, 4096])
def test_a_window_covering_the_context_is_accepted(tmp_path: pathlib.Path, window: int | None) -> None:
    path = _hf_dir(tmp_path, {**TINY_LLAMA, "model_type": "mistral", "sliding_window": window})
    _start_up(path)
    load_model(ModelConfig(model="m", model_path=str(path), load_format="dummy"))


def test_qwen2_sliding_window_counts_only_when_used(tmp_path: pathlib.Path) -> None:
    qwen2 = {**TINY_LLAMA, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "sliding_window": 16}
    off = _hf_dir(tmp_path / "off", {**qwen2, "use_sliding_window": False, "max_window_layers": 0})
    assert read_arch_config(off).sliding_window is None
    _start_up(off)
    on = _hf_dir(tmp_path / "on", {**qwen2, "use_sliding_window": True, "max_window_layers": 1})
    with pytest.raises(ConfigError, match=r"sliding_window.*16"):
        _start_up(on)
    # Windowed layers start at max_window_layers: with 2 layers, 2 means none is windowed.
    none_windowed = _hf_dir(tmp_path / "none", {**qwen2, "use_sliding_window": True, "max_window_layers": 2})
    assert read_arch_config(none_windowed).sliding_window is None
    # `layer_types`, when given, says which layers are windowed (still only with use_sliding_window, as HF).
    mixed = {**qwen2, "layer_types": ["full_attention", "sliding_attention"], "max_window_layers": 2}
    with pytest.raises(ConfigError, match=r"sliding_window.*16"):
        _start_up(_hf_dir(tmp_path / "types", {**mixed, "use_sliding_window": True}))
    assert read_arch_config(_hf_dir(tmp_path / "types_off", mixed)).sliding_window is None
    with pytest.raises(ConfigError, match="layer_types"):
        read_arch_config(_hf_dir(tmp_path / "types_bad", {**mixed, "layer_types": ["full_attention"]}))


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
async def test_unsupported_rope_is_a_config_error_before_any_process(
    tmp_path: pathlib.Path, engine_process: bool
) -> None:
    """Not `EngineDeadError` from a failed engine start: the frontend reads the config first (and no engine process
    starts: the test is not marked `mp`, so conftest fails it if one does)."""
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32}
    cfg = {k: v for k, v in TINY_LLAMA.items() if k != "rope_theta"}
    path = _hf_dir(tmp_path, {**cfg, "rope_parameters": rope})
    args = EngineArgs(model=str(path), load_format="dummy", engine_process=engine_process)
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        AsyncLLM.from_engine_args(args)
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        await AsyncLLM.create(args)


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_a_tensor_parallel_size_the_heads_do_not_allow_fails_before_any_process(
    tmp_path: pathlib.Path, engine_process: bool
) -> None:
    """TINY_LLAMA has 2 query heads and 1 K/V head: TP=2 is refused in the frontend with the sizes that work (the
    `mp` workers would have refused it only after starting)."""
    args = EngineArgs(
        model=str(_hf_dir(tmp_path, TINY_LLAMA)),
        load_format="dummy",
        engine_process=engine_process,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 does not divide .*num_key_value_heads.*\[1\]"):
        AsyncLLM.from_engine_args(args)


def _changed(value: Any) -> Any:
    """A different value of the same JSON kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 0.5
    if isinstance(value, str):
        return value + "_other"
    if isinstance(value, list):
        return [*value, value[-1] if value else 1]
    if isinstance(value, dict):
        return {**value, "other": 1}
    return 1  # None


FAMILIES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "mistral": "MistralConfig",
    "qwen3": "Qwen3Config",
    "phi3": "Phi3Config",
    "gemma2": "Gemma2Config",
    "gemma3_text": "Gemma3TextConfig",
}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_key_of_the_hf_config_class_is_read_listed_or_refused(model_type: str, tmp_path: pathlib.Path) -> None:
    """transformers' full config (every key it knows, at its defaults) loads; changing any key asyncllm neither
    reads nor lists as not changing the math fails with a ConfigError naming it."""
    transformers = pytest.importorskip("transformers")
    assert model_type in HF_MODEL_TYPES
    sizes = {k: v for k, v in SIZES.items() if k != "tie_word_embeddings"}
    full = json.loads(getattr(transformers, FAMILIES[model_type])(**sizes).to_json_string(use_diff=False))
    full["architectures"] = [FAMILIES[model_type].replace("Config", "ForCausalLM")]
    path = _hf_dir(tmp_path / "full", full)
    arch = read_arch_config(path)
    assert (arch.hidden_size, arch.num_hidden_layers, arch.max_position_embeddings) == (32, 2, 128)
    read = hf_read_keys(model_type)
    refused = []
    for i, (key, value) in enumerate(sorted(full.items())):
        if key in HF_NO_MATH_KEYS:  # any value loads
            assert read_arch_config(_hf_dir(tmp_path / str(i), {**full, key: _changed(value)})) == arch, key
            continue
        if key in read:
            continue
        path = _hf_dir(tmp_path / str(i), {**full, key: _changed(value)})
        with pytest.raises(ConfigError, match=key):
            read_arch_config(path)
        refused.append(key)
    if model_type == "llama":
        assert {"hidden_act", "attention_bias", "mlp_bias", "pretraining_tp"} <= set(refused)
    unknown = _hf_dir(tmp_path / "unknown", {**full, "logit_softcapping": 30.0})
    with pytest.raises(ConfigError, match=r"logit_softcapping.*30.0"):
        read_arch_config(unknown)


def test_smollm2_config_json_as_published_loads(tmp_path: pathlib.Path) -> None:
    """The keys HuggingFaceTB/SmolLM2-135M-Instruct's config.json has (nanotron's export markers included)."""
    cfg = {
        **TINY_LLAMA,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "initializer_range": 0.041666666666666664,
        "is_llama_config": True,
        "mlp_bias": False,
        "pad_token_id": 2,
        "pretraining_tp": 1,
        "rope_interleaved": False,
        "rope_scaling": None,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.42.3",
        "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
        "use_cache": True,
    }
    assert read_arch_config(_hf_dir(tmp_path, cfg)).eos_token_id == 2
    with pytest.raises(ConfigError, match="rope_interleaved"):
        read_arch_config(_hf_dir(tmp_path / "interleaved", {**cfg, "rope_interleaved": True}))


def test_auto_map_names_remote_code_asyncllm_never_runs(tmp_path: pathlib.Path) -> None:
    """Phi-4-mini's config.json as published has `auto_map` (its own modeling_phi3.py); the math is model_type's."""
    auto_map = {"AutoConfig": "configuration_phi3.Phi3Config", "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}
    assert read_arch_config(_hf_dir(tmp_path, {**TINY_LLAMA, "auto_map": auto_map})).architecture == "llama"


def test_a_head_other_than_causal_lm_is_refused(tmp_path: pathlib.Path) -> None:
    path = _hf_dir(tmp_path, {**TINY_LLAMA, "architectures": ["LlamaForSequenceClassification"]})
    with pytest.raises(ConfigError, match=r"architectures.*LlamaForSequenceClassification"):
        read_arch_config(path)


def test_every_metadata_key_of_the_default_gguf_is_read_or_not_math(model_path: str) -> None:
    meta = read_gguf_metadata(model_path)
    check_gguf_keys(meta)
    arch_keys = {k.removeprefix("llama.") for k in meta if k.startswith("llama.")}
    assert arch_keys <= GGUF_READ_KEYS


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("llama.attention.layer_norm_epsilon", 1e-5),  # LayerNorm, not RMSNorm
        ("llama.expert_count", 8),
        ("llama.rope.scaling.factor", 4.0),
        ("llama.attention.value_length", 32),
        ("llama.logit_scale", 0.5),
        ("split.count", 2),
        ("unknown.key", 1),
    ],
)
def test_gguf_keys_that_change_the_math_are_refused(model_path: str, key: str, value: Any) -> None:
    meta = read_gguf_metadata(model_path)
    with pytest.raises(ConfigError, match=f"{key}.*{value}"):
        check_gguf_keys({**meta, key: value})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("llama.expert_count", 0),
        ("llama.rope.scaling.factor", 1.0),
        ("llama.attention.value_length", 64),
        ("split.count", 1),
        ("general.url", "https://example.org"),
        ("tokenizer.ggml.cls_token_id", 5),
    ],
)
def test_gguf_keys_at_their_harmless_value_are_accepted(model_path: str, key: str, value: Any) -> None:
    check_gguf_keys({**read_gguf_metadata(model_path), key: value})


def test_gguf_sliding_window_is_read_and_applied_or_checked_like_config_json(model_path: str) -> None:
    check_gguf_keys({**read_gguf_metadata(model_path), "llama.attention.sliding_window": 16})  # read, not refused
    arch = dataclasses.replace(read_arch_config(model_path), sliding_window=16)
    check_max_model_len(arch, None)  # "llama" (Mistral's GGUF architecture too) applies it
    assert arch.layer_window(0) == 16
    qwen2 = dataclasses.replace(arch, architecture="qwen2")  # no window applied: refused unless it covers all
    assert qwen2.layer_window(0) is None
    with pytest.raises(ConfigError, match=r"sliding_window.*16.*max_model_len 8192"):
        check_max_model_len(qwen2, None)
    check_max_model_len(qwen2, 16)
