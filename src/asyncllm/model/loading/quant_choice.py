"""`EngineArgs(quantization="auto")`, the default: which weight storage a checkpoint gets, and why (torch-free; run
by `EngineArgs.create_engine_config` in the frontend, before any engine process starts).

The rule: a GGUF file whose every layer linear weight (each 2-D `blk.*` tensor) is already block-quantized (Q4_0,
Q4_1, Q8_0, K-quants, ...) keeps blocks: `"gguf"` (its Q4_0 / Q4_1 / Q8_0 tensors kept as they are, other block
types requantized to Q8_0; `model/kernels/block_quant.py`). Everything else runs in float32: float GGUF layer
weights (F32 / F16 / BF16, or a mix with block ones), HF safetensors directories, random ("dummy") weights, and
`tensor_parallel_size > 1` (block weights are not sharded). LoRA adapters run on block weights (`enable_lora`
keeps "gguf"). Measured for the decision (README "Speed", `benchmarks/analysis.md`): on the default model's Q4_1
file "gguf" decodes at batch 1 about 5x fp32's speed in a third of its memory, with an error against fp32 smaller
than llama.cpp's on the same file.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

from asyncllm.engine_config import Quantization
from asyncllm.model.loading.gguf_metadata import GGUFTensorInfo

FLOAT_GGML_TYPES = {0: "F32", 1: "F16", 28: "F64", 30: "BF16"}  # ggml type ids of float (unquantized) tensors
GGML_BLOCK_TYPE_NAMES = {  # ggml type ids of block types, for the log line (ggml.h `enum ggml_type`)
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    29: "IQ1_M",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
}
KEPT_GGML_TYPES = (2, 3, 8)  # the block types "gguf" keeps as they are (the kernels' own: Q4_0, Q4_1, Q8_0)
FLOAT32_HOW = "set quantization='gguf' / 'q8_0' / 'q4_0' / 'int8' for smaller weights"


@dataclass(frozen=True)
class QuantizationChoice:
    """What `quantization="auto"` resolved to.

    Fields:
        quantization: "gguf" (the file's blocks kept) or None (float32 weights).
        reason: one log line naming the choice and why, e.g. "quantization='auto' -> 'gguf':
            SmolLM2-135M-Instruct.Q4_1.gguf's 210 layer linear weights are already block-quantized (210 Q4_1): ...".
    """

    quantization: Quantization | None
    reason: str


def ggml_type_name(code: int) -> str:
    """A ggml tensor type's name ("Q4_1", "F16"), or "type <code>" for one not in the tables."""
    return FLOAT_GGML_TYPES.get(code) or GGML_BLOCK_TYPE_NAMES.get(code) or f"type {code}"


def _counts(infos: Sequence[GGUFTensorInfo]) -> str:
    counts: dict[str, int] = {}
    for info in infos:
        name = ggml_type_name(info.ggml_type)
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))


def layer_linear_tensors(tensors: Sequence[GGUFTensorInfo]) -> list[GGUFTensorInfo]:
    """The layers' linear weights of a GGUF file: its 2-D `blk.*` tensors (norms and biases are 1-D; the token
    embedding and the output head are not `blk.*`)."""
    return [t for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2]


def choose_quantization(
    model_path: str | pathlib.Path,
    gguf_tensors: Sequence[GGUFTensorInfo] | None,
    *,
    load_format: str,
    tensor_parallel_size: int,
) -> QuantizationChoice:
    """The weight storage `quantization="auto"` gives this checkpoint and configuration (the rule in the module
    docstring).

    Args:
        model_path: the resolved checkpoint (a `.gguf` file or an HF directory), named in the reason.
        gguf_tensors: the GGUF file's tensor descriptions (`gguf_config.read_checked_gguf_header(path)[1]`), or
            None for an HF directory.
        load_format: "auto" or "dummy" (random weights: float32).
        tensor_parallel_size: ranks; > 1 gives float32 (the block weights are not sharded in this version).
    Returns:
        The choice and its one-line reason.
    """
    name = pathlib.Path(model_path).name

    def float32(why: str, how: str = FLOAT32_HOW) -> QuantizationChoice:
        return QuantizationChoice(None, f"quantization='auto' -> float32 weights: {why}" + (f" ({how})" if how else ""))

    if load_format == "dummy":
        return float32("load_format='dummy' fills random float weights")
    if gguf_tensors is None:
        return float32(f"{name} is not a GGUF file (its weights are float)")
    linear = layer_linear_tensors(gguf_tensors)
    if not linear:
        return float32(f"{name} has no 2-D layer tensors (blk.*) to keep as blocks")
    floats = [t for t in linear if t.ggml_type in FLOAT_GGML_TYPES]
    if floats:
        return float32(
            f"{len(floats)} of the {len(linear)} layer linear weights of {name} are float ({_counts(linear)})"
        )
    blocks = f"{name}'s {len(linear)} layer linear weights are already block-quantized ({_counts(linear)})"
    if tensor_parallel_size > 1:
        return float32(f"{blocks}, but block weights need tensor_parallel_size=1", "'int8' runs with TP > 1")
    others = sorted({ggml_type_name(t.ggml_type) for t in linear if t.ggml_type not in KEPT_GGML_TYPES})
    how = (
        "kept as they are"
        if not others
        else f"{' / '.join(others)} (no kernel of their own) requantized to Q8_0 at load, as is a fused weight whose "
        "parts differ; the load's log line says what was kept"
    )
    return QuantizationChoice(
        "gguf", f"quantization='auto' -> 'gguf': {blocks}: {how} (quantization=None or 'none' gives float32 weights)"
    )
