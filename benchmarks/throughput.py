"""Generated tokens/s of asyncllm (fp32, int8 and the default weights) at 1, 8, 32 and 64 concurrent streams, next
to HF `transformers` `generate` on the same model, prompts and token counts, measured in this run, with the ratio.

The default is what `EngineArgs(quantization="auto")` gives the checkpoint (a GGUF whose layers are blocks keeps
them: "gguf", the default model's Q4_1 file; `model/loading/quant_choice.py`). When it resolves to float32 weights
the default column is the fp32 one and no third engine is loaded.

Every request streams `--max-tokens` new tokens (greedy, EOS ignored). asyncllm runs as a user runs it
(`AsyncLLM` with its engine process, default thread policy); HF runs one padded batch of the same prompts in
this process with torch's default threads. `--contended` measures everything a second time with one
CPU-bound process (`while True: pass`) running beside it and adds the contended / quiet ratio. The machine
(CPU model, flags that matter, cores, load average before and after) is printed and stored in the JSON.

The asyncllm engines and the HF model stay loaded for the whole run, and each stream count is measured on all
of them one right after the other, in `--rounds` rounds (default 3): a shared machine's speed drifts by 20-30%
over minutes, and this way every ratio compares runs made under the same conditions. The tables show each
configuration's median over the rounds; the JSON keeps every round's value.

    .venv/bin/python benchmarks/throughput.py [--model NAME|PATH] [--quick] [--contended] [--rounds N] [--json PATH]

`--model` takes a known name, a `.gguf` file or an HF directory of any supported family (Llama, Qwen2.5, Qwen3,
Phi-3; `benchmarks/random_checkpoint.py` writes random-weight ones with published shapes); HF loads the same file
or directory. `--max-model-len` caps the engines' sequence length (needed for LongRoPE or sliding-window checkpoints
whose limit is below the model's context).

Needs the dev extra (transformers + accelerate) for the reference column (`--skip-hf` to run without).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from asyncllm import AsyncLLM, EngineArgs, SamplingParams
from asyncllm.model.loading.resolve import resolve_model_path

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


def run_transformers_best(hf: tuple[Any, Any], prompts: list[str], max_tokens: int, contended: bool) -> float:
    """HF `generate` at torch's default threads, and when `contended` also at 1 thread: the better tokens/s (the
    reference at its best setting for the condition; the thread count that won is printed)."""
    default = torch.get_num_threads()
    best, best_threads = 0.0, default
    for threads in sorted({default, 1} if contended else {default}):
        torch.set_num_threads(threads)
        try:
            tok_s = run_transformers(*hf, prompts, max_tokens)
        finally:
            torch.set_num_threads(default)
        if tok_s > best:
            best, best_threads = tok_s, threads
    if contended:
        print(f"  HF fp32 best at {best_threads} thread(s): {best:.1f} tok/s", flush=True)
    return best


def load_transformers(path: str) -> tuple[Any, Any]:
    """HF's tokenizer and float32 model of a `.gguf` file or an HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = pathlib.Path(path)
    if p.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(p)
        return AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval(), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
    return model, tokenizer


async def settle(llm: AsyncLLM, max_streams: int) -> None:
    """A short run at the most streams, so the thread policy has measured the current load before timing."""
    await run_asyncllm(llm, make_prompts(max_streams), 4)


async def measure_round(
    engines: dict[str, AsyncLLM], hf: tuple[Any, Any] | None, streams: list[int], max_tokens: int, mode: str
) -> dict[str, dict[int, float]]:
    """One round of one mode: for each stream count, every asyncllm engine and then HF, one after the other (so
    all see the same machine state). Returns {engine name ("fp32", "int8", "default") | "hf": {streams: tok/s}}."""
    result: dict[str, dict[int, float]] = {name: {} for name in [*engines, *(["hf"] if hf else [])]}
    with cpu_hog(mode == "contended"):
        for llm in engines.values():
            await settle(llm, max(streams))
        for n in streams:
            for name, llm in engines.items():
                result[name][n] = await run_asyncllm(llm, make_prompts(n), max_tokens)
            if hf is not None:
                # on the event loop's thread, as HF runs alone (the engines are idle; a thread measured ~5% slower);
                # beside the hog at its best thread count, as asyncllm's thread policy adapts its own
                result["hf"][n] = run_transformers_best(hf, make_prompts(n), max_tokens, mode == "contended")
            print(f"{mode} {n} streams: " + ", ".join(f"{k} {v[n]:.1f}" for k, v in result.items()), flush=True)
    return result


ENGINES: dict[str, str | None] = {"fp32": None, "int8": "int8", "default": "auto"}  # name -> EngineArgs.quantization


def default_quantization(path: str, max_model_len: int | None) -> tuple[str | None, str]:
    """What `quantization="auto"` resolves to for this checkpoint (None: float32 weights), and the reason logged."""
    model = EngineArgs(model=path, max_model_len=max_model_len).create_engine_config().model
    return model.quantization, model.quantization_reason


