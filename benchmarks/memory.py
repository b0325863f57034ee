"""Resident memory of the engine process (default `AsyncLLM`, engine in its own process), fp32, int8 and the
default weights (`quantization="auto"`: the default model's own Q4_1 blocks): after start, and after 64 requests (64
prompts of the throughput benchmark, 64 greedy tokens each, 16 at a time).

RSS is read from `/proc/<pid>/status` (`VmRSS`) of the engine process, the child this script started; the KV cache
is reserved at start but becomes resident only as requests write into it (README "Memory").

    .venv/bin/python benchmarks/memory.py [--modes fp32,int8,default] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
from typing import Any

from throughput import machine_info, make_prompts  # benchmarks/ is on sys.path when run as a script

from asyncllm import AsyncLLM, EngineArgs, SamplingParams


def child_pids() -> list[int]:
    """Process ids whose parent is this process (Linux `/proc/<pid>/stat`)."""
    children = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid():
                children.append(int(entry.name))
    return children


def rss_mb(pid: int) -> float:
    """`VmRSS` of `pid` in MB (10^6 bytes)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no VmRSS for process {pid}")


MODES: dict[str, str | None] = {"fp32": None, "int8": "int8", "default": "auto"}  # name -> EngineArgs.quantization


async def measure(quantization: str | None) -> dict[str, Any]:
    async with AsyncLLM.create(EngineArgs(quantization=quantization)) as llm:  # type: ignore[arg-type]
        (pid,) = child_pids()
        after_start = rss_mb(pid)
        stats = await llm.get_scheduler_stats()
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        prompts = make_prompts(64)
        for first in range(0, 64, 16):
            await asyncio.gather(*(llm.generate(p, params).collect() for p in prompts[first : first + 16]))
        return {
            "after_start_mb": after_start,
            "after_64_requests_mb": rss_mb(pid),
            "kv_cache_reserved_mb": stats.kv_cache_bytes / 1e6,
            "linear_kernels": (await llm.collective_rpc("linear_kernels"))[0],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="benchmarks/results/memory.json")
    parser.add_argument("--modes", default=",".join(MODES), help="which of fp32, int8, default to measure")
    args = parser.parse_args()
    names = args.modes.split(",")
    result: dict[str, Any] = {"benchmark": "memory", "machine": machine_info()}
    for name in names:
        result[name] = asyncio.run(measure(MODES[name]))
    print(f"{'engine':8} {'after start MB':>15} {'after 64 requests MB':>21} {'KV cache reserved MB':>21}")
    for name in names:
        r = result[name]
        print(
            f"{name:8} {r['after_start_mb']:15.0f} {r['after_64_requests_mb']:21.0f} {r['kv_cache_reserved_mb']:21.0f}"
        )
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
