"""Batch-1 decode speed through each server's OpenAI `/v1/completions` (issue 31's targets): asyncllm's server in
every weight format the installed asyncllm accepts, beside llama.cpp's own `llama-server` on the same GGUF file,
with the host's memory bandwidth and the roofline it implies measured in the same run.

Every request: a 64-token prompt of random token ids (ids 1000..vocab-1, the same prompts for every server, a
different prompt per request so no server can reuse a cached prefix), 128 greedy tokens with EOS ignored
(`temperature 0`, `ignore_eos`, `max_tokens 128`, streaming; llama-server takes all three on its OpenAI endpoint:
`max_tokens` is its `n_predict`). A request counts only if the server's usage says it generated exactly 128 tokens.
Requests go one at a time (8, `--quick` 3) after one warm-up request; each server is started, measured and stopped
(SIGTERM) before the next starts.

Reported per server: mean and p50 TTFT, mean and p50 TPOT (per request: (last token - first token) / 127), output
tok/s (tokens / the requests' summed latency, prefill included), decode tok/s (1 / mean TPOT) and its fraction of
the roofline. The roofline is the host's memory bandwidth / the weight bytes one decode step reads from the GGUF
file (every tensor's stored bytes, read with `gguf`; the token embedding is left out when the file has its own
`output.weight`, since a step then reads one row of it). Bandwidth: a torch copy of a 1 GiB array with torch's
default threads, best of 5, counted as read + write bytes (2 GiB per copy) in GB/s (1e9 bytes).

Servers (`--servers`; by default every one available):
- `asyncllm-fp32`, `asyncllm-int8`, and `asyncllm-<q>` for each `--quantization` choice of
  `.venv/bin/asyncllm serve --help` beyond int8 (`gguf`, `q4_0`, `q8_0` once the 4-bit kernels land): the command
  line of `benchmarks/serving_shapes.py` (`--max-model-len 2048 --max-num-seqs 64`) plus `--quantization <q>`.
- `llama-server`: `benchmarks/llama_cpp/build/bin/llama-server -m <the GGUF asyncllm resolves> -t <cores> -c 2048
  -np 1`, built by `benchmarks/llama_cpp/setup.sh` (without it the row is skipped and the run says so).

    .venv/bin/python benchmarks/batch1.py [--model NAME|PATH] [--servers ...] [--quick] [--json PATH]

Measure on a quiet machine: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from serving_shapes import (  # noqa: E402  (benchmarks/ is not a package)
    MAX_MODEL_LEN,
    SERVED_NAME,
    RequestTiming,
    Shape,
    free_port,
    make_prompts,
    percentile,
    running_command,
    server_command,
    stream_one,
)
from throughput import machine_info  # noqa: E402

LLAMA_SERVER = ROOT / "benchmarks/llama_cpp/build/bin/llama-server"
ASYNCLLM = ROOT / ".venv/bin/asyncllm"
PROMPT_LEN = 64
OUTPUT_LEN = 128
COPY_BYTES = 1 << 30


@dataclass
class Batch1Result:
    """One server's requests (times in seconds; rates per second)."""

    server: str
    command: list[str]
    completed: int
    failed: int
    mean_ttft: float
    p50_ttft: float
    mean_tpot: float
    p50_tpot: float
    output_tok_s: float
    decode_tok_s: float
    roofline_fraction: float


