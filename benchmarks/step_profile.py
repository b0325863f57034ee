"""Where a decode step's time goes: the model (all layers, LM head, argmax) on one thread, fp32 and int8, at 1 and
32 decode rows with 96 cached tokens each, profiled with the torch profiler.

CPU time per step (`time.process_time`, best of 25: robust on a shared machine, unlike wall time), the number of
torch ops per step, and the ops with the largest self CPU time.

    .venv/bin/python benchmarks/step_profile.py [--json PATH]
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
from torch.profiler import ProfilerActivity, profile

from asyncllm.config import ModelConfig
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.loading.loader import load_model
from asyncllm.model.loading.resolve import resolve_model_path
from asyncllm.worker.sampler import argmax_rows

BLOCK_SIZE, CONTEXT = 16, 96


def decode_step(model: Any, rows: int) -> Callable[[], torch.Tensor]:
    """A decode step of `rows` sequences with CONTEXT cached tokens each, in its own scratch KV cache."""
    arch = model.arch
    blocks = -(-(CONTEXT + 1) // BLOCK_SIZE)
    shape = (rows * blocks, 2, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
    kv_caches = [torch.zeros(shape) for _ in range(arch.num_hidden_layers)]
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(rows)]

    def step() -> torch.Tensor:
        meta = build_attention_metadata([1] * rows, [CONTEXT + 1] * rows, tables, BLOCK_SIZE)
        hidden = model(torch.zeros(rows, dtype=torch.long), torch.full((rows,), CONTEXT), kv_caches, meta)
        return argmax_rows(model.compute_logits(hidden))

    return step


def profile_step(step: Callable[[], torch.Tensor], top: int = 6) -> dict[str, Any]:
    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(25):
        start = time.process_time()
        step()
        best = min(best, time.process_time() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "cpu_ms": best * 1e3,
        "ops": sum(e.count for e in events) // 5,
        "top": [[e.key, round(100 * e.self_cpu_time_total / total, 1), e.count] for e in ranked],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--json", default="benchmarks/results/step_profile.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = str(resolve_model_path(args.model))
    result: dict[str, Any] = {"benchmark": "step_profile", "load_before": list(os.getloadavg()), "steps": {}}
    for quantization in (None, "int8"):
        model = load_model(ModelConfig(model=args.model, model_path=path, quantization=quantization), pack_weights=True)
        for rows in (1, 32):
            name = f"{quantization or 'fp32'}, {rows} rows"
            result["steps"][name] = entry = profile_step(decode_step(model, rows))
            top = ", ".join(f"{op} {share}%" for op, share, _ in entry["top"])
            print(f"{name}: {entry['cpu_ms']:.1f} ms CPU, {entry['ops']} ops; {top}", flush=True)
    result["load_after"] = list(os.getloadavg())
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
