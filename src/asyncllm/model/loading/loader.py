"""Build a model from a GGUF file or an HF safetensors directory, or with random ("dummy") weights.

GGUF (ggml docs, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): the header is read once
(`gguf_metadata.read_gguf_header`), tensors from a map of the file, dequantized to float32 with
`gguf.quants.dequantize` (under `quantization="gguf"`, Q8_0 / Q4_0 / Q4_1 tensors are kept as their bytes,
`block_quant.FileBlocks`); names are mapped to HF names by the
architecture's layout (`model/layouts.py`); llama.cpp's converter permutes the rows of Q and K weights of `llama`
models for its interleaved rotary layout, and `_unpermute` undoes it (the inverse of `permute` in llama.cpp's
convert_hf_to_gguf.py).
"""

from __future__ import annotations

import logging
import math
import pathlib
import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from asyncllm.engine_config import ModelConfig
from asyncllm.errors import ConfigError
from asyncllm.model.arch import ModelArchConfig
from asyncllm.model.kernels.block_quant import BLOCK_MODES, GGUF_BLOCK_KINDS, BlockShapeError, FileBlocks
from asyncllm.model.kernels.fp32 import fp32_chooser
from asyncllm.model.kernels.int8 import int8_chooser
from asyncllm.model.layouts import GGUF_TOP_NAMES, WeightLayout, layout_of
from asyncllm.model.loading.arch_config import check_max_model_len, read_arch_config
from asyncllm.model.loading.gguf_config import read_checked_gguf_header
from asyncllm.model.loading.gguf_metadata import GGUFTensorInfo
from asyncllm.model.loading.weight_placement import move_weights_to_huge_pages
from asyncllm.model.registry import get_model_class

logger = logging.getLogger(__name__)


def load_model(model_config: ModelConfig, pack_weights: bool = False) -> nn.Module:
    """Build the model for `model_config.model_path` and fill its weights.

        `load_format="auto"` loads the checkpoint (GGUF dequantized to float32, or safetensors; under "gguf" the file's
    Q8_0 / Q4_0 / Q4_1 tensors are kept as their bytes, never dequantized; the GGUF header is read once);
        `"dummy"` fills random weights of the right shapes from `model_config.seed` (no file I/O beyond metadata).
        With `quantization="int8"` the loaded float32 weights (this TP rank's shard) are then requantized; with "q8_0",
        "q4_0" or "gguf" stored in blocks of 32 (`model/kernels/block_quant.py`; "gguf" keeps a GGUF file's own Q4_0 /
        Q4_1 / Q8_0 blocks exactly and requantizes other block types to Q8_0); without,
        with `pack_weights` (what the worker asks for) they are prepared for the float32 kernels chosen on this host
        (`model/kernels/fp32.py`): faster, but the weights are no longer `nn.Parameter`s to edit. Which kernel runs each
        product (`model/kernels/choice.py`; forced by `model_config.linear_kernels`) is logged in one line per kind.
        With `pack_weights` the weights then move onto huge pages where the host grants them
        (`loading/weight_placement.py`).

        Returns:
            The model in eval mode, float32, with attributes `arch: ModelArchConfig` and `linear_kernels: str` (the
            log line saying which kernel runs each product; "" when the weights are neither packed nor quantized).
        Raises:
            ConfigError: a config key the model does not implement, a sliding window shorter than
                `model_config.max_model_len` (`loading/arch_config.py`), or a forced linear kernel that is not available
                here or gives wrong results.
            ValueError: unsupported architecture or file layout, or a tensor the model needs is not in the checkpoint.
            KeyError: a checkpoint tensor the model does not know.
    """
    if model_config.quantization_reason:  # `EngineArgs(quantization="auto")`: what was chosen and why
        logger.info("%s", model_config.quantization_reason)
    path = pathlib.Path(model_config.model_path)
    gguf = path.suffix.lower() == ".gguf"
    header = read_checked_gguf_header(path) if gguf and path.is_file() else None  # read once for config and tensors
    arch = read_arch_config(path, header)
    check_max_model_len(arch, model_config.max_model_len)
    weights: Iterable[tuple[str, torch.Tensor | FileBlocks]] = ()
    if model_config.load_format != "dummy":
        keep_blocks = model_config.quantization == "gguf"
        weights = _iter_gguf_weights(path, arch, header, keep_blocks) if header else _iter_safetensors_weights(path)
    model = get_model_class(arch.architecture)(arch)
    if model_config.load_format == "dummy":
        _fill_dummy(model, model_config.seed)
    else:
        model.load_weights(weights)  # type: ignore[operator]
    forced = model_config.linear_kernels or {}
    kernels = ""
    if model_config.quantization == "int8":
        int8 = int8_chooser(forced.get("int8"))
        calibration_ids = _calibration_ids(model_config, arch, header[0] if header else None)
        model.quantize_int8(calibration_ids, int8)  # type: ignore[operator]
        kernels = int8.describe()
    elif model_config.quantization in BLOCK_MODES:
        try:
            kernels = model.quantize_blocks(model_config.quantization)  # type: ignore[operator]
        except BlockShapeError as exc:
            raise ConfigError(f"quantization={model_config.quantization!r} does not fit this model: {exc}") from exc
    elif pack_weights:
        fp32 = fp32_chooser(forced.get("fp32"))
        model.pack_fp32(fp32)  # type: ignore[operator]
        kernels = fp32.describe()
    if kernels:
        logger.info("%s", kernels)
    if pack_weights:
        move_weights_to_huge_pages(model)  # the weights as they will run, on 2 MiB pages where the host grants them
    model.linear_kernels = kernels  # type: ignore[assignment]
    return model.eval()