def memory_bandwidth(num_bytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """The host's copy bandwidth in GB/s (1e9 bytes/s): the best of `repeats` torch copies of a `num_bytes` uint8
    array into another, each counted as `2 * num_bytes` (read + write); torch's default thread count. Both arrays
    are written once before timing, so page faults are outside it."""
    import torch

    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.zeros(num_bytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best / 1e9


def weight_bytes_per_token(gguf_path: Path) -> tuple[int, dict[str, int]]:
    """The bytes of weights one decode step reads from a GGUF file, and those bytes by tensor type (e.g. Q4_1,
    F32): every tensor's stored bytes, except `token_embd.weight` when the file has an `output.weight` (then a step
    reads one embedding row; with tied embeddings the table is the LM head and is read whole). Raises
    ValueError if the file has no tensors."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(gguf_path)).tensors
    if not tensors:
        raise ValueError(f"{gguf_path}: no tensors")
    names = {t.name for t in tensors}
    by_type: dict[str, int] = {}
    for t in tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return sum(by_type.values()), by_type


def asyncllm_quantizations() -> list[str]:
    """The `--quantization` choices of the installed `asyncllm serve` (from its `--help`) but "auto" (one of the
    others, by the model) and "none" (the fp32 row). Raises RuntimeError if the help cannot be read or has no such
    flag."""
    help_text = subprocess.run(
        [str(ASYNCLLM), "serve", "--help"], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    match = re.search(r"--quantization \{([^}]*)\}", help_text)
    if match is None:
        raise RuntimeError("`asyncllm serve --help` shows no `--quantization {...}` choices")
    return [q for q in match.group(1).split(",") if q not in ("auto", "none")]  # fp32 is its own row; auto = a mode


def llama_server_version() -> str:
    """`llama-server --version`'s version line."""
    out = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True, timeout=60)
    text = out.stdout + out.stderr
    return next((line.strip() for line in text.splitlines() if "version" in line.lower()), text.strip())


def server_cmd(server: str, model_path: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one server (see the module docstring)."""
    if server == "llama-server":
        cores = str(os.cpu_count() or 1)
        cmd = [str(LLAMA_SERVER), "-m", str(model_path), "-t", cores, "-c", str(MAX_MODEL_LEN), "-np", "1"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--alias", SERVED_NAME]
        return cmd, dict(os.environ)
    quantization = server.removeprefix("asyncllm-")
    cmd, env = server_command("asyncllm", str(model_path), None, port)  # no --quantization flag of its own
    cmd += ["--quantization", "none" if quantization == "fp32" else quantization]
    return cmd, env


async def run_requests(base_url: str, prompts: list[list[int]]) -> list[RequestTiming]:
    """Send `prompts` one at a time (each waits for the previous one's last token), each on a new connection:
    llama-server may close an idle keep-alive connection just as the next request goes out on it ("Server
    disconnected without sending a response", seen on 2 of 3 runs on the AMD EPYC host)."""
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as http:
        return [await stream_one(http, base_url, prompt, OUTPUT_LEN) for prompt in prompts]


def summarize(server: str, cmd: list[str], timings: list[RequestTiming], roofline_tok_s: float) -> Batch1Result:
    """Aggregate one server's request timings (see the module docstring for each figure)."""
    done = [t for t in timings if t.ok]
    ttfts = [t.ttft for t in done]
    tpots = [(t.chunk_times[-1] - t.ttft) / (t.num_tokens - 1) for t in done]
    latency = sum(t.chunk_times[-1] for t in done)
    mean_tpot = statistics.fmean(tpots) if tpots else 0.0
    decode = 1.0 / mean_tpot if mean_tpot else 0.0
    return Batch1Result(
        server=server,
        command=cmd,
        completed=len(done),
        failed=len(timings) - len(done),
        mean_ttft=statistics.fmean(ttfts) if ttfts else 0.0,
        p50_ttft=percentile(ttfts, 50),
        mean_tpot=mean_tpot,
        p50_tpot=percentile(tpots, 50),
        output_tok_s=sum(t.num_tokens for t in done) / latency if latency else 0.0,
        decode_tok_s=decode,
        roofline_fraction=decode / roofline_tok_s,
    )


def bench_server(
    server: str, model_path: Path, prompts: list[list[int]], warmup: list[int], roofline: float
) -> Batch1Result:
    """Start `server`, warm it up with one request, send `prompts` one at a time, stop it."""
    port = free_port()
    cmd, env = server_cmd(server, model_path, port)
    with running_command(server, cmd, env, port) as base_url:
        asyncio.run(run_requests(base_url, [warmup]))
        timings = asyncio.run(run_requests(base_url, prompts))
    return summarize(server, cmd, timings, roofline)


HEADER = "server            done  ttft ms (mean  p50)  tpot ms (mean  p50)  out tok/s  decode tok/s  of roofline"


def format_row(r: Batch1Result) -> str:
    return (
        f"{r.server:17} {r.completed:2}/{r.completed + r.failed:<2} {r.mean_ttft * 1e3:13.1f} {r.p50_ttft * 1e3:5.1f}"
        f" {r.mean_tpot * 1e3:14.2f} {r.p50_tpot * 1e3:5.2f} {r.output_tok_s:10.1f} {r.decode_tok_s:13.1f}"
        f" {r.roofline_fraction:11.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name or .gguf path")
    parser.add_argument("--servers", nargs="+", help="default: asyncllm in every format it accepts, llama-server")
    parser.add_argument("--requests", type=int, default=8, help="measured requests per server (default 8)")
    parser.add_argument("--quick", action="store_true", help="3 requests per server")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    from asyncllm.model.loading.arch_config import read_arch_config
    from asyncllm.model.loading.resolve import resolve_model_path

    model_path = resolve_model_path(args.model)
    if model_path.suffix != ".gguf":
        parser.error(f"--model {args.model} resolves to {model_path}, not a .gguf file: llama-server needs one")
    available = ["asyncllm-fp32"] + [f"asyncllm-{q}" for q in asyncllm_quantizations()]
    if LLAMA_SERVER.exists():
        available.append("llama-server")
    if args.servers is None:
        servers = available
        if not LLAMA_SERVER.exists():
            print(f"{LLAMA_SERVER} is not built (benchmarks/llama_cpp/setup.sh builds it): no llama-server row.")
    else:
        missing = [s for s in args.servers if s not in available]
        if missing:
            parser.error(f"not available here: {missing}; available: {available}")
        servers = list(args.servers)
    num_requests = 3 if args.quick else args.requests
    if num_requests < 1:
        parser.error("--requests must be at least 1")

    m = machine_info()
    print(f"machine: {m['cpu']}, {m['cores']} cores; load average before: {os.getloadavg()}")
    if "llama-server" in servers:
        print(f"llama-server: {llama_server_version()}")
    bandwidth = memory_bandwidth()
    weight_bytes, by_type = weight_bytes_per_token(model_path)
    roofline = bandwidth * 1e9 / weight_bytes
    types = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(by_type.items()))
    print(f"model: {model_path.name}; weight bytes per token {weight_bytes / 1e6:.1f} MB ({types})")
    print(f"memory bandwidth (torch copy of 1 GiB, read + write, best of 5): {bandwidth:.1f} GB/s")
    print(f"roofline: {bandwidth:.1f} GB/s / {weight_bytes / 1e6:.1f} MB = {roofline:.1f} tok/s")
    print(f"{num_requests} requests per server, one at a time: {PROMPT_LEN} prompt tokens, {OUTPUT_LEN} output tokens")

    vocab = read_arch_config(model_path).vocab_size
    shape = Shape("batch1", num_requests, PROMPT_LEN, OUTPUT_LEN, float("inf"), 1)
    prompts = make_prompts(shape, vocab)
    warmup = make_prompts(Shape("warmup", 1, PROMPT_LEN, OUTPUT_LEN, float("inf"), 1), vocab, seed=99)[0]
    results: list[Batch1Result] = []
    print(HEADER, flush=True)
    for server in servers:
        results.append(bench_server(server, model_path, prompts, warmup, roofline))
        print(format_row(results[-1]), flush=True)
    print(f"load average after: {os.getloadavg()}")
    if args.json:
        machine = {**m, "bandwidth_gb_s": bandwidth, "weight_bytes_per_token": weight_bytes, "roofline_tok_s": roofline}
        Path(args.json).write_text(json.dumps({"machine": machine, "results": [asdict(r) for r in results]}, indent=1))
    failed = [r.server for r in results if r.failed]
    if failed:
        sys.exit(f"requests that did not stream exactly {OUTPUT_LEN} tokens on: {failed} (not counted above)")


if __name__ == "__main__":
    main()
