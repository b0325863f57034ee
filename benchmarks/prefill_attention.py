"""Prefill attention per layer: the C++ kernel that reads the paged cache (`csrc/paged_prefill_attention.cpp`) against
the torch path it replaced (`model/layers/prefill_attention.py`: ATen's CPU flash kernel per sequence, a gathered
cached prefix merged by log-sum-exp), on SmolLM2-135M's heads (9 query / 3 K/V heads of 64) and Gemma 3 270M's (4 / 1
of 256) and the prefill shapes the serving benchmark sends: 8 prompts of 256 tokens in one step, a 1024-token chunk,
the 512 tokens after it, a whole 1536-token prompt, 256 tokens after 1280 cached, and 4 prompts of 64. The cache is
float32 in blocks of 16 laid out as a fresh engine hands them out (in order). GFLOP/s counts the causal work only
(4 * heads * head_dim per (query, visible key)). Best of `--repeats` interleaved passes, torch's default threads.

`--kv-cache-dtype bfloat16`: the cache holds bfloat16 (`EngineArgs.kv_cache_dtype`). The kernel then multiplies in
bfloat16 where the CPU has AVX512_BF16 (else it widens to float32), the torch path runs SDPA in bfloat16, and the
kernel on a float32 copy of the same cache is timed too, for scale.

    .venv/bin/python benchmarks/prefill_attention.py [--repeats 5] [--kv-cache-dtype bfloat16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
from collections.abc import Callable

import torch
from throughput import machine_info  # benchmarks/ is on sys.path when run as a script

from asyncllm.model.kernels.row_kernels import load_kernels
from asyncllm.model.layers.attention import _cache_prefill_attention
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.layers.prefill_attention import prefix_split_available, sequence_prefill_attention

BLOCK_SIZE = 16
HEADS = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}
# (query tokens, tokens in the cache after the step) of each sequence of one prefill step
SHAPES = {
    "8 x 256": [(256, 256)] * 8,
    "1024": [(1024, 1024)],
    "512 after 1024": [(512, 1536)],
    "1536": [(1536, 1536)],
    "256 after 1280": [(256, 1536)],
    "4 x 64": [(64, 64)] * 4,
}


def time_best(run: Callable[[], None], repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls (after one warm-up call)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def measure(
    heads: tuple[int, int, int], spans: list[tuple[int, int]], repeats: int, dtype: torch.dtype
) -> dict[str, float]:
    """Milliseconds per layer of both paths on one step's prefill group (a cache of `dtype`), and their GFLOP/s."""
    num_heads, num_kv_heads, head_dim = heads
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the C++ kernels did not build here: nothing to compare")
    gen = torch.Generator().manual_seed(0)
    query_lens, seq_lens = [q for q, _ in spans], [n for _, n in spans]
    used = [-(-n // BLOCK_SIZE) for n in seq_lens]
    tables = [list(range(sum(used[:s]), sum(used[: s + 1]))) for s in range(len(spans))]
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
    group = meta.groups[0]
    num_tokens = sum(query_lens)
    float_cache = torch.randn(sum(used), 2, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    kv_cache = float_cache.to(dtype)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    # this step's keys and values as written to the cache (the torch path reads a fresh chunk's in place)
    slots = torch.cat([torch.arange(n - q, n) + tables[s][0] * BLOCK_SIZE for s, (q, n) in enumerate(spans)])
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    new_kv = (kv_cache[blocks, 0, offsets], kv_cache[blocks, 1, offsets])
    out = torch.empty(num_tokens + 1, num_heads * head_dim)

    def kernel() -> None:
        _cache_prefill_attention(query, kv_cache, group, None, kernels, None, out)

    def torch_path() -> None:
        sequence_prefill_attention(query, kv_cache, group, new_kv, None, out)

    kernel()
    got = out[:num_tokens].clone()
    torch_path()
    error = float((got - out[:num_tokens]).abs().max())
    times = {"kernel": time_best(kernel, repeats), "torch": time_best(torch_path, repeats)}
    flops = sum(4 * num_heads * head_dim * (q * (n - q) + q * (q + 1) / 2) for q, n in spans)
    float_copy = float_cache if dtype != torch.float32 else kv_cache
    return {
        "kernel_float32_cache_ms": time_best(
            lambda: _cache_prefill_attention(query, float_copy, group, None, kernels, None, out), repeats
        )
        * 1e3,
        "kernel_ms": times["kernel"] * 1e3,
        "torch_ms": times["torch"] * 1e3,
        "kernel_gflops": flops / times["kernel"] / 1e9,
        "torch_gflops": flops / times["torch"] / 1e9,
        "speedup": times["torch"] / times["kernel"],
        "max_abs_diff": error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-cache-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    dtype = getattr(torch, args.kv_cache_dtype)
    if not prefix_split_available():
        raise SystemExit("this torch has no CPU flash kernel with log-sum-exp: the torch path cannot run")
    m = machine_info()
    print(f"machine: {m['cpu']}, {m['cores']} cores, {torch.get_num_threads()} threads; load {os.getloadavg()}")
    kernels = load_kernels()
    bf16_dot = kernels is not None and kernels.paged_prefill_attention_bf16_dot()
    print(f"KV cache {args.kv_cache_dtype}; bfloat16 products on this CPU: {bf16_dot}")
    header = f"{'model':8} {'step':16} {'kernel ms':>10} {'torch ms':>10} {'kernel GF/s':>12} {'torch GF/s':>11}"
    print(f"{header} {'ratio':>6} {'max |diff|':>10} {'f32-cache kernel ms':>20}")
    rows = []
    for model, heads in HEADS.items():
        for name, spans in SHAPES.items():
            r = measure(heads, spans, args.repeats, dtype)
            rows.append({"model": model, "step": name, **r})
            print(
                f"{model:8} {name:16} {r['kernel_ms']:10.2f} {r['torch_ms']:10.2f} {r['kernel_gflops']:12.1f} "
                f"{r['torch_gflops']:11.1f} {r['speedup']:5.2f}x {r['max_abs_diff']:10.1e} "
                f"{r['kernel_float32_cache_ms']:20.2f}"
            )
    if args.json:
        report = {"machine": m, "threads": torch.get_num_threads(), "kv_cache_dtype": args.kv_cache_dtype}
        args.json.write_text(json.dumps({**report, "bf16_dot": bf16_dot, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
