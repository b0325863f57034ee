"""Serving benchmark: N concurrent streaming HTTP clients against `asyncllm serve`, in a closed loop.

Each of N clients sends streaming chat requests one after the other (`--requests-per-client`, each exactly
`--max-tokens` tokens: EOS ignored) for N in `--concurrency` (default 1, 8, 32, 64). Measured per level:
TTFT (request sent -> first content chunk) p50/p99, ITL (between content chunks of one stream) p50/p99, and total
generated tokens/s (usage counts / wall time). The reference, measured in the same run on the same machine, is the
same closed loop through the Python API (`AsyncLLM.generate`, DELTA outputs) with no HTTP in between; the ratio
column is HTTP tokens/s / API tokens/s (the HTTP layer's cost).

    .venv/bin/python benchmarks/serving.py                                  # starts its own server
    .venv/bin/python benchmarks/serving.py --base-url http://127.0.0.1:8000 --no-reference
    .venv/bin/python benchmarks/serving.py --concurrency 1 8 --json out.json

The load average is printed first: on a shared 2-core machine other processes move these numbers a lot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from asyncllm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams

PROMPTS = [
    "Tell me about the history of bread.",
    "Explain how a bicycle works.",
    "Describe a walk in a forest.",
    "What makes a good cup of tea?",
]


@dataclass
class StreamTiming:
    """One request: seconds to the first chunk, seconds between later chunks, tokens generated."""

    ttft: float
    itls: list[float]
    num_tokens: int


@dataclass
class LevelResult:
    """One concurrency level of one path (HTTP or API)."""

    path: str
    concurrency: int
    num_requests: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    timings: list[StreamTiming] = field(default_factory=list, repr=False)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation (`statistics.quantiles`, inclusive)."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(q) - 1))]


def summarize(path: str, concurrency: int, wall_s: float, timings: list[StreamTiming]) -> LevelResult:
    ttfts = [t.ttft for t in timings]
    itls = [x for t in timings for x in t.itls]
    tokens = sum(t.num_tokens for t in timings)
    return LevelResult(
        path=path,
        concurrency=concurrency,
        num_requests=len(timings),
        wall_s=wall_s,
        tokens_per_s=tokens / wall_s,
        ttft_p50_ms=1e3 * percentile(ttfts, 50),
        ttft_p99_ms=1e3 * percentile(ttfts, 99),
        itl_p50_ms=1e3 * percentile(itls, 50),
        itl_p99_ms=1e3 * percentile(itls, 99),
    )


def chunk_times(start: float, times: list[float]) -> tuple[float, list[float]]:
    return times[0] - start, [b - a for a, b in itertools.pairwise(times)]


# ---- HTTP path ---------------------------------------------------------------------------------------------


async def http_stream(http: httpx.AsyncClient, base_url: str, prompt: str, max_tokens: int) -> StreamTiming:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    times: list[float] = []
    num_tokens = 0
    async with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
    ttft, itls = chunk_times(start, times)
    return StreamTiming(ttft, itls, num_tokens)


async def run_http_level(base_url: str, concurrency: int, args: argparse.Namespace) -> LevelResult:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:

        async def client(i: int) -> list[StreamTiming]:
            prompts = [PROMPTS[(i + k) % len(PROMPTS)] for k in range(args.requests_per_client)]
            return [await http_stream(http, base_url, p, args.max_tokens) for p in prompts]

        start = time.perf_counter()
        per_client = await asyncio.gather(*(client(i) for i in range(concurrency)))
        wall = time.perf_counter() - start
    return summarize("http", concurrency, wall, [t for timings in per_client for t in timings])


# ---- reference: the Python API -----------------------------------------------------------------------------


async def api_stream(llm: AsyncLLM, prompt: str, max_tokens: int) -> StreamTiming:
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )
    start = time.perf_counter()
    times: list[float] = []
    num_tokens = 0
    async for output in llm.generate([{"role": "user", "content": prompt}], params):
        num_tokens += len(output.outputs[0].token_ids)
        if output.outputs[0].text:
            times.append(time.perf_counter())
    ttft, itls = chunk_times(start, times)
    return StreamTiming(ttft, itls, num_tokens)


async def run_api_level(llm: AsyncLLM, concurrency: int, args: argparse.Namespace) -> LevelResult:
    async def client(i: int) -> list[StreamTiming]:
        prompts = [PROMPTS[(i + k) % len(PROMPTS)] for k in range(args.requests_per_client)]
        return [await api_stream(llm, p, args.max_tokens) for p in prompts]

    start = time.perf_counter()
    per_client = await asyncio.gather(*(client(i) for i in range(concurrency)))
    wall = time.perf_counter() - start
    return summarize("api", concurrency, wall, [t for timings in per_client for t in timings])


# ---- driver ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def own_server(max_num_seqs: int) -> Iterator[str]:
    """Start `asyncllm serve` on a free loopback port; yields its base URL; SIGTERM at the end."""
    script = Path(sys.executable).parent / "asyncllm"
    log = Path(tempfile.mkstemp(prefix="asyncllm-bench-", suffix=".log")[1])
    cmd = [str(script), "serve", "--port", "0", "--max-num-seqs", str(max_num_seqs)]
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        base_url = wait_ready(process, log)
        yield base_url
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)


def wait_ready(process: subprocess.Popen[bytes], log: Path, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()}")
        match = re.search(r"running on (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
        if match:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{match.group(1)}/health").status_code == 200:
                    return match.group(1)
        time.sleep(0.3)
    raise RuntimeError("the server did not become ready")


@contextlib.asynccontextmanager
async def reference_engine(max_num_seqs: int) -> AsyncIterator[AsyncLLM]:
    async with AsyncLLM.create(EngineArgs(max_num_seqs=max_num_seqs)) as llm:
        yield llm


def print_table(results: list[LevelResult], reference: dict[int, LevelResult]) -> None:
    print(f"{'path':>5} {'N':>3} {'reqs':>5} {'tok/s':>8} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8}  vs API")
    for r in results:
        ref = reference.get(r.concurrency)
        ratio = f"{r.tokens_per_s / ref.tokens_per_s:6.2f}x" if ref is not None else "     -"
        print(
            f"{r.path:>5} {r.concurrency:>3} {r.num_requests:>5} {r.tokens_per_s:>8.1f} {r.ttft_p50_ms:>7.0f}ms "
            f"{r.ttft_p99_ms:>6.0f}ms {r.itl_p50_ms:>6.0f}ms {r.itl_p99_ms:>6.0f}ms  {ratio}"
        )


async def main(args: argparse.Namespace) -> None:
    print(f"load average (1, 5, 15 min): {os.getloadavg()}, {os.cpu_count()} CPUs")
    max_seqs = max(args.concurrency)
    results: list[LevelResult] = []
    with contextlib.ExitStack() as stack:
        base_url = args.base_url or stack.enter_context(own_server(max_seqs))
        for n in args.concurrency:
            results.append(await run_http_level(base_url, n, args))
            print_table(results[-1:], {})
            sys.stdout.flush()
    reference: dict[int, LevelResult] = {}
    if args.reference:
        async with reference_engine(max_seqs) as llm:
            for n in args.concurrency:
                reference[n] = await run_api_level(llm, n, args)
    print("\nHTTP (asyncllm serve) vs the Python API on the same engine settings, this run:")
    print_table(results + list(reference.values()), reference)
    if args.json:
        write_json(args.json, results + list(reference.values()))


def write_json(path: str, results: list[LevelResult]) -> None:
    rows = [{k: v for k, v in asdict(r).items() if k != "timings"} for r in results]
    Path(path).write_text(json.dumps({"loadavg": os.getloadavg(), "results": rows}, indent=2))
    print(f"wrote {path}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="a running server (default: start one)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", default="serving_benchmark.json", help="where to write the results")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
