"""Where a batch-1 decode step's CPU time goes outside the linear products: the model (all layers, LM head, argmax)
on one thread, 96 cached tokens, per quantization mode ("fp32", "int8", "gguf", "q8_0", "q4_0").

Prints per mode: the load's CPU time; the step's thread CPU time (`time.thread_time_ns`, best of 40: robust on a
shared machine, unlike wall time) split into the linear products (every `linear` / `int8_matmul` / `block_linear` /
`fused_block_linear` call the model makes, activation quantization included; a fused call's RMSNorm or SiLU x mul
and residual add count as products too) and the rest; torch ops per step (all, and the top-level
ones, per layer); Python-level calls per step (`sys.setprofile`: Python frames and C functions such as the row
kernels, which the torch profiler does not see). The timing wrappers add about 1 us per product to "products".
Runs in well under a minute per mode.

    .venv/bin/python benchmarks/step_breakdown.py [gguf int8 ...]
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import asyncllm.model.llama as llama
from asyncllm.config import ModelConfig
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.loading.loader import load_model
from asyncllm.model.loading.resolve import resolve_model_path
from asyncllm.worker.sampler import argmax_rows

BLOCK_SIZE, CONTEXT = 16, 96
PRODUCT_NS = [0]  # thread ns inside the products during the current step


def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            PRODUCT_NS[0] += time.thread_time_ns() - start

    return wrapper


def decode_step(model: Any) -> Callable[[], torch.Tensor]:
    """One decode row with CONTEXT cached tokens, in its own scratch KV cache (metadata built each step)."""
    arch, blocks = model.arch, -(-(CONTEXT + 1) // BLOCK_SIZE)
    shape = (blocks, 2, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
    kv_caches = [torch.zeros(shape) for _ in range(arch.num_hidden_layers)]

    def step() -> torch.Tensor:
        meta = build_attention_metadata([1], [CONTEXT + 1], [list(range(blocks))], BLOCK_SIZE)
        hidden = model(torch.zeros(1, dtype=torch.long), torch.full((1,), CONTEXT), kv_caches, meta)
        return argmax_rows(model.compute_logits(hidden))

    return step


def python_calls(step: Callable[[], torch.Tensor]) -> tuple[int, int]:
    """(Python frames, C function calls) of one step."""
    counts = collections.Counter()

    def hook(frame: Any, event: str, arg: Any) -> None:
        counts[event] += 1

    sys.setprofile(hook)
    try:
        step()
    finally:
        sys.setprofile(None)
    return counts["call"], counts["c_call"]


def measure(mode: str, path: str) -> str:
    start = time.process_time()
    config = ModelConfig(model=path, model_path=path, quantization=None if mode == "fp32" else mode)
    model = load_model(config, pack_weights=True)
    load_s = time.process_time() - start
    step = decode_step(model)
    for _ in range(5):
        step()
    best, best_products = float("inf"), 0
    for _ in range(40):
        PRODUCT_NS[0] = 0
        start_ns = time.thread_time_ns()
        step()
        elapsed = time.thread_time_ns() - start_ns
        if elapsed < best:
            best, best_products = elapsed, PRODUCT_NS[0]
    frames, c_calls = python_calls(step)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    events = prof.events()
    top_level = sum(e.cpu_parent is None for e in events) / 5
    layers = model.arch.num_hidden_layers
    return (
        f"{mode}: load {load_s:.2f} s CPU; step {best / 1e6:.2f} ms CPU = products {best_products / 1e6:.2f} + other "
        f"{(best - best_products) / 1e6:.2f}; torch ops {len(events) // 5} (top-level {top_level:.0f}, "
        f"{top_level / layers:.1f} per layer); Python frames {frames}, C calls {c_calls}"
    )


def main() -> None:
    torch.set_num_threads(1)
    for name in ("linear", "int8_matmul", "block_linear", "fused_block_linear"):
        if hasattr(llama, name):
            setattr(llama, name, timed(getattr(llama, name)))
    path = str(resolve_model_path("smollm2-135m-instruct"))
    for mode in sys.argv[1:] or ["fp32", "int8", "gguf"]:
        print(measure(mode, path), flush=True)


if __name__ == "__main__":
    main()
