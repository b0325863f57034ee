"""Tensor-parallel sharding math in one process: the partial outputs of TP=3 shards of a decoder layer sum to the
unsharded layer's output (what the gloo all-reduce computes across processes); divisibility errors; TP=1 never
touches torch.distributed; LoRA deltas equal merged weights, and their TP=3 shards sum to them."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from asyncllm.distributed.parallel_state import all_reduce, get_tp_size
from asyncllm.distributed.tp_sizes import check_tp_divides
from asyncllm.errors import ConfigError
from asyncllm.lora.request import LoRARequest
from asyncllm.lora.weights import LayerLoRA, LoRABatch, load_adapter
from asyncllm.model.arch import ModelArchConfig
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.layers.rotary import arch_inv_freq, rotary_cos_sin
from asyncllm.model.llama import LlamaDecoderLayer
from tests.lora_adapters import write_peft_adapter

ARCH = ModelArchConfig(
    architecture="qwen2",  # with q/k/v biases, so bias sharding is covered too
    vocab_size=64,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


def hf_layer_weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random HF-named `[out, in]` tensors of one layer."""
    h, d, inter = ARCH.hidden_size, ARCH.head_dim, ARCH.intermediate_size
    q, kv = ARCH.num_attention_heads * d, ARCH.num_key_value_heads * d
    shapes = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    return {name: torch.randn(*shape, generator=gen) * 0.2 for name, shape in shapes.items()}


def build_layer(weights: dict[str, torch.Tensor], rank: int, tp: int) -> LlamaDecoderLayer:
    layer = LlamaDecoderLayer(ARCH, tp_rank=rank, tp_size=tp)
    with torch.no_grad():
        for name, w in weights.items():
            layer.load_weight(name, w)
    return layer