# Calibration text for int8 smoothing (`model/kernels/int8.py`): a chat turn, prose, code and numbers, written for
# this project. Activation outliers sit in fixed channels, so a few hundred ordinary tokens find them.
CALIBRATION_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Answer clearly and briefly."},
    {"role": "user", "content": "What is the capital of France, and why do rivers flow towards the sea?"},
    {
        "role": "assistant",
        "content": "The capital of France is Paris. Rivers flow downhill because gravity pulls water towards "
        "lower ground, and the sea is the lowest ground a river can reach. Along the way a river gathers "
        "rain, melted snow and smaller streams, carves valleys, and carries sand and mud that settle at "
        "its mouth.\n\nHere is a small Python function:\n\ndef mean(values: list[float]) -> float:\n"
        "    if not values:\n        raise ValueError('empty')\n    return sum(values) / len(values)\n\n"
        "In 2024, 3 of 12 tests (25%) took 0.75 s each; the rest took 1,250 ms in total.",
    },
    {"role": "user", "content": "Thanks! Can you write a short poem about autumn leaves in the wind?"},
]


def _calibration_ids(
    model_config: ModelConfig, arch: ModelArchConfig, gguf_metadata: dict[str, Any] | None = None
) -> list[int]:
    """Token ids of `CALIBRATION_MESSAGES` (chat template if the model has one, else plain text; the tokenizer from
    `gguf_metadata` when the file's header was read already); a dummy model (no tokenizer) gets a fixed spread of
    ids."""
    if model_config.load_format == "dummy":
        return [(7919 * i + 13) % arch.vocab_size for i in range(min(256, arch.max_position_embeddings))]
    from asyncllm.errors import InvalidRequestError
    from asyncllm.model.loading.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(model_config.model_path, gguf_metadata)
    try:
        text = tokenizer.apply_chat_template(CALIBRATION_MESSAGES)
    except InvalidRequestError:
        text = "\n\n".join(m["content"] for m in CALIBRATION_MESSAGES)
    return tokenizer.encode(text)[: arch.max_position_embeddings]


