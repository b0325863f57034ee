"""One weight layout per architecture: where each checkpoint tensor of a decoder layer goes, read by the loader
(HF and GGUF names), by tensor-parallel sharding (`llama_weights.py`) and by LoRA (`lora/peft.py`, `lora/weights.py`).

The decoder (`llama.py`) holds four fused `[in, out]` weights per layer, each made of named parts:
`qkv_proj` = q | k | v, `o_proj` = o, `gate_up_proj` = gate | up, `down_proj` = down. A checkpoint module holds one
part (Llama's `self_attn.q_proj`) or several adjacent ones (Phi-3's `self_attn.qkv_proj` = q | k | v): its `[out,
in]` rows are the parts' rows in order, so the loader splits it by the parts' widths and places each part in its
slot. Tensor parallelism shards by part: q/k/v/gate/up are column-parallel (each rank holds a slice of the part's
output rows), o/down row-parallel (a slice of the input columns). A LoRA adapter targets modules; a module of several
parts shares its A and splits its B's rows like the weight.

The idea follows nano-vllm's `packed_modules_mapping` (checkpoint module -> fused parameter and shard id); the table
here is data only (torch-free: the frontend checks LoRA adapters with it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


class LayerDims(Protocol):
    """The dimensions of a decoder layer (a `ModelArchConfig` has them)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


# Fused weight -> its parts, in column order.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q", "k", "v"),
    "o_proj": ("o",),
    "gate_up_proj": ("gate", "up"),
    "down_proj": ("down",),
}
PART_FUSED = {part: fused for fused, parts in FUSED_PARTS.items() for part in parts}
COLUMN_PARALLEL = frozenset({"q", "k", "v", "gate", "up"})  # shard output rows; the rest shard input columns

# GGUF names common to every architecture (llama.cpp's `gguf.TensorNameMap`): top-level tensors, and the norms and
# projections of a layer (after "blk.N.", HF path after "model.layers.N.").
GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_SPLIT_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_SPLIT_MODULES = {
    "self_attn.q_proj": ("q",),
    "self_attn.k_proj": ("k",),
    "self_attn.v_proj": ("v",),
    "self_attn.o_proj": ("o",),
    "mlp.gate_proj": ("gate",),
    "mlp.up_proj": ("up",),
    "mlp.down_proj": ("down",),
}
_NORMS = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attention_norm"}


@dataclass(frozen=True)
class WeightLayout:
    """Where an architecture's checkpoint tensors go.

    Fields:
        modules: HF module path inside a layer ("self_attn.q_proj") -> the parts it holds, in row order.
        norms: HF norm path inside a layer ("input_layernorm") -> the layer's parameter ("input_norm").
        biased_parts: parts whose module has a bias in the checkpoint (Qwen2: q, k, v).
        qk_norm: per-head RMSNorm on q and k before rotary (Qwen3: `self_attn.q_norm` / `k_norm`).
        gguf_layer_names: llama.cpp name after "blk.N." -> HF path after "model.layers.N.".
        gguf_permuted_qk: llama.cpp's converter permuted Q/K rows for its interleaved rotary (only "llama").
        lora_modules: PEFT target-module name -> HF module path (the modules an adapter may adapt).
    """

    modules: Mapping[str, tuple[str, ...]]
    norms: Mapping[str, str] = field(default_factory=lambda: dict(_NORMS))
    biased_parts: frozenset[str] = frozenset()
    qk_norm: bool = False
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: dict(_GGUF_SPLIT_LAYER))
    gguf_permuted_qk: bool = False
    lora_modules: Mapping[str, str] = field(default_factory=dict)

    def module_parts(self, module: str) -> tuple[str, ...]:
        """The parts an HF module path holds.

        Raises:
            KeyError: the architecture has no such module.
        """
        return self.modules[module]

    def module_shapes(self, arch: LayerDims) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each module, unsharded (what a LoRA pair of it must match)."""
        out = part_widths(arch)
        inputs = part_inputs(arch)
        return {m: (inputs[parts[0]], sum(out[p] for p in parts)) for m, parts in self.modules.items()}


def _lora_names(modules: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    return {path.rsplit(".", 1)[-1]: path for path in modules}


_LLAMA = WeightLayout(modules=_SPLIT_MODULES, gguf_permuted_qk=True, lora_modules=_lora_names(_SPLIT_MODULES))
_QWEN2 = WeightLayout(
    modules=_SPLIT_MODULES, biased_parts=frozenset({"q", "k", "v"}), lora_modules=_lora_names(_SPLIT_MODULES)
)
_QWEN3 = WeightLayout(
    modules=_SPLIT_MODULES,
    norms={**_NORMS, "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"},
    qk_norm=True,
    gguf_layer_names={**_GGUF_SPLIT_LAYER, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    lora_modules=_lora_names(_SPLIT_MODULES),
)
_PHI3_MODULES = {
    "self_attn.qkv_proj": ("q", "k", "v"),
    "self_attn.o_proj": ("o",),
    "mlp.gate_up_proj": ("gate", "up"),
    "mlp.down_proj": ("down",),
}
_PHI3 = WeightLayout(
    modules=_PHI3_MODULES,
    # llama.cpp's Phi-3 names: one fused attn_qkv, and the fused gate|up stored as ffn_up.
    gguf_layer_names={
        "attn_norm": "input_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    },
    lora_modules=_lora_names(_PHI3_MODULES),
)

# Gemma 2/3: split projections; the block places its own four norms (stored as 1 + w) and maps llama.cpp's names
# itself (`gemma3.py`); no LoRA.
_GEMMA = WeightLayout(modules=_SPLIT_MODULES, norms={}, gguf_layer_names={})

# Architecture name (`ModelArchConfig.architecture`) -> its layout.
LAYOUTS: dict[str, WeightLayout] = {
    "llama": _LLAMA,
    "qwen2": _QWEN2,
    "qwen3": _QWEN3,
    "phi3": _PHI3,
    "gemma2": _GEMMA,
    "gemma3": _GEMMA,
}
# Every PEFT module name some architecture can adapt (the frontend's check before it knows the model).
ALL_LORA_MODULES: dict[str, str] = {n: p for layout in LAYOUTS.values() for n, p in layout.lora_modules.items()}


def layout_of(architecture: str) -> WeightLayout:
    """The layout of an architecture.

    Raises:
        ValueError: no layout for that name (lists the known ones).
    """
    try:
        return LAYOUTS[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(LAYOUTS)}") from None


def part_widths(arch: LayerDims) -> dict[str, int]:
    """Output features of each part, unsharded."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    inter, hidden = arch.intermediate_size, arch.hidden_size
    return {"q": q, "k": kv, "v": kv, "o": hidden, "gate": inter, "up": inter, "down": hidden}


def part_inputs(arch: LayerDims) -> dict[str, int]:
    """Input features of each part, unsharded."""
    hidden = arch.hidden_size
    q_in, inter = arch.num_attention_heads * arch.head_dim, arch.intermediate_size
    return {"q": hidden, "k": hidden, "v": hidden, "o": q_in, "gate": hidden, "up": hidden, "down": inter}
