"""The linear kernels of `model/kernels/int8.py` and `model/kernels/fp32.py`, each forced, and the chooser's pick.

The model's linear layers and LM head alone (SmolLM2-135M's fused shapes, 30 distinct layers so the weights
stream from memory as in a real step, random values), at 1-128 rows per step, with every kernel asyncllm can run:
float32 `x @ W` (MKL sgemm on the plain weight), oneDNN's inner product on a weight reordered once
(`torch.ops.mkldnn._linear_pointwise`) and MKL's packed GEMM on a weight packed once (`cblas_sgemm_compute`, through
the row-kernel module) and our GEMV; int8 weights with per-row int8 activations through `torch._int_mm`, oneDNN's
prepacked int8 kernel (`torch.ops.onednn.qlinear_pointwise`) and our AVX2 and AVX-512 VNNI kernels
(`csrc/int8_gemm.cpp`); and "chosen", the kernels `model/kernels/choice.py` picks on this host per row class
(printed). A kernel 20x slower than the fastest at one row (oneDNN's reference int8 kernel on AVX-512 CPUs without
AMX) is dropped after one pass, and the JSON says so. tok/s = rows / wall time of one pass, best of `--repeats`
interleaved passes, torch's default threads.

    .venv/bin/python benchmarks/linear_kernels.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

import torch
from throughput import machine_info  # benchmarks/ is on sys.path when run as a script

from asyncllm.model.kernels.choice import KernelChooser
from asyncllm.model.kernels.fp32 import FP32_PRODUCT, fp32_chooser, pack_fp32
from asyncllm.model.kernels.int8 import INT8_PRODUCT, int8_chooser, quantize_int8
from asyncllm.model.kernels.linear import linear

HIDDEN, LAYERS, VOCAB = 576, 30, 49152
SHAPES = [(HIDDEN, 960), (HIDDEN, HIDDEN), (HIDDEN, 3072), (1536, HIDDEN)]  # qkv, o, gate_up, down ([in, out])
ROWS = (1, 2, 4, 8, 32, 64, 128)
CRAWL_FACTOR = 20  # a kernel this much slower than the fastest at one row is a reference kernel: not timed further


def build_weights() -> tuple[dict[str, list[Any]], dict[str, str]]:
    """Per kernel, the 121 weights of one step (30 layers x 4 fused linears + LM head), and the chooser's picks."""
    gen = torch.Generator().manual_seed(0)
    plain = [torch.randn(i, o, generator=gen) * i**-0.5 for _ in range(LAYERS) for i, o in SHAPES]
    plain.append(torch.randn(HIDDEN, VOCAB, generator=gen) * HIDDEN**-0.5)
    weights: dict[str, list[Any]] = {}
    for candidate in FP32_PRODUCT.candidates:
        if candidate.available():
            forced = KernelChooser(FP32_PRODUCT, forced=candidate.name)
            weights[f"fp32 {candidate.name}"] = [pack_fp32(w, forced) for w in plain]
    weights["fp32 chosen"] = [pack_fp32(w, fp32_chooser()) for w in plain]
    for candidate in INT8_PRODUCT.candidates:
        if candidate.available():
            forced_int8 = KernelChooser(INT8_PRODUCT, forced=candidate.name)
            weights[f"int8 {candidate.name}"] = [quantize_int8(w, forced_int8) for w in plain]
    weights["int8 chosen"] = [quantize_int8(w, int8_chooser()) for w in plain]
    return weights, {"fp32": fp32_chooser().describe(), "int8": int8_chooser().describe()}


def one_pass(weights: list[Any], rows: int) -> Callable[[], None]:
    inputs = {i: torch.randn(rows, i) for i in (HIDDEN, 1536)}

    def run() -> None:
        for w in weights:
            linear(inputs[w.shape[0]], w)

    return run


def drop_crawling(kernels: dict[str, list[Any]]) -> dict[str, float]:
    """Removes from `kernels` each kernel whose one-row pass takes over `CRAWL_FACTOR` x the fastest one's; returns
    {name: seconds of that pass}. A reference kernel (oneDNN's int8 on AVX-512 CPUs without AMX, docs/kernels.md)
    takes 100-500x longer and would hold the benchmark for hours; the chooser never picks it."""
    seconds = {}
    for name, weights in kernels.items():
        run = one_pass(weights, 1)
        run()  # first call: one-off set-up
        start = time.perf_counter()
        run()
        seconds[name] = time.perf_counter() - start
    fastest = min(seconds.values())
    dropped = {name: s for name, s in seconds.items() if s > CRAWL_FACTOR * fastest}
    for name, s in dropped.items():
        print(f"dropped {name}: {s * 1e3:.0f} ms a one-row pass, {s / fastest:.0f}x the fastest kernel's")
        del kernels[name]
    return dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/linear_kernels.json")
    args = parser.parse_args()
    kernels, chosen = build_weights()
    result: dict[str, Any] = {"benchmark": "linear_kernels", "machine": machine_info(), "rows": list(ROWS)}
    result["chosen"] = chosen
    result["dropped"] = drop_crawling(kernels)
    result["tok_per_s"] = {name: {} for name in kernels}
    for rows in ROWS:
        passes = {name: one_pass(weights, rows) for name, weights in kernels.items()}
        best = dict.fromkeys(passes, float("inf"))
        for _ in range(args.repeats):  # interleaved, so a burst of load hits every kernel alike
            for name, run in passes.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
        for name, seconds in best.items():
            result["tok_per_s"][name][str(rows)] = rows / seconds
    result["load_after"] = list(os.getloadavg())
    for kind, line in chosen.items():
        print(f"chosen {kind}: {line}")
    print(f"{'kernel':34}" + "".join(f"{r:>9}" for r in ROWS))
    for name, by_rows in result["tok_per_s"].items():
        print(f"{name:34}" + "".join(f"{by_rows[str(r)]:9.0f}" for r in ROWS))
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