def _iter_gguf_weights(
    path: pathlib.Path,
    arch: ModelArchConfig,
    header: tuple[dict[str, Any], list[GGUFTensorInfo]],
    keep_blocks: bool = False,
) -> Iterator[tuple[str, torch.Tensor | FileBlocks]]:
    """(HF name, float32 [out, in] tensor) for every tensor of a GGUF file (`header`: its `read_gguf_header`),
    dequantized one at a time; with `keep_blocks`, a 2-D Q8_0 / Q4_0 / Q4_1 tensor comes as its own bytes
    (`FileBlocks`, rows in the same order), not dequantized (for `quantization="gguf"`; models that map GGUF
    names themselves get floats)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    _, infos = header
    # A model class with its own GGUF names (and tensor conventions) maps them itself (`gemma3.py`); the others
    # are in their architecture's layout (`model/layouts.py`).
    rename = getattr(get_model_class(arch.architecture), "hf_tensor_from_gguf", None)
    keep_blocks = keep_blocks and rename is None
    data = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)  # plain views: no memmap overhead
    for info in infos:
        if info.name == "rope_freqs.weight":  # RoPE divisors, read into the arch config
            continue
        qtype = GGMLQuantizationType(info.ggml_type)
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        shape = [int(n) for n in reversed(info.shape)]  # ggml lists the fastest-varying dim first
        row_bytes = shape[-1] // block_elems * block_bytes
        end = info.offset + math.prod(shape[:-1]) * row_bytes
        if end > data.nbytes:
            raise ValueError(
                f"{path} is truncated: tensor {info.name} ends at byte {end}, the file has {data.nbytes} bytes"
            )
        raw = data[info.offset : end].reshape(*shape[:-1], row_bytes)
        weight: torch.Tensor | FileBlocks
        if keep_blocks and len(shape) == 2 and info.ggml_type in GGUF_BLOCK_KINDS:
            blocks = torch.from_numpy(np.array(raw)).reshape(shape[0], -1, block_bytes)  # a copy, off the file map
            weight = FileBlocks(GGUF_BLOCK_KINDS[info.ggml_type], blocks)
        else:
            array = np.array(dequantize(raw, qtype), dtype=np.float32)  # a writable copy, off the file map
            weight = torch.from_numpy(array.reshape(shape))
        if rename is not None:
            assert isinstance(weight, torch.Tensor)  # keep_blocks is off for these models
            yield rename(info.name, weight)
            continue
        layout = layout_of(arch.architecture)
        name = _hf_name(info.name, layout)
        if layout.gguf_permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = arch.num_attention_heads if "q_proj" in name else arch.num_key_value_heads
            if isinstance(weight, FileBlocks):
                weight = FileBlocks(weight.kind, _unpermute(weight.raw, heads))
            else:
                weight = _unpermute(weight, heads)
        yield name, weight


def _hf_name(gguf_name: str, layout: WeightLayout) -> str:
    """The HF name of a llama.cpp tensor name, as the architecture's layout maps them."""
    stem, _, kind = gguf_name.rpartition(".")  # kind: "weight" or "bias"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match and match[2] in layout.gguf_layer_names:
        return f"model.layers.{match[1]}.{layout.gguf_layer_names[match[2]]}.{kind}"
    if stem in GGUF_TOP_NAMES:
        return f"{GGUF_TOP_NAMES[stem]}.{kind}"
    raise KeyError(f"unexpected GGUF tensor {gguf_name!r}")


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pairs interleaved) -> (first half, second half)."""
    out_dim = weight.shape[0]
    half = out_dim // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _iter_safetensors_weights(path: pathlib.Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if not name.endswith("rotary_emb.inv_freq"):
                    yield name, f.get_tensor(name)


def _fill_dummy(model: nn.Module, seed: int) -> None:
    """Random weights: N(0, 0.02) for matrices, ones for norm weights, zeros for biases; seeded."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "bias" in name:
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
