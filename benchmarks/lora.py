"""Generation tokens/s at 32 streams with 0, 1 and 4 distinct LoRA adapters, measured in the same run.

One engine (process mode, `enable_lora=True, max_loras=4`) serves three workloads of 32 requests in flight at
once (same prompts, greedy, `max_tokens` fixed, EOS ignored): every request on the base model (0 adapters), every
request on one adapter, and the requests spread round-robin over 4 adapters (each step then adds 4 adapters'
deltas, by row groups). The adapters are random PEFT rank-`--rank` adapters on all seven linear modules, written to
a temporary directory; each is loaded once before timing (warm-up). The workloads take turns, `--rounds` times,
and the best round of each counts (the machine is shared). Prints tokens/s, the ratio to 0 adapters, and the load
average (`os.getloadavg`) before and after.

    .venv/bin/python benchmarks/lora.py [--streams 32] [--max-tokens 32] [--rank 8] [--rounds 2] [--num-threads N]
        [--quantization auto|none]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import tempfile
import time

import torch
from safetensors.torch import save_file

from asyncllm import AsyncLLM, EngineArgs, LoRARequest, SamplingParams
from asyncllm.lora.peft import MODULE_PATHS, model_module_shapes
from asyncllm.model.loading.loader import read_arch_config
from asyncllm.model.loading.resolve import resolve_model_path

PROMPTS = [
    "Tell me a short story about a dragon who learns to bake.",
    "Explain what a CPU does.",
    "Give me five tips for learning a new language.",
    "Why is the sky blue?",
    "Describe a perfect weekend in the mountains.",
    "What are the benefits of regular exercise?",
    "Write a short poem about autumn.",
    "How do airplanes stay in the air?",
]


def write_adapter(directory: pathlib.Path, model: str, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter (rank `rank`, alpha 2 * rank) on every linear module of every layer."""
    arch = read_arch_config(model)
    shapes = model_module_shapes(
        arch.hidden_size, arch.intermediate_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    )
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for path in MODULE_PATHS.values():
            in_features, out_features = shapes[path]
            key = f"base_model.model.model.layers.{layer}.{path}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    directory.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULE_PATHS)}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))


async def run_workload(llm: AsyncLLM, adapters: list[LoRARequest | None], streams: int, max_tokens: int) -> float:
    """Generated tokens / wall seconds of `streams` requests at once; request i uses adapters[i % len]."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int) -> int:
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        out = await llm.chat(messages, params, request_id=f"r{i}", lora_request=adapters[i % len(adapters)])
        return len(out.outputs[0].token_ids)

    start = time.perf_counter()
    num_tokens = sum(await asyncio.gather(*(one(i) for i in range(streams))))
    return num_tokens / (time.perf_counter() - start)


async def main(args: argparse.Namespace) -> None:
    model = str(resolve_model_path("smollm2-135m-instruct"))
    root = pathlib.Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = []
    for i in range(1, 5):
        write_adapter(root / f"a{i}", model, args.rank, seed=i)
        adapters.append(LoRARequest(f"a{i}", i, str(root / f"a{i}")))
    workloads: dict[str, list[LoRARequest | None]] = {"0": [None], "1": adapters[:1], "4": adapters}
    engine_args = EngineArgs(
        model=model, enable_lora=True, max_loras=4, max_lora_rank=args.rank, num_threads=args.num_threads,
        quantization=args.quantization,
        max_num_seqs=args.streams, num_kv_blocks=512, max_model_len=512,
    )  # fmt: skip
    load_before = os.getloadavg()
    async with AsyncLLM.create(engine_args) as llm:
        await run_workload(llm, [None, *adapters], 5, 4)  # warm-up: every adapter loaded once
        best = dict.fromkeys(workloads, 0.0)
        for _ in range(args.rounds):
            for name, chosen in workloads.items():
                best[name] = max(best[name], await run_workload(llm, chosen, args.streams, args.max_tokens))
    load_after = os.getloadavg()
    print(f"{args.streams} streams, max_tokens={args.max_tokens}, rank {args.rank}, best of {args.rounds} rounds")
    print(f"{'adapters':>8} {'tok/s':>8} {'ratio to 0':>10}")
    for name, tps in best.items():
        print(f"{name:>8} {tps:>8.1f} {tps / best['0']:>9.2f}x")
    print(f"load average (1, 5, 15 min) before: {load_before}, after: {load_after}; cores: {os.cpu_count()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--quantization", default="auto", help='"auto" (the default model\'s own blocks) or "none"')
    asyncio.run(main(parser.parse_args()))
