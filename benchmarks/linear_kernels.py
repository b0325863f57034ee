"""The kernel choice behind `model/quant.py` and `model/packed_fp32.py`, measured on this machine.

The model's linear layers and LM head alone (SmolLM2-135M's fused shapes, 30 distinct layers so the weights
stream from memory as in a real step, random values), at 1-128 rows per step, with each kernel asyncllm could
use: float32 `x @ W` (MKL sgemm on the plain weight) against oneDNN's inner product on a weight reordered once
(`torch.ops.mkldnn._linear_pointwise`) and MKL's packed GEMM on a weight packed once (`cblas_sgemm_compute`,
through the row-kernel module; asyncllm's default where it loads); each packed kernel runs the plain weight for
the row counts `model/packed_fp32.py` gives it (oneDNN: 1-3 and 65+ rows, MKL: 1 row); int8 weights with per-row
int8 activations through `torch._int_mm` against oneDNN's prepacked int8 kernel
(`torch.ops.onednn.qlinear_pointwise`). tok/s = rows / wall time of one pass, best of `--repeats` interleaved
passes, torch's default threads.

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

from asyncllm.model.packed_fp32 import PackedFp32Weight, chunk_columns, mkl_packed_kernels
from asyncllm.model.quant import Int8Weight, linear, quantize_int8

HIDDEN, LAYERS, VOCAB = 576, 30, 49152
SHAPES = [(HIDDEN, 960), (HIDDEN, HIDDEN), (HIDDEN, 3072), (1536, HIDDEN)]  # qkv, o, gate_up, down ([in, out])
ROWS = (1, 2, 4, 8, 32, 64, 128)


def build_weights() -> dict[str, list[Any]]:
    """Per kernel, the 121 weights of one step (30 layers x 4 fused linears + LM head)."""
    gen = torch.Generator().manual_seed(0)
    plain = [torch.randn(i, o, generator=gen) * i**-0.5 for _ in range(LAYERS) for i, o in SHAPES]
    plain.append(torch.randn(HIDDEN, VOCAB, generator=gen) * HIDDEN**-0.5)
    int8 = [quantize_int8(w) for w in plain]
    weights: dict[str, list[Any]] = {
        "fp32 `x @ W`": plain,
        "fp32 oneDNN, reordered weight": [
            PackedFp32Weight(w, torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), None)) for w in plain
        ],
        "int8 `torch._int_mm`": [Int8Weight(w.qweight, w.scale) for w in int8],
        "int8 oneDNN, prepacked weight": int8,
    }
    mkl = mkl_packed_kernels()
    if mkl is not None:  # where it does not load, asyncllm packs for oneDNN
        weights["fp32 MKL packed GEMM"] = [
            PackedFp32Weight(w, mkl.sgemm_pack(w, chunk_columns(w.shape[1])), mkl) for w in plain
        ]
    return weights


def one_pass(weights: list[Any], rows: int) -> Callable[[], None]:
    inputs = {i: torch.randn(rows, i) for i in (HIDDEN, 1536)}

    def run() -> None:
        for w in weights:
            linear(inputs[w.shape[0]], w)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/linear_kernels.json")
    args = parser.parse_args()
    kernels = build_weights()
    result: dict[str, Any] = {"benchmark": "linear_kernels", "machine": machine_info(), "rows": list(ROWS)}
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
    print(f"{'kernel':34}" + "".join(f"{r:>9}" for r in ROWS))
    for name, by_rows in result["tok_per_s"].items():
        print(f"{name:34}" + "".join(f"{by_rows[str(r)]:9.0f}" for r in ROWS))
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
