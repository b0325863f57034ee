"""`benchmarks/fp32_ceiling.py` counts the multiply-adds behind issue 30's decision on float32 targets: its counts
against a hand count for SmolLM2-135M on the chat shape."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/ is no package
import fp32_ceiling

from asyncllm.model.loading.arch_config import read_arch_config


def test_attended_positions_are_causal_and_capped_by_the_window() -> None:
    assert fp32_ceiling.attended_positions(4, None) == 1 + 2 + 3 + 4
    assert fp32_ceiling.attended_positions(10, 4) == 1 + 2 + 3 + 4 + 6 * 4
    assert fp32_ceiling.attended_positions(3, 8) == 1 + 2 + 3


def test_the_chat_shape_on_smollm2_is_three_tera_multiply_adds(model_path: str) -> None:
    arch = read_arch_config(model_path)  # 30 layers, hidden 576, MLP 1536, 9 / 3 heads of 64, vocab 49,152
    per_layer = 576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536
    assert fp32_ceiling.linear_macs_per_token(arch) == 30 * per_layer == 106_168_320
    chat = fp32_ceiling.SHAPES["chat"]  # 64 requests, 256 prompt / 128 output tokens
    computed_tokens = 64 * (256 + 128 - 1)
    lm_head = 64 * 128 * 576 * 49_152
    attention = 64 * 30 * (2 * 9 * 64) * (383 * 384 // 2)
    expected = computed_tokens * 106_168_320 + lm_head + attention
    assert fp32_ceiling.shape_macs(arch, chat) == expected == 2_996_975_960_064
