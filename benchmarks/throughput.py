"""Generated tokens/s of asyncllm (fp32 and int8) at 1, 8, 32 and 64 concurrent streams, next to HF
`transformers` `generate` on the same model, prompts and token counts, measured in this run, with the ratio.

Every request streams `--max-tokens` new tokens (greedy, EOS ignored). asyncllm runs as a user runs it
(`AsyncLLM` with its engine process, default thread policy); HF runs one padded batch of the same prompts in
this process with torch's default threads. `--contended` measures everything a second time with one
CPU-bound process (`while True: pass`) running beside it and adds the contended / quiet ratio. The machine
(CPU model, flags that matter, cores, load average before and after) is printed and stored in the JSON.

    .venv/bin/python benchmarks/throughput.py [--quick] [--contended] [--json PATH]

Needs the dev extra (transformers + accelerate) for the reference column (`--skip-hf` to run without).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from asyncllm import AsyncLLM, EngineArgs, SamplingParams
from asyncllm.model.resolve import resolve_model_path

PROMPT_TOPICS = ["the ocean", "a city at night", "an old library", "mountain weather", "a chess game", "bread"]
FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def make_prompts(n: int) -> list[str]:
    return [f"Write a long story about {PROMPT_TOPICS[i % len(PROMPT_TOPICS)]} (version {i})." for i in range(n)]


def machine_info() -> dict[str, Any]:
    """CPU model, the SIMD flags int8/fp32 speed depends on, cores, torch threads and the load average."""
    model, flags = platform.processor(), set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "cpu": model,
        "flags": [f for f in FLAGS if f in flags],
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average": list(os.getloadavg()),
    }


@contextmanager
def cpu_hog(enabled: bool) -> Iterator[None]:
    """Run one CPU-bound process (a busy Python loop) while the block runs; stop it after."""
    if not enabled:
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        hog.kill()
        hog.wait()


async def run_asyncllm(llm: AsyncLLM, prompts: list[str], max_tokens: int) -> float:
    """Stream all prompts concurrently; returns generated tokens per second."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt: str) -> int:
        final = await llm.generate(prompt, params).collect()
        return len(final.outputs[0].token_ids)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts) / (time.perf_counter() - start)


def run_transformers(model: Any, tokenizer: Any, prompts: list[str], max_tokens: int) -> float:
    """HF `generate`, one left-padded batch of all prompts; returns generated tokens per second."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **batch,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    elapsed = time.perf_counter() - start
    return (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts) / elapsed


def load_transformers(path: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = pathlib.Path(path)
    tokenizer = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
    return model, tokenizer


async def measure_asyncllm(
    path: str, quantization: str | None, streams: list[int], max_tokens: int, contended: bool
) -> dict[str, dict[int, float]]:
    """{"quiet": {streams: tok/s}, "contended": {...}} for one engine configuration."""
    args = EngineArgs(model=path, quantization=quantization, max_num_seqs=max(streams))  # type: ignore[arg-type]
    results: dict[str, dict[int, float]] = {}
    async with AsyncLLM.create(args) as llm:
        await run_asyncllm(llm, make_prompts(2), 8)  # warm-up
        for mode in ["quiet", "contended"] if contended else ["quiet"]:
            with cpu_hog(mode == "contended"):
                await run_asyncllm(llm, make_prompts(max(streams)), 4)  # let the thread policy settle
                results[mode] = {}
                for n in streams:
                    results[mode][n] = await run_asyncllm(llm, make_prompts(n), max_tokens)
                    print(
                        f"asyncllm {quantization or 'fp32'} {mode} {n} streams: {results[mode][n]:.1f} tok/s",
                        flush=True,
                    )
    return results


def measure_transformers(
    path: str, streams: list[int], max_tokens: int, contended: bool
) -> dict[str, dict[int, float]]:
    model, tokenizer = load_transformers(path)
    run_transformers(model, tokenizer, make_prompts(2), 4)  # warm-up
    results: dict[str, dict[int, float]] = {}
    for mode in ["quiet", "contended"] if contended else ["quiet"]:
        with cpu_hog(mode == "contended"):
            results[mode] = {}
            for n in streams:
                results[mode][n] = run_transformers(model, tokenizer, make_prompts(n), max_tokens)
                print(f"HF fp32 {mode} {n} streams: {results[mode][n]:.1f} tok/s", flush=True)
    return results


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(f"\nmachine: {m['cpu']}, {m['cores']} cores, flags {' '.join(m['flags'])}, torch {m['torch']}")
    print(f"load average before {result['load_before']}, after {result['load_after']}")
    print(f"{result['max_tokens']} new tokens per stream, greedy; tok/s = generated tokens per second, all streams")
    for mode in result["modes"]:
        print(f"\n[{mode}]")
        print(f"{'streams':>8} {'HF fp32':>9} {'ours fp32':>10} {'ratio':>6} {'ours int8':>10} {'ratio':>6}")
        for n in result["streams"]:
            hf = result["transformers"].get(mode, {}).get(n)
            row = f"{n:>8} {hf:9.1f}" if hf else f"{n:>8} {'-':>9}"
            for q in ("fp32", "int8"):
                ours = result["asyncllm"][q][mode][n]
                row += f" {ours:10.1f} {ours / hf:6.2f}" if hf else f" {ours:10.1f} {'-':>6}"
            print(row)
    if "contended" in result["modes"]:
        print("\ncontended / quiet")
        print(f"{'streams':>8} {'HF fp32':>9} {'ours fp32':>10} {'ours int8':>10}")
        for n in result["streams"]:
            cells = []
            for table in (result["transformers"], result["asyncllm"]["fp32"], result["asyncllm"]["int8"]):
                cells.append(f"{table['contended'][n] / table['quiet'][n]:.2f}" if table else "-")
            print(f"{n:>8} {cells[0]:>9} {cells[1]:>10} {cells[2]:>10}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--quick", action="store_true", help="64 new tokens per stream (finishes in minutes)")
    parser.add_argument("--contended", action="store_true", help="also measure beside one CPU-bound process")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", default="benchmarks/results/throughput.json")
    args = parser.parse_args()
    max_tokens = 64 if args.quick else args.max_tokens
    path = str(resolve_model_path(args.model))
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "machine": machine_info(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "max_tokens": max_tokens,
        "streams": args.streams,
        "modes": ["quiet", "contended"] if args.contended else ["quiet"],
        "asyncllm": {},
        "transformers": {},
    }
    for name, quantization in (("fp32", None), ("int8", "int8")):
        result["asyncllm"][name] = asyncio.run(
            measure_asyncllm(path, quantization, args.streams, max_tokens, args.contended)
        )
    if not args.skip_hf:
        result["transformers"] = measure_transformers(path, args.streams, max_tokens, args.contended)
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print_table(result)
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
