"""`EngineArgs(quantization="auto")`, the default (`model/loading/quant_choice.py`): which checkpoint and
configuration get the file's blocks ("gguf") and which float32, the reason logged, and the explicit values that
override it. On the real default model's header (no weights loaded, no engine) and on tensor lists of the kinds
other files have."""

from __future__ import annotations

import pathlib

import pytest

from asyncllm import EngineArgs
from asyncllm.errors import ConfigError
from asyncllm.model.loading.gguf_config import read_checked_gguf_header
from asyncllm.model.loading.gguf_metadata import GGUFTensorInfo
from asyncllm.model.loading.quant_choice import choose_quantization, layer_linear_tensors


def test_the_default_is_auto_and_gives_the_default_models_q4_1_blocks(model_path: str) -> None:
    assert EngineArgs().quantization == "auto"
    model = EngineArgs(model=model_path).create_engine_config().model
    assert model.quantization == "gguf"
    assert model.quantization_reason.startswith("quantization='auto' -> 'gguf': ")
    assert "210 layer linear weights are already block-quantized (210 Q4_1): kept as they are" in (
        model.quantization_reason
    )
    assert "quantization=None or 'none' gives float32" in model.quantization_reason


@pytest.mark.parametrize("spelled", [None, "none"])
def test_none_spelled_either_way_gives_float32_without_a_reason(model_path: str, spelled: str | None) -> None:
    model = EngineArgs(model=model_path, quantization=spelled).create_engine_config().model  # type: ignore[arg-type]
    assert (model.quantization, model.quantization_reason) == (None, "")


@pytest.mark.parametrize("mode", ["gguf", "q8_0", "q4_0", "int8"])
def test_an_explicit_mode_is_kept_as_asked(model_path: str, mode: str) -> None:
    model = EngineArgs(model=model_path, quantization=mode).create_engine_config().model  # type: ignore[arg-type]
    assert (model.quantization, model.quantization_reason) == (mode, "")


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (
            {"tensor_parallel_size": 3, "distributed_executor_backend": "mp"},
            "block weights need tensor_parallel_size=1",
        ),
        ({"load_format": "dummy"}, "load_format='dummy' fills random float weights"),
    ],
)
def test_auto_falls_back_to_float32_where_blocks_cannot_run_and_says_why(
    model_path: str, overrides: dict[str, object], why: str
) -> None:
    model = EngineArgs(model=model_path, **overrides).create_engine_config().model  # type: ignore[arg-type]
    assert model.quantization is None
    assert model.quantization_reason.startswith("quantization='auto' -> float32 weights: ")
    assert why in model.quantization_reason


def test_an_explicit_block_mode_that_cannot_run_stays_an_error(model_path: str) -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1"):
        EngineArgs(
            model=model_path, quantization="gguf", tensor_parallel_size=3, distributed_executor_backend="mp"
        ).create_engine_config()


def test_lora_keeps_the_files_blocks(model_path: str) -> None:
    """Adapters add their delta to the block product (tests/integration/test_lora_peft.py checks it against peft)."""
    model = EngineArgs(model=model_path, enable_lora=True).create_engine_config().model
    assert model.quantization == "gguf"
    assert (
        EngineArgs(model=model_path, quantization="gguf", enable_lora=True).create_engine_config().model.quantization
        == "gguf"
    )


def test_an_unknown_spelling_is_refused_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match="must be 'auto', None or 'none'"):
        EngineArgs(quantization="float16").validate()  # type: ignore[arg-type]


def _tensors(layer_types: list[int]) -> list[GGUFTensorInfo]:
    """A file's tensor list: a Q8_0 token embedding, one F32 norm per layer, and the given 2-D layer weights."""
    infos = [GGUFTensorInfo("token_embd.weight", (64, 100), 8, 0)]
    for i, code in enumerate(layer_types):
        infos += [GGUFTensorInfo(f"blk.{i}.attn_norm.weight", (64,), 0, 0)]
        infos += [GGUFTensorInfo(f"blk.{i}.attn_q.weight", (64, 64), code, 0)]
    return infos


def _choose(tensors: list[GGUFTensorInfo] | None, **kw: object) -> tuple[str | None, str]:
    options = {"load_format": "auto", "tensor_parallel_size": 1, **kw}
    choice = choose_quantization(pathlib.Path("/m/model.gguf"), tensors, **options)  # type: ignore[arg-type]
    return choice.quantization, choice.reason


def test_float_layer_weights_and_hf_directories_run_in_float32() -> None:
    assert _choose(_tensors([0, 0]))[0] is None  # F32
    assert _choose(_tensors([1, 30]))[0] is None  # F16, BF16
    quantization, reason = _choose(_tensors([3, 1]))  # one Q4_1 and one F16 weight: not all blocks
    assert quantization is None
    assert "1 of the 2 layer linear weights of model.gguf are float (1 F16, 1 Q4_1)" in reason
    quantization, reason = _choose(None)
    assert quantization is None
    assert "model.gguf is not a GGUF file" in reason


def test_block_layer_weights_of_any_type_keep_blocks_naming_what_is_requantized() -> None:
    assert _choose(_tensors([2, 8])) == (
        "gguf",
        "quantization='auto' -> 'gguf': model.gguf's 2 layer linear weights are already block-quantized (1 Q4_0, "
        "1 Q8_0): kept as they are (quantization=None or 'none' gives float32 weights)",
    )
    quantization, reason = _choose(_tensors([12, 6, 14, 8]))  # Gemma 3 270M's Q4_K_M mix
    assert quantization == "gguf"
    assert "(1 Q4_K, 1 Q5_0, 1 Q6_K, 1 Q8_0): Q4_K / Q5_0 / Q6_K (no kernel of their own) requantized to Q8_0" in (
        reason
    )


def test_the_layer_linear_weights_are_the_2d_blk_tensors(model_path: str) -> None:
    _, tensors = read_checked_gguf_header(pathlib.Path(model_path))
    linear = layer_linear_tensors(tensors)
    assert len(linear) == 30 * 7  # q, k, v, o, gate, up, down in each of 30 layers
    assert {t.name.split(".")[2] for t in linear} == {
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    }
    assert {t.ggml_type for t in linear} == {3}  # Q4_1
