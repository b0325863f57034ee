"""The 1-row block GEMV ("gguf" at batch 1) against the host's memory bandwidth, at 1 and 2 threads.

Weights: the default model's "gguf" products with random values (30 layers of Q4_1 qkv / o / gate_up / down and
the Q8_0 576 x 49152 LM head, as the SmolLM2 Q4_1 file keeps them: 121 products, their bytes counted from the
blocks). Prints:

1. Bandwidth in the same process: a torch copy (read + write counted) and a read-only pass (an int64 sum) of a
   256 MiB array, at 1 thread by thread CPU time and at 2 threads by wall time.
2. One decode step's 121 products at 1 row, 1 thread, thread CPU time (`time.thread_time_ns`, best of
   `--repeats`: robust on a shared host): ms per step, GB/s of weight bytes, and the body and the head apart; the
   same body with one layer's 4 weights used 30 times (2.3 MB: stays in L2/L3) against 30 distinct layers (69 MB).
3. The cost of a call without its weight stream: `block_linear` on a 1-row x 576 input and a 4-column weight.
4. The step at 2 threads against 1, by wall time (best of `--repeats`), with the load average before and after:
   on a shared host this is only as good as the load it ran beside.
5. With `--rows 2,4,5`: the step at those row counts too (1 thread, CPU time; the GEMV serves 1-5 rows).

    .venv/bin/python benchmarks/gemv_block.py [--repeats 30] [--rows 2,4,5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncllm.model.kernels.block_quant import BlockQuantWeight, block_kernels, block_linear, quantize_blocks

HIDDEN, LAYERS, VOCAB = 576, 30, 49152
SHAPES = [(HIDDEN, 960), (HIDDEN, HIDDEN), (HIDDEN, 3072), (1536, HIDDEN)]  # qkv, o, gate_up, down ([in, out])
BANDWIDTH_BYTES = 256 << 20


def thread_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Best thread CPU time of `repeats` calls of fn, in ms (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time_ns()
        fn()
        best = min(best, (time.thread_time_ns() - start) / 1e6)
    return best


def wall_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Best wall time of `repeats` calls of fn, in ms (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - start) * 1e3)
    return best


def bandwidth(repeats: int) -> dict[str, float]:
    """GB/s (1e9 bytes/s) of a copy (read + write counted) and of a read (int64 sum), at 1 and 2 threads."""
    src = torch.ones(BANDWIDTH_BYTES, dtype=torch.uint8)
    dst = torch.zeros(BANDWIDTH_BYTES, dtype=torch.uint8)
    words = src.view(torch.int64)
    result = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        timer = thread_ms if threads == 1 else wall_ms
        result[f"copy_{threads}t"] = 2 * BANDWIDTH_BYTES / timer(lambda: dst.copy_(src), repeats) / 1e6
        result[f"read_{threads}t"] = BANDWIDTH_BYTES / timer(lambda: words.sum(), repeats) / 1e6
    torch.set_num_threads(1)
    return result


def step_of(weights: list[BlockQuantWeight], rows: int = 1) -> Callable[[], None]:
    inputs = {i: torch.randn(rows, i) for i in (HIDDEN, 1536)}

    def run() -> None:
        for w in weights:
            block_linear(inputs[w.in_features], w)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default=None, help="write the numbers here too")
    parser.add_argument("--rows", default="", help="more row counts to time the step at, e.g. 2,4,5")
    args = parser.parse_args()
    chosen = block_kernels()
    if chosen is None:
        raise SystemExit("no block kernels in this build")
    load_before = os.getloadavg()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    body = [
        quantize_blocks(torch.randn(i, o, generator=gen) * i**-0.5, "q4_1") for _ in range(LAYERS) for i, o in SHAPES
    ]
    head = quantize_blocks(torch.randn(HIDDEN, VOCAB, generator=gen) * HIDDEN**-0.5, "q8_0")
    body_bytes, head_bytes = sum(w.nbytes for w in body), head.nbytes
    one_layer = body[:4] * LAYERS

    result: dict[str, Any] = {"path": chosen[1], "load_before": list(load_before)}
    result["bandwidth_gb_s"] = bw = bandwidth(args.repeats // 3 or 1)
    print(f"path {chosen[1]}; load average before {load_before[0]:.2f}")
    print("bandwidth GB/s: " + ", ".join(f"{k} {v:.1f}" for k, v in bw.items()))

    ms = {
        "step": thread_ms(step_of([*body, head]), args.repeats),
        "body": thread_ms(step_of(body), args.repeats),
        "head": thread_ms(step_of([head]), args.repeats),
        "body_one_layer_x30": thread_ms(step_of(one_layer), args.repeats),
    }
    total = body_bytes + head_bytes
    result["ms_1t_cpu"] = ms
    result["bytes"] = {"body": body_bytes, "head": head_bytes}
    result["gb_s_1t"] = gbs = {
        "step": total / ms["step"] / 1e6,
        "body": body_bytes / ms["body"] / 1e6,
        "head": head_bytes / ms["head"] / 1e6,
        "body_one_layer_x30": body_bytes / ms["body_one_layer_x30"] / 1e6,
    }
    print(f"1 row, 1 thread, CPU ms (weights {total / 1e6:.1f} MB: body {body_bytes / 1e6:.1f}, head "
          f"{head_bytes / 1e6:.1f}):")  # fmt: skip
    for name in ms:
        print(f"  {name:20} {ms[name]:7.2f} ms  {gbs[name]:6.1f} GB/s")

    tiny = quantize_blocks(torch.randn(HIDDEN, 4, generator=gen), "q4_1")
    x = torch.randn(1, HIDDEN)
    calls = 200
    per_call = thread_ms(lambda: [block_linear(x, tiny) for _ in range(calls)], args.repeats) / calls * 1e3
    result["call_us"] = per_call
    print(f"one call without a weight stream (1 x 576 by a 4-column weight): {per_call:.2f} us")

    if args.rows:
        by_rows = {int(r): thread_ms(step_of([*body, head], int(r)), args.repeats) for r in args.rows.split(",")}
        result["ms_1t_cpu_by_rows"] = by_rows
        print("step at more rows, 1 thread, CPU ms: " + ", ".join(f"{r} rows {v:.2f}" for r, v in by_rows.items()))

    step = step_of([*body, head])
    wall = {}
    for threads in (1, 2, 1, 2):  # alternated, best of both rounds
        torch.set_num_threads(threads)
        wall[threads] = min(wall.get(threads, float("inf")), wall_ms(step, args.repeats))
    torch.set_num_threads(1)
    load_after = os.getloadavg()
    result["wall_ms"] = {"1t": wall[1], "2t": wall[2], "scaling": wall[1] / wall[2]}
    result["load_after"] = list(load_after)
    print(f"step wall ms: 1 thread {wall[1]:.2f}, 2 threads {wall[2]:.2f} ({wall[1] / wall[2]:.2f}x); "
          f"load average after {load_after[0]:.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
