"""RoPE settings from both HF config generations and GGUF: Llama 3 scaling against transformers, clear errors."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from asyncllm.errors import ConfigError
from asyncllm.model.arch import Llama3RopeScaling, ModelArchConfig
from asyncllm.model.layers.rotary import arch_inv_freq, rope_inv_freq
from asyncllm.model.loading.arch_config import read_arch_config
from asyncllm.model.loading.gguf_config import _check_gguf_rope
from asyncllm.model.loading.hf_config import read_hf_rope

transformers = pytest.importorskip("transformers")

LLAMA31 = {  # Llama 3.1 8B's published rope settings
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
LLAMA32 = {**LLAMA31, "factor": 32.0}  # Llama 3.2 1B/3B


def _transformers_llama3_inv_freq(theta: float, head_dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    """transformers' own llama3 inverse frequencies for a LlamaConfig with these settings."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    heads = 4
    config = transformers.LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        max_position_embeddings=131072,
        rope_theta=theta,
        rope_scaling=dict(scaling),
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    return inv_freq.to(torch.float64)


@pytest.mark.parametrize("scaling", [LLAMA31, LLAMA32], ids=["llama3.1", "llama3.2"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_llama3_inv_freq_matches_transformers(scaling: dict[str, Any], head_dim: int) -> None:
    theta = 500000.0
    _, ours_scaling = read_hf_rope({"rope_parameters": {"rope_theta": theta, **scaling}})
    assert ours_scaling is not None
    ours = rope_inv_freq(head_dim, theta, ours_scaling)
    expected = _transformers_llama3_inv_freq(theta, head_dim, scaling)
    plain = rope_inv_freq(head_dim, theta)
    assert not torch.allclose(ours, plain)  # the scaling changes something, so the comparison below means something
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0.0)  # transformers works in float32


def test_both_config_generations_read_the_same_rope() -> None:
    current = {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    older = {"rope_theta": 100000.0, "rope_scaling": None}
    assert read_hf_rope(current) == read_hf_rope(older) == (100000.0, None)
    older_llama3 = {"rope_theta": 500000.0, "rope_scaling": {**LLAMA31, "rope_type": None, "type": "llama3"}}
    assert read_hf_rope(older_llama3) == (500000.0, Llama3RopeScaling(8.0, 1.0, 4.0, 8192))


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            {"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}},
            "rope_parameters.rope_type 'yarn'",
        ),
        ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type 'linear'"),
        ({"rope_theta": 1e4, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
        ({"rope_parameters": {"rope_type": "default"}}, "no rope_theta"),
        ({}, "no rope_theta"),
        ({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5}}, "disagree"),
        ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}, "lacks"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
        ({"rope_theta": 1e4, "rope_scaling": {"type": "default", "factor": 2.0}}, "rope_scaling.factor=2.0"),
    ],
)
def test_unreadable_rope_settings_raise(cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        read_hf_rope(cfg)


def _tiny_config(**extra: Any) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
        **extra,
    }


@pytest.mark.parametrize("missing", ["rms_norm_eps", "max_position_embeddings", "vocab_size", "model_type"])
def test_missing_required_hf_key_raises(tmp_path: pathlib.Path, missing: str) -> None:
    cfg = _tiny_config(rope_theta=1e4)
    del cfg[missing]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=missing):
        read_arch_config(tmp_path)


def test_hf_llama3_config_reaches_the_arch(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_tiny_config(rope_parameters={"rope_theta": 5e5, **LLAMA31})))
    arch = read_arch_config(tmp_path)
    assert arch.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    torch.testing.assert_close(arch_inv_freq(arch), rope_inv_freq(16, 5e5, arch.rope_scaling))


def test_gguf_rope_freq_divisors_divide_the_frequencies() -> None:
    base: dict[str, Any] = dict(
        architecture="llama",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=8,
        tie_word_embeddings=True,
    )
    plain = arch_inv_freq(ModelArchConfig(**base))
    divided = arch_inv_freq(ModelArchConfig(**base, rope_freq_divisors=(1.0, 2.0, 4.0, 8.0)))
    torch.testing.assert_close(divided, plain / torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64))


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "rope.scaling.type 'yarn'"),
        ({"llama.rope.scaling.type": "linear"}, "rope.scaling.type 'linear'"),
        ({"llama.rope.dimension_count": 32}, "partial RoPE"),
    ],
)
def test_gguf_rope_that_cannot_be_honoured_raises(meta: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _check_gguf_rope(meta, "llama", 64)
    _check_gguf_rope({"llama.rope.scaling.type": "none", "llama.rope.dimension_count": 64}, "llama", 64)