def attention_and_mlp(
    layer: LlamaDecoderLayer, x: torch.Tensor, lora: LayerLoRA | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This layer's (attention output, MLP output) for a 5-token prefill, before any all-reduce (TP size is 1 in
    this process, so `all_reduce` is the identity and shards return their partial sums)."""
    n, block_size = x.shape[0], 4
    num_blocks = 2
    cache = torch.zeros(num_blocks, 2, block_size, layer.kv_size // ARCH.head_dim, ARCH.head_dim)
    meta = build_attention_metadata([n], [n], [[0, 1]], block_size)
    cos, sin = rotary_cos_sin(arch_inv_freq(ARCH), ARCH.max_position_embeddings)
    positions = torch.arange(n)
    with torch.inference_mode():
        attn = layer._attention(x, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1), cache, meta, lora)
        mlp = layer._mlp(x, lora)
    return attn, mlp


def test_tp3_shards_sum_to_the_unsharded_layer() -> None:
    gen = torch.Generator().manual_seed(0)
    weights = hf_layer_weights(gen)
    x = torch.randn(5, ARCH.hidden_size, generator=gen)
    full_attn, full_mlp = attention_and_mlp(build_layer(weights, 0, 1), x)
    shards = [attention_and_mlp(build_layer(weights, rank, 3), x) for rank in range(3)]
    assert shards[0][0].shape == full_attn.shape  # each rank's partial is full width: [num_tokens, hidden_size]
    torch.testing.assert_close(sum(s[0] for s in shards), full_attn, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sum(s[1] for s in shards), full_mlp, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(shards[0][1], full_mlp, atol=1e-3)  # a single shard is only a part


def test_each_rank_holds_only_its_shard() -> None:
    layer = build_layer(hf_layer_weights(torch.Generator().manual_seed(1)), 2, 3)
    d = ARCH.head_dim
    assert layer.qkv_proj.shape == (ARCH.hidden_size, (2 + 2 * 1) * d)  # 2 of 6 query heads, 1 of 3 KV heads
    assert layer.o_proj.shape == (2 * d, ARCH.hidden_size)
    assert layer.gate_up_proj.shape == (ARCH.hidden_size, 2 * 32)
    assert layer.down_proj.shape == (32, ARCH.hidden_size)


def test_smollm2_head_counts_accept_tp3_and_reject_tp2() -> None:
    check_tp_divides(9, 3, 1536, 1)
    check_tp_divides(9, 3, 1536, 3)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 does not divide .*valid sizes.*\[1, 3\]"):
        check_tp_divides(9, 3, 1536, 2)


def test_tp1_never_touches_torch_distributed() -> None:
    x = torch.ones(3)
    assert get_tp_size() == 1
    assert all_reduce(x) is x
    assert not dist.is_initialized()


def test_lora_deltas_equal_merged_weights_and_tp3_shards_sum_to_them(tmp_path: pathlib.Path) -> None:
    """A rank-4 adapter on all seven modules: per-row deltas on the fused weights equal W + scale * B @ A merged
    into the HF weights (so every delta lands in its q/k/v or gate/up slice), and TP=3 shards of A/B sum to it."""
    gen = torch.Generator().manual_seed(2)
    weights = hf_layer_weights(gen)
    tensors = write_peft_adapter(tmp_path, ARCH, rank=4, alpha=8.0, seed=3, std=0.2)
    merged = dict(weights)
    for key, lora_a in tensors.items():
        if key.endswith("lora_A.weight"):
            module = key.split(".layers.0.")[1].removesuffix(".lora_A.weight")
            merged[f"{module}.weight"] = weights[f"{module}.weight"] + 2.0 * tensors[key.replace("_A", "_B")] @ lora_a
    x = torch.randn(5, ARCH.hidden_size, generator=gen)
    request = LoRARequest("a", 1, str(tmp_path))

    def with_lora(rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = build_layer(weights, rank, tp)
        adapter = load_adapter(request, ARCH, [layer], max_lora_rank=4)
        return attention_and_mlp(layer, x, LoRABatch([(slice(0, 5), adapter)]).layer(0))

    full_attn, full_mlp = attention_and_mlp(build_layer(merged, 0, 1), x)
    attn, mlp = with_lora(0, 1)
    torch.testing.assert_close(attn, full_attn, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mlp, full_mlp, rtol=1e-4, atol=1e-4)
    shards = [with_lora(rank, 3) for rank in range(3)]
    torch.testing.assert_close(sum(s[0] for s in shards), full_attn, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sum(s[1] for s in shards), full_mlp, rtol=1e-4, atol=1e-4)
    plain_attn, _ = attention_and_mlp(build_layer(weights, 0, 1), x)
    assert not torch.allclose(plain_attn, full_attn, atol=1e-2)  # the adapter changes the layer


PHI3 = dataclasses.replace(ARCH, architecture="phi3")  # fused qkv_proj / gate_up_proj checkpoint modules
LLAMA = dataclasses.replace(ARCH, architecture="llama")


def packed_phi3_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Phi-3 checkpoint of the same layer (no biases): q | k | v rows in one qkv_proj, gate | up in gate_up_proj."""
    qkv = torch.cat([weights[f"self_attn.{m}_proj.weight"] for m in "qkv"])
    gate_up = torch.cat([weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"]])
    kept = {k: v for k, v in weights.items() if k.split(".")[1] in ("o_proj", "down_proj") or "layernorm" in k}
    return {**kept, "self_attn.qkv_proj.weight": qkv, "mlp.gate_up_proj.weight": gate_up}


def build_arch_layer(arch: ModelArchConfig, weights: dict[str, torch.Tensor], rank: int, tp: int) -> LlamaDecoderLayer:
    layer = LlamaDecoderLayer(arch, tp_rank=rank, tp_size=tp)
    with torch.no_grad():
        for name, w in weights.items():
            layer.load_weight(name, w)
    return layer


def test_phi3_packed_modules_load_and_shard_like_the_split_ones(tmp_path: pathlib.Path) -> None:
    """The layout splits Phi-3's fused checkpoint modules by part: at TP=1 and in each TP=3 shard the layer equals a
    Llama layer loaded from the split modules; a LoRA pair on qkv_proj / gate_up_proj (one A, B rows by part) equals
    the merged weights, and its TP=3 shards sum to them."""
    gen = torch.Generator().manual_seed(4)
    split = {k: v for k, v in hf_layer_weights(gen).items() if not k.endswith("bias")}
    packed = packed_phi3_weights(split)
    x = torch.randn(5, ARCH.hidden_size, generator=gen)
    for rank, tp in [(0, 1), (0, 3), (2, 3)]:
        ours, reference = build_arch_layer(PHI3, packed, rank, tp), build_arch_layer(LLAMA, split, rank, tp)
        torch.testing.assert_close(ours.qkv_proj, reference.qkv_proj, rtol=0, atol=0)
        torch.testing.assert_close(ours.gate_up_proj, reference.gate_up_proj, rtol=0, atol=0)
        torch.testing.assert_close(ours.down_proj, reference.down_proj, rtol=0, atol=0)
    shapes = {"self_attn.qkv_proj": packed["self_attn.qkv_proj.weight"].shape, "mlp.gate_up_proj": None}
    shapes["mlp.gate_up_proj"] = packed["mlp.gate_up_proj.weight"].shape
    tensors = {}
    for module, (out_features, in_features) in shapes.items():
        key = f"base_model.model.model.layers.0.{module}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(4, in_features, generator=gen) * 0.2
        tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, 4, generator=gen) * 0.2
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["qkv_proj", "gate_up_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    merged = dict(packed)
    for module in shapes:
        key = f"base_model.model.model.layers.0.{module}"
        merged[f"{module}.weight"] = packed[f"{module}.weight"] + 2.0 * (
            tensors[f"{key}.lora_B.weight"] @ tensors[f"{key}.lora_A.weight"]
        )
    request = LoRARequest("a", 1, str(tmp_path))

    def with_lora(rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = build_arch_layer(PHI3, packed, rank, tp)
        adapter = load_adapter(request, PHI3, [layer], max_lora_rank=4)
        return attention_and_mlp(layer, x, LoRABatch([(slice(0, 5), adapter)]).layer(0))

    full_attn, full_mlp = attention_and_mlp(build_arch_layer(PHI3, merged, 0, 1), x)
    attn, mlp = with_lora(0, 1)
    torch.testing.assert_close(attn, full_attn, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mlp, full_mlp, rtol=1e-4, atol=1e-4)
    shards = [with_lora(rank, 3) for rank in range(3)]
    torch.testing.assert_close(sum(s[0] for s in shards), full_attn, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sum(s[1] for s in shards), full_mlp, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(attention_and_mlp(build_arch_layer(PHI3, packed, 0, 1), x)[0], full_attn, atol=1e-2)


@pytest.mark.parametrize(
    "arch",
    [
        dataclasses.replace(ARCH, architecture="qwen3", head_dim=16),  # q/k norms; head_dim != hidden / heads
        dataclasses.replace(ARCH, architecture="phi3", rotary_dim=6),  # partial rotary
    ],
    ids=["qwen3", "phi3"],
)
def test_tp3_shards_of_qwen3_and_phi3_layers_sum_to_the_unsharded_layer(arch: ModelArchConfig) -> None:
    gen = torch.Generator().manual_seed(5)
    h, d, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    modules = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h)}
    modules |= {"self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h)}
    modules |= {"mlp.down_proj": (h, inter)}
    weights = {f"{m}.weight": torch.randn(*shape, generator=gen) * 0.2 for m, shape in modules.items()}
    norms = ["input_layernorm", "post_attention_layernorm"]
    norms += ["self_attn.q_norm", "self_attn.k_norm"] if arch.architecture == "qwen3" else []
    for norm in norms:
        width = d if norm.startswith("self_attn") else h  # q/k norms are per head
        weights[f"{norm}.weight"] = 1 + 0.3 * torch.randn(width, generator=gen)
    if arch.architecture == "phi3":
        weights = packed_phi3_weights(weights)
    x = torch.randn(5, h, generator=gen)

    def run(rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = build_arch_layer(arch, weights, rank, tp)
        n, cache = x.shape[0], torch.zeros(2, 2, 4, layer.kv_size // d, d)
        meta = build_attention_metadata([n], [n], [[0, 1]], 4)
        cos, sin = rotary_cos_sin(arch_inv_freq(arch), arch.max_position_embeddings)
        with torch.inference_mode():
            attn = layer._attention(x, cos[:n].unsqueeze(1), sin[:n].unsqueeze(1), cache, meta)
            return attn, layer._mlp(x)

    full_attn, full_mlp = run(0, 1)
    shards = [run(rank, 3) for rank in range(3)]
    torch.testing.assert_close(sum(s[0] for s in shards), full_attn, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sum(s[1] for s in shards), full_mlp, rtol=1e-5, atol=1e-5)
