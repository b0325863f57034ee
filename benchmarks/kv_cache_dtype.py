"""Serving step shapes with a float32 and a bfloat16 KV cache (`EngineArgs.kv_cache_dtype`), fp32 and int8 weights:
the model's forward on one thread, its thread CPU time (`time.thread_time_ns`, best of `--repeats`: robust on a
shared machine, unlike wall time) split into attention (every `paged_attention` call: decode kernel, prefill SDPA),
the linear products (every `linear` / `int8_matmul` call) and the rest (norms, rotary, K/V writes, ...).

Shapes (issue 30's step profile of int8 serving):
- "mixed-300": 32 decodes at 300 tokens + a fresh 256-token chunk;
- "mixed-1500": 8 decodes at 1500 tokens + a 256-token chunk after 1280 cached;
- "chunk-512": a 512-token chunk after 1024 cached;
- "decode-300": 32 decodes at 300 tokens.
Cached K/V are whatever a scratch cache holds (zeros): attention's cost does not depend on the values.

    .venv/bin/python benchmarks/kv_cache_dtype.py [--modes fp32 int8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import torch

import asyncllm.model.llama as llama
from asyncllm.config import ModelConfig
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.loading.loader import load_model
from asyncllm.model.loading.resolve import resolve_model_path

BLOCK_SIZE = 16
# name -> [(query_len, seq_len)] per sequence
SHAPES: dict[str, list[tuple[int, int]]] = {
    "mixed-300": [(1, 300)] * 32 + [(256, 256)],
    "mixed-1500": [(1, 1500)] * 8 + [(256, 1536)],
    "chunk-512": [(512, 1536)],
    "decode-300": [(1, 300)] * 32,
}
SPENT = {"attention": 0, "products": 0}  # thread ns inside each during the current step


def timed(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[kind] += time.thread_time_ns() - start

    return wrapper


def step_of(model: Any, shape: list[tuple[int, int]], dtype: torch.dtype) -> Callable[[], None]:
    """One forward of `shape` (each sequence in its own blocks) in a scratch cache of `dtype`."""
    arch = model.arch
    tables, cursor = [], 0
    for _, seq_len in shape:
        n = -(-seq_len // BLOCK_SIZE)
        tables.append(list(range(cursor, cursor + n)))
        cursor += n
    cache_shape = (cursor, 2, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
    kv_caches = [torch.zeros(cache_shape, dtype=dtype) for _ in range(arch.num_hidden_layers)]
    query_lens, seq_lens = [q for q, _ in shape], [s for _, s in shape]
    positions = torch.cat([torch.arange(s - q, s) for q, s in shape])
    ids = torch.zeros(len(positions), dtype=torch.long)

    def step() -> None:
        meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
        model(ids, positions, kv_caches, meta)

    return step


def measure(model: Any, shape: list[tuple[int, int]], dtype: torch.dtype, repeats: int) -> tuple[float, float, float]:
    """(step, attention, products) ms of the best of `repeats` steps (thread CPU time)."""
    step = step_of(model, shape, dtype)
    step()
    best = (float("inf"), 0.0, 0.0)
    for _ in range(repeats):
        SPENT.update(attention=0, products=0)
        start = time.thread_time_ns()
        step()
        elapsed = time.thread_time_ns() - start
        if elapsed / 1e6 < best[0]:
            best = (elapsed / 1e6, SPENT["attention"] / 1e6, SPENT["products"] / 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["int8", "fp32"], choices=["fp32", "int8"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    llama.paged_attention = timed("attention", llama.paged_attention)
    for name in ("linear", "int8_matmul"):
        setattr(llama, name, timed("products", getattr(llama, name)))
    path = str(resolve_model_path("smollm2-135m-instruct"))
    print(f"load average at start: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs", flush=True)
    for mode in args.modes:
        model = load_model(ModelConfig(model=path, model_path=path, quantization=None if mode == "fp32" else mode))
        with torch.inference_mode():
            for name in args.shapes:
                cells = []
                for dtype in (torch.float32, torch.bfloat16):
                    total, attention, products = measure(model, SHAPES[name], dtype, args.repeats)
                    cells.append(
                        f"{str(dtype).removeprefix('torch.')} {total:.0f} ms = attention {attention:.0f}, products "
                        f"{products:.0f}, other {total - attention - products:.0f}"
                    )
                print(f"{mode} {name}: " + "; ".join(cells), flush=True)
        del model
    print(f"load average at end: {os.getloadavg()[0]:.2f} (1 min)", flush=True)


if __name__ == "__main__":
    main()