async def measure(
    path: str,
    streams: list[int],
    max_tokens: int,
    modes: list[str],
    rounds: int,
    with_hf: bool,
    max_model_len: int | None = None,
) -> tuple[dict[str, dict[str, dict[int, list[float]]]], dict[str, str]]:
    """Every round of every mode, {engine: {mode: {streams: [tok/s of each round]}}} for fp32, int8, the default
    (unless it is float32) and hf, and the linear kernels each asyncllm engine runs ({"fp32": log line, ...})."""
    hf = load_transformers(path) if with_hf else None
    if hf is not None:
        run_transformers(*hf, make_prompts(2), 4)  # warm-up
    samples: dict[str, dict[str, dict[int, list[float]]]] = {}
    kernels: dict[str, str] = {}
    names = [name for name in ENGINES if name != "default" or default_quantization(path, max_model_len)[0]]
    async with contextlib.AsyncExitStack() as stack:
        engines = {}
        for name in names:
            args = EngineArgs(
                model=path, quantization=ENGINES[name], max_num_seqs=max(streams), max_model_len=max_model_len
            )
            engines[name] = await stack.enter_async_context(AsyncLLM.create(args))
            kernels[name] = (await engines[name].collective_rpc("linear_kernels"))[0]
            await run_asyncllm(engines[name], make_prompts(2), 8)  # warm-up
        for _ in range(rounds):
            for mode in modes:
                for name, by_streams in (await measure_round(engines, hf, streams, max_tokens, mode)).items():
                    for n, value in by_streams.items():
                        samples.setdefault(name, {}).setdefault(mode, {}).setdefault(n, []).append(value)
    return samples, kernels


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(f"\nmachine: {m['cpu']}, {m['cores']} cores, flags {' '.join(m['flags'])}, torch {m['torch']}")
    print(f"load average before {result['load_before']}, after {result['load_after']}")
    print(f"{result['max_tokens']} new tokens per stream, greedy; tok/s = generated tokens per second, all streams")
    print(f"default weights: {result['default_quantization']['reason']}")
    for name, kernels in result.get("linear_kernels", {}).items():
        print(f"asyncllm {name} kernels: {kernels}")
    names = list(result["asyncllm"])
    for mode in result["modes"]:
        print(f"\n[{mode}]")
        print(f"{'streams':>8} {'HF fp32':>9}" + "".join(f" {'ours ' + q:>13} {'ratio':>6}" for q in names))
        for n in result["streams"]:
            hf = result["transformers"].get(mode, {}).get(n)
            row = f"{n:>8} {hf:9.1f}" if hf else f"{n:>8} {'-':>9}"
            for q in names:
                ours = result["asyncllm"][q][mode][n]
                row += f" {ours:13.1f} {ours / hf:6.2f}" if hf else f" {ours:13.1f} {'-':>6}"
            print(row)
    if "contended" in result["modes"]:
        print("\ncontended / quiet")
        print(f"{'streams':>8} {'HF fp32':>9}" + "".join(f" {'ours ' + q:>13}" for q in names))
        for n in result["streams"]:
            cells = []
            for table in (result["transformers"], *(result["asyncllm"][q] for q in names)):
                cells.append(f"{table['contended'][n] / table['quiet'][n]:.2f}" if table else "-")
            print(f"{n:>8} {cells[0]:>9}" + "".join(f" {c:>13}" for c in cells[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--quick", action="store_true", help="64 new tokens per stream (finishes in minutes)")
    parser.add_argument("--contended", action="store_true", help="also measure beside one CPU-bound process")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all measurements; the tables show medians")
    parser.add_argument("--json", default="benchmarks/results/throughput.json")
    parser.add_argument("--max-model-len", type=int, help="the engines' longest sequence, tokens")
    args = parser.parse_args()
    max_tokens = 64 if args.quick else args.max_tokens
    path = str(resolve_model_path(args.model))
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "machine": machine_info(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "model": path,
        "max_tokens": max_tokens,
        "streams": args.streams,
        "modes": ["quiet", "contended"] if args.contended else ["quiet"],
        "asyncllm": {},
        "transformers": {},
    }
    quantization, reason = default_quantization(path, args.max_model_len)
    result["default_quantization"] = {"quantization": quantization or "none", "reason": reason}
    samples, result["linear_kernels"] = asyncio.run(
        measure(path, args.streams, max_tokens, result["modes"], args.rounds, not args.skip_hf, args.max_model_len)
    )
    result["rounds"] = {"count": args.rounds, "samples": samples}
    medians = {name: {m: {n: statistics.median(v) for n, v in by_n.items()} for m, by_n in by_mode.items()}
               for name, by_mode in samples.items()}  # fmt: skip
    result["asyncllm"] = {name: medians[name] for name in ENGINES if name in medians}
    result["transformers"] = medians.get("hf", {})
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print_table(result)
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
