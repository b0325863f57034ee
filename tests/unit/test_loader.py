"""Loader and model on small inputs: architecture config, dummy weights, HF safetensors parity, batching."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from asyncllm.config import ModelConfig
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.loading.loader import load_model, read_arch_config
from asyncllm.model.registry import get_model_class

BLOCK_SIZE = 4


def _prefill(model: Any, seqs: list[list[int]]) -> torch.Tensor:
    """One step prefilling every sequence in a fresh cache; returns [num_tokens, hidden] hidden states."""
    arch = model.arch
    per_seq = -(-max(map(len, seqs)) // BLOCK_SIZE)
    shape = (len(seqs) * per_seq, 2, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
    caches = [torch.zeros(shape) for _ in range(arch.num_hidden_layers)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(seqs))]
    meta = build_attention_metadata([len(s) for s in seqs], [len(s) for s in seqs], tables, BLOCK_SIZE)
    positions = torch.tensor([p for s in seqs for p in range(len(s))])
    return model(torch.tensor([t for s in seqs for t in s]), positions, caches, meta)


def test_read_arch_config_from_gguf(model_path: str) -> None:
    arch = read_arch_config(model_path)
    assert (arch.architecture, arch.num_hidden_layers, arch.hidden_size, arch.intermediate_size) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert (arch.vocab_size, arch.rope_theta, arch.max_position_embeddings) == (49152, 100000.0, 8192)
    assert arch.tie_word_embeddings
    assert (arch.bos_token_id, arch.eos_token_id) == (1, 2)


@pytest.mark.slow  # two full-size (135M) models with dummy weights: 8 s of a busy 2-core machine, out of test-fast
def test_dummy_weights_are_seeded_and_batch_invariant(model_path: str) -> None:
    config = ModelConfig(model="m", model_path=model_path, load_format="dummy", seed=7)
    model, again = load_model(config), load_model(config)
    assert model.arch.hidden_size == 576
    seqs = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    together = _prefill(model, seqs)
    torch.testing.assert_close(together, _prefill(again, seqs))
    alone = torch.cat([_prefill(model, [s]) for s in seqs])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    logits = model.compute_logits(together[-1:])
    assert logits.shape == (1, 49152)
    assert logits.dtype == torch.float32


def test_unknown_architecture_raises() -> None:
    with pytest.raises(ValueError, match="unsupported architecture"):
        get_model_class("gpt-neox")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_safetensors_logits_match_transformers(family: str, tmp_path: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    sizes = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=family == "qwen2",
    )
    config_cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config_cls(**sizes)).eval()
    with torch.no_grad():  # HF initializes biases to zero: make Qwen2's q/k/v biases count
        for name, param in ref.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    ref.save_pretrained(tmp_path)
    model = load_model(ModelConfig(model="m", model_path=str(tmp_path)))
    assert model.arch.architecture == family
    ids = [3, 17, 42, 8, 8, 90, 1]
    ours = model.compute_logits(_prefill(model, [ids]))
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
