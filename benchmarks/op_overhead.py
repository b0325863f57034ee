"""Why a decode step's small ops cost more inside the step than alone (issue 17's "where the time goes").

The default model with int8 weights, on `--threads` threads (2 by default, as the engine runs):
1. One RMSNorm on `[1, hidden_size]`: in a loop alone, right after an int8 product (a layer's gate/up weight,
   1.7 MB), and right after an elementwise op over 16 MB.
2. The MLP half of every layer (RMSNorm, row quantizing, gate/up product, SiLU(gate) * up, row quantizing, down
   product, residual add), at 1 and 32 rows: only the int8 products back to back, only the other ops back to
   back, both interleaved as the eager model ran them, and interleaved with the fused kernels the int8 model
   runs now (`model/kernels/row_kernels.py`, where they build).
Times are wall clock per call (microseconds) or per pass over all layers (milliseconds), best of 5 rounds.
Prints the numbers and writes JSON; not part of `make bench` (about one minute).

    .venv/bin/python benchmarks/op_overhead.py [--threads N] [--json PATH]
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
import torch.nn.functional as F
from throughput import machine_info  # benchmarks/ is on sys.path when run as a script

from asyncllm.config import ModelConfig
from asyncllm.model.kernels.int8 import Int8Weight, int8_matmul
from asyncllm.model.kernels.row_kernels import RowKernels, load_kernels
from asyncllm.model.kernels.row_quant import quantize_rows
from asyncllm.model.llama import LlamaDecoderLayer, rms_norm
from asyncllm.model.loading.loader import load_model
from asyncllm.model.loading.resolve import resolve_model_path


def best_seconds(fn: Callable[[], object], calls: int, rounds: int = 5) -> float:
    """Best over `rounds` of the mean wall time of `calls` calls of `fn`, in seconds (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def int8_weights(layer: LlamaDecoderLayer) -> tuple[Int8Weight, Int8Weight]:
    gate_up, down = layer.gate_up_proj, layer.down_proj
    if not (isinstance(gate_up, Int8Weight) and isinstance(down, Int8Weight)):
        raise TypeError("the model was not loaded with int8 weights")
    return gate_up, down


def norm_after(layers: list[LlamaDecoderLayer], eps: float) -> dict[str, float]:
    """Microseconds per RMSNorm call: alone, after an int8 product, after a 16 MB elementwise op."""
    hidden = torch.randn(1, layers[0].arch.hidden_size)
    qx = torch.zeros(1, layers[0].arch.hidden_size, dtype=torch.int8)
    big = torch.randn(4_000_000)
    weight = layers[0].post_attention_norm
    result = {}
    for case in ("alone", "after an int8 product", "after a 16 MB op"):
        spent = 0.0
        for _ in range(100):
            for layer in layers:
                if case == "after an int8 product":
                    int8_matmul(qx, int8_weights(layer)[0])
                elif case == "after a 16 MB op":
                    big.mul(2.0)
                start = time.perf_counter()
                rms_norm(hidden, weight, eps)
                spent += time.perf_counter() - start
        result[case] = spent / (100 * len(layers)) * 1e6
    return result


def mlp_passes(layers: list[LlamaDecoderLayer], rows: int, eps: float) -> dict[str, float]:
    """Milliseconds per pass over every layer's MLP half: products only, other ops only, interleaved (eager and
    with the fused kernels)."""
    hidden_size, inter = layers[0].arch.hidden_size, layers[0].inter_size
    hidden = torch.randn(rows, hidden_size)
    q_in, q_act = torch.zeros(rows, hidden_size, dtype=torch.int8), torch.zeros(rows, inter, dtype=torch.int8)
    gate_up_out, down_out = torch.randn(rows, 2 * inter), torch.randn(rows, hidden_size)

    def products() -> None:
        for layer in layers:
            gate_up, down = int8_weights(layer)
            int8_matmul(q_in, gate_up)
            int8_matmul(q_act, down)

    def mlp(with_products: bool) -> torch.Tensor:
        h = hidden
        for layer in layers:
            gate_up, down = int8_weights(layer)
            qx, scale = quantize_rows(rms_norm(h, layer.post_attention_norm, eps))
            gu = (int8_matmul(qx, gate_up) if with_products else gate_up_out.clone()).mul_(scale)
            gate, up = gu.chunk(2, dim=-1)
            qx, scale = quantize_rows(F.silu(gate) * up)
            h = h + (int8_matmul(qx, down) if with_products else down_out.clone()).mul_(scale)
        return h

    def fused_mlp(kernels: RowKernels) -> torch.Tensor:
        h = hidden
        for layer in layers:
            gate_up, down = int8_weights(layer)
            qx, scale = kernels.rms_norm_quantize(h, layer.post_attention_norm, eps)
            qx, scale = kernels.silu_mul_quantize(int8_matmul(qx, gate_up), scale)
            h = kernels.add_scaled_(h, int8_matmul(qx, down), scale)
        return h

    result = {
        "products only": best_seconds(products, 20) * 1e3,
        "other ops only": best_seconds(lambda: mlp(False), 20) * 1e3,
        "interleaved": best_seconds(lambda: mlp(True), 20) * 1e3,
    }
    kernels = load_kernels()
    if kernels is not None:  # the model's int8 path: the same values in 3 fused calls per MLP half
        result["interleaved, fused kernels"] = best_seconds(lambda: fused_mlp(kernels), 20) * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="benchmarks/results/op_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model_path(args.model))
    model = load_model(ModelConfig(model=args.model, model_path=path, quantization="int8"), pack_weights=True)
    layers, eps = list(model.layers), model.arch.rms_norm_eps
    result: dict[str, Any] = {"benchmark": "op_overhead", "machine": machine_info(), "threads": args.threads}
    result["load_before"] = list(os.getloadavg())
    with torch.inference_mode():
        result["rms_norm_us"] = norm_after(layers, eps)
        print("RMSNorm, 1 row (us per call): " + ", ".join(f"{k} {v:.1f}" for k, v in result["rms_norm_us"].items()))
        for rows in (1, 32):
            result[f"mlp_half_{rows}_rows_ms"] = passes = mlp_passes(layers, rows, eps)
            summed = passes["products only"] + passes["other ops only"]
            print(
                f"MLP half of {len(layers)} layers, {rows} rows (ms per pass): "
                + ", ".join(f"{k} {v:.2f}" for k, v in passes.items())
                + f"; interleaved / (products + other ops) = {passes['interleaved'] / summed:.2f}",
                flush=True,
            )
    result["load_after"] = list(os.getloadavg())
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
