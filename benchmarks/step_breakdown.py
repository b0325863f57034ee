"""Where a batch-1 decode step's CPU time goes outside the linear products: the model (all layers, LM head, argmax)
on one thread, 96 cached tokens, per quantization mode ("fp32", "int8", "gguf", "q8_0", "q4_0").

Prints per mode: the load's CPU time; the step's thread CPU time (`time.thread_time_ns`, best of 40 per round:
robust on a shared machine, unlike wall time), with the products untimed; then, in a second pass with them timed,
the share in the linear products (every `linear` / `int8_matmul` / `block_linear` / `fused_block_linear` call the
model makes from Python, activation quantization included; a fused call's RMSNorm or SiLU x mul and residual add
count as products too; the wrappers add about 1 us per call); torch ops per step (all, and the top-level ones, per
layer); Python-level calls per step (`sys.setprofile`: Python frames and C functions such as the row kernels, which
the torch profiler does not see). Block and int8 modes are measured both ways in alternating rounds: with the
per-layer kernel calls and with the decode stack (every layer of a decode-only step in one call,
`model/decode_stack.py`: its products are inside that call, so its "products" are the LM head's).
Then, unless `--no-wall`, the step's wall time at 2 threads (fastest and median of 40) beside the load average: on
a shared machine only a quiet run's wall figures mean much. About a minute per mode.

`--shared-weights`: every layer runs layer 0's weights (`share_first_layer`), to compare ways of running a step
outside the weight stream with little noise from memory traffic.

    .venv/bin/python benchmarks/step_breakdown.py [--rounds 3] [--no-wall] [--shared-weights] [gguf int8 ...]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import asyncllm.model.llama as llama
from asyncllm.config import ModelConfig
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.llama_weights import LINEAR_WEIGHTS
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


def best_step(step: Callable[[], torch.Tensor], runs: int = 40) -> tuple[int, int]:
    """(thread CPU ns of the fastest of `runs` steps, ns of it inside the timed products)."""
    best, best_products = 1 << 62, 0
    for _ in range(runs):
        PRODUCT_NS[0] = 0
        start_ns = time.thread_time_ns()
        step()
        elapsed = time.thread_time_ns() - start_ns
        if elapsed < best:
            best, best_products = elapsed, PRODUCT_NS[0]
    return best, best_products


def wall_steps(step: Callable[[], torch.Tensor], runs: int = 40) -> tuple[float, float]:
    """(fastest, median) wall ms of `runs` steps."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times), statistics.median(times)


def counts(model: Any, step: Callable[[], torch.Tensor]) -> str:
    frames, c_calls = python_calls(step)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    events = prof.events()
    top_level = sum(e.cpu_parent is None for e in events) / 5
    layers = model.arch.num_hidden_layers
    return (
        f"torch ops {len(events) // 5} (top-level {top_level:.0f}, {top_level / layers:.1f} per layer); "
        f"Python frames {frames}, C calls {c_calls}"
    )


def share_first_layer(model: Any) -> None:
    """Every layer's linear weights become layer 0's (the same tensors): a step streams one layer's ~2.2 MB 30 times,
    from the caches, so what differs between two ways of running it is their cost outside the weight stream, and
    memory traffic from other processes moves it far less. The model's values are no longer the checkpoint's."""
    first = model.layers[0]
    for layer in model.layers[1:]:
        for name in LINEAR_WEIGHTS:
            setattr(layer, name, getattr(first, name))


def measure(mode: str, path: str, rounds: int, wall: bool, shared: bool) -> str:
    """One mode's lines: per variant (block and int8 modes: the per-layer calls, then the one-call decode stack),
    the step's 1-thread CPU time (best of 40 per round, `rounds` alternating rounds), its op and call counts, and
    with `wall` the wall time at 2 threads (fastest and median of 40, beside the load average)."""
    torch.set_num_threads(1)
    start = time.process_time()
    config = ModelConfig(model=path, model_path=path, quantization=None if mode == "fp32" else mode)
    model = load_model(config, pack_weights=True)
    if shared:
        share_first_layer(model)
    load_s = time.process_time() - start
    step = decode_step(model)
    variants = {"per-layer calls": False, "decode stack": True} if mode != "fp32" else {"": True}
    cpu: dict[str, list[tuple[int, int]]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fused in variants.items():
            model.fuse_decode_layers = fused
            for _ in range(5):
                step()
            total, _ = best_step(step)  # untimed products: the step as it runs
            set_timing(True)
            _, products = best_step(step)
            set_timing(False)
            cpu[name].append((total, products))
    lines = [f"{mode}{' (every layer with layer 0 weights)' if shared else ''}: load {load_s:.2f} s CPU"]
    for name, fused in variants.items():
        model.fuse_decode_layers = fused
        rounds = " / ".join(f"{b / 1e6:.2f} (products {p / 1e6:.2f})" for b, p in cpu[name])
        lines.append(f"  {name or mode} 1 thread: step ms CPU {rounds}; {counts(model, step)}")
    torch.set_num_threads(2)
    for name, fused in variants.items() if wall else ():
        model.fuse_decode_layers = fused
        for _ in range(5):
            step()
        fastest, median = wall_steps(step)
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        lines.append(
            f"  {name or mode} 2 threads: step wall ms fastest {fastest:.2f}, median {median:.2f} (load {load})"
        )
    torch.set_num_threads(1)
    return "\n".join(lines)


ORIGINALS = {n: getattr(llama, n) for n in ("linear", "int8_matmul", "block_linear", "fused_block_linear")}
TIMED = {n: timed(fn) for n, fn in ORIGINALS.items()}


def set_timing(on: bool) -> None:
    """The model's product functions timed (the products' share; ~1 us per call more) or as they are."""
    for name, fn in (TIMED if on else ORIGINALS).items():
        setattr(llama, name, fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modes", nargs="*", default=["fp32", "int8", "gguf"])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of best-of-40 per variant")
    parser.add_argument("--no-wall", action="store_true", help="skip the 2-thread wall times")
    parser.add_argument("--shared-weights", action="store_true", help="every layer uses layer 0's weights (in cache)")
    args = parser.parse_args()
    path = str(resolve_model_path("smollm2-135m-instruct"))
    for mode in args.modes:
        print(measure(mode, path, args.rounds, not args.no_wall, args.shared_weights), flush=True)


if __name__ == "__main__":
    main()
