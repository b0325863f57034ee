"""Read and check a PEFT LoRA adapter directory without loading its tensors (no torch: the frontend runs it).

Format (Hugging Face PEFT, `LoraConfig` and `save_pretrained`): `adapter_config.json` holds `peft_type` "LORA",
the rank `r`, `lora_alpha` and `target_modules`; `adapter_model.safetensors` holds, per adapted linear layer,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` `[r, in_features]` and `...lora_B.weight`
`[out_features, r]`. The layer's output becomes `x @ W^T + scale * (x @ A^T) @ B^T` with `scale = lora_alpha / r`.

Anything that would change that math and is not honoured here is refused, never ignored: rsLoRA (`use_rslora`,
scale alpha / sqrt(r)), DoRA (`use_dora`, `lora_magnitude_vector` keys), `modules_to_save` (fully trained copies of
other layers), biases (`bias` != "none", `lora_bias`), per-module ranks or alphas (`rank_pattern`, `alpha_pattern`),
`fan_in_fan_out`, initialisations that change the base weights (PiSSA, OLoRA, CorDA, LoftQ, EVA: convert those to
plain LoRA first), token or embedding adapters, any module other than q/k/v/o and gate/up/down (or Phi-3's fused
qkv and gate_up: the model's layout, `model/layouts.py`, decides which it has), and any config key this module does
not know whose value is set. Metadata keys (`base_model_name_or_path`, `task_type`,
`lora_dropout`, ...) are read past.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from dataclasses import dataclass
from typing import Any

from asyncllm.errors import InvalidRequestError
from asyncllm.model.layouts import ALL_LORA_MODULES, LAYOUTS, part_inputs, part_widths

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
MAX_LORA_RANK = 64  # the largest `max_lora_rank` an engine accepts

# PEFT module name -> the module's path inside a decoder layer: Llama's, and every architecture's (`model/layouts.py`;
# the model's own layout decides once the adapter is checked against it).
MODULE_PATHS = dict(LAYOUTS["llama"].lora_modules)
_ANY_MODULE_PATHS = ALL_LORA_MODULES
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.((?:self_attn|mlp)\.[a-z_]+)\.lora_([AB])\.weight",
)
_DTYPES = {"F32", "F16", "BF16"}
# Config keys that do not change the forward pass (metadata, training-time settings, which modules/layers got
# weights: the weights file decides that).
_IGNORED_KEYS = {
    "base_model_name_or_path", "revision", "task_type", "inference_mode", "auto_mapping", "peft_version",
    "lora_dropout", "layers_to_transform", "layers_pattern", "exclude_modules", "megatron_config", "megatron_core",
    "qalora_group_size", "runtime_config", "peft_type", "r", "lora_alpha", "target_modules", "bias",
    "init_lora_weights",
}  # fmt: skip
_PLAIN_INITS = (True, False, "gaussian")  # init_lora_weights values that leave the base weights as they are


@dataclass(frozen=True)
class AdapterSpec:
    """What a checked adapter directory holds.

    Fields:
        rank: r, the inner width of every A/B pair.
        scale: lora_alpha / r, multiplied into each delta.
        modules: (layer index, module path such as "self_attn.q_proj") -> (lora_A key, lora_B key) in the
            weights file, for every adapted module.
        in_out: module path -> (in_features, out_features) as stored (A's columns, B's rows).
    """

    rank: int
    scale: float
    modules: dict[tuple[int, str], tuple[str, str]]
    in_out: dict[str, tuple[int, int]]


def model_module_shapes(
    hidden_size: int, intermediate_size: int, num_attention_heads: int, num_key_value_heads: int, head_dim: int
) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable module of a Llama decoder layer (unsharded; the layout's)."""
    dims = {"hidden_size": hidden_size, "intermediate_size": intermediate_size, "head_dim": head_dim}
    dims |= {"num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads}
    out, inputs = part_widths(_Dims(**dims)), part_inputs(_Dims(**dims))
    return {m: (inputs[parts[0]], sum(out[p] for p in parts)) for m, parts in LAYOUTS["llama"].modules.items()}


@dataclass(frozen=True)
class _Dims:
    """The dimensions `layouts.part_widths` reads of a `ModelArchConfig`."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


def read_adapter(
    path: str | pathlib.Path,
    max_lora_rank: int,
    module_shapes: dict[str, tuple[int, int]] | None = None,
    num_layers: int | None = None,
) -> AdapterSpec:
    """Read `adapter_config.json` and the safetensors header of a PEFT LoRA directory, and check them.

    Args:
        path: the adapter directory.
        max_lora_rank: the engine's largest rank.
        module_shapes: the model's `model_module_shapes`; None skips the comparison with the model.
        num_layers: the model's decoder layers; None skips the layer-index check.
    Returns:
        The adapter's `AdapterSpec`.
    Raises:
        InvalidRequestError: a missing or unreadable file, or anything refused (module docstring), naming the
            adapter path and the offending key.
    """
    directory = pathlib.Path(path)
    where = f"LoRA adapter {str(path)!r}"
    config = _read_config(directory / CONFIG_NAME, where)
    rank, scale = _check_config(config, max_lora_rank, where)
    shapes = _read_header(directory / WEIGHTS_NAME, where)
    modules, in_out = _check_tensors(shapes, rank, where)
    if module_shapes is not None:
        for module, dims in in_out.items():
            if module not in module_shapes:
                raise InvalidRequestError(
                    f"{where}: adapts {module}, which this model does not have; its modules: {sorted(module_shapes)}"
                )
            if module_shapes[module] != dims:
                raise InvalidRequestError(
                    f"{where}: {module} has [in, out] = {list(dims)}; the model's is {list(module_shapes[module])}"
                )
    if num_layers is not None and any(layer >= num_layers for layer, _ in modules):
        bad = max(layer for layer, _ in modules)
        raise InvalidRequestError(f"{where}: adapts layer {bad}; the model has {num_layers} layers")
    return AdapterSpec(rank, scale, modules, in_out)


def _read_config(file: pathlib.Path, where: str) -> dict[str, Any]:
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise InvalidRequestError(f"{where}: no {CONFIG_NAME} (a PEFT adapter directory is needed)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidRequestError(f"{where}: cannot read {CONFIG_NAME}: {e}") from None
    if not isinstance(config, dict):
        raise InvalidRequestError(f"{where}: {CONFIG_NAME} is not a JSON object")
    return config


def _is_set(value: Any) -> bool:
    return value not in (None, False, "", 0) and value != [] and value != {}


def _check_config(config: dict[str, Any], max_lora_rank: int, where: str) -> tuple[int, float]:
    """(rank, scale) of a LoRA config that this engine can honour."""
    if config.get("peft_type") != "LORA":
        raise InvalidRequestError(f"{where}: peft_type={config.get('peft_type')!r}; only 'LORA' adapters are supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_lora_rank:
        raise InvalidRequestError(f"{where}: r={rank!r} must be an integer in [1, max_lora_rank={max_lora_rank}]")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise InvalidRequestError(f"{where}: lora_alpha={alpha!r} must be a finite number")
    if config.get("bias", "none") != "none":
        raise InvalidRequestError(f"{where}: bias={config['bias']!r} is not supported (only 'none')")
    if config.get("init_lora_weights", True) not in _PLAIN_INITS:
        raise InvalidRequestError(
            f"{where}: init_lora_weights={config['init_lora_weights']!r} changes the base weights; convert the "
            "adapter to plain LoRA (PEFT `path_initial_model_for_weight_conversion`) first"
        )
    refused = sorted(key for key, value in config.items() if key not in _IGNORED_KEYS and _is_set(value))
    if refused:
        raise InvalidRequestError(
            f"{where}: {', '.join(f'{k}={config[k]!r}' for k in refused)} not supported (plain LoRA on "
            f"{'/'.join(_ANY_MODULE_PATHS)} only)"
        )
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a str is a regex or "all-linear": the weights file says what is adapted
        unknown = sorted(str(t) for t in targets if str(t).rsplit(".", 1)[-1] not in _ANY_MODULE_PATHS)
        if unknown:
            raise InvalidRequestError(
                f"{where}: target_modules {unknown} not supported; only {list(_ANY_MODULE_PATHS)}"
            )
    return rank, alpha / rank


def _read_header(file: pathlib.Path, where: str) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of every tensor in a safetensors file, from its header only."""
    from safetensors import safe_open

    if not file.is_file():
        raise InvalidRequestError(f"{where}: no {WEIGHTS_NAME} (only safetensors weights are read)")
    try:
        with safe_open(str(file), framework="numpy") as f:
            return {name: (f.get_slice(name).get_dtype(), list(f.get_slice(name).get_shape())) for name in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own SafetensorError for a malformed header
        raise InvalidRequestError(f"{where}: cannot read {WEIGHTS_NAME}: {type(e).__name__}: {e}") from None


def _check_tensors(
    shapes: dict[str, tuple[str, list[int]]], rank: int, where: str
) -> tuple[dict[tuple[int, str], tuple[str, str]], dict[str, tuple[int, int]]]:
    """The adapted modules and their [in, out] from the tensor names and shapes; every key must be a 2-D A or B
    of a supported module with the config's rank, each A with its B."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    features: dict[tuple[str, str], int] = {}  # (module, "A") -> in_features, (module, "B") -> out_features
    for name, (dtype, shape) in shapes.items():
        match = _KEY.fullmatch(name)
        if match is None or match[2] not in _ANY_MODULE_PATHS.values():
            raise InvalidRequestError(f"{where}: tensor {name!r} is not a LoRA A/B of {list(_ANY_MODULE_PATHS)}")
        if dtype not in _DTYPES or len(shape) != 2:
            raise InvalidRequestError(f"{where}: tensor {name!r} is {dtype} {shape}; a 2-D float tensor is needed")
        layer, module, side = int(match[1]), match[2], match[3]
        r, width = (shape[0], shape[1]) if side == "A" else (shape[1], shape[0])
        if r != rank:
            raise InvalidRequestError(f"{where}: tensor {name!r} has rank {r}; the config's r is {rank}")
        if features.setdefault((module, side), width) != width:
            raise InvalidRequestError(f"{where}: tensor {name!r} has shape {shape}, unlike {module} in other layers")
        pairs.setdefault((layer, module), {})[side] = name
    if not pairs:
        raise InvalidRequestError(f"{where}: {WEIGHTS_NAME} holds no LoRA weights")
    modules = {}
    for key, sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            raise InvalidRequestError(f"{where}: layer {key[0]} {key[1]} has lora_{next(iter(sides))} only")
        modules[key] = (sides["A"], sides["B"])
    in_out = {module: (features[(module, "A")], features[(module, "B")]) for _, module in modules}
    return modules, in_out
