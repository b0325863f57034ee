"""Per-step cost of each executor backend (`uni`, `mp`, `ray`) at several tensor-parallel sizes.

Two measurements per (backend, TP), on an `EngineCore` built in this process (no frontend, no engine process):
1. RPC round trip: `collective_rpc("check_health")` to every worker, one at a time (no model work): what the
   backend adds to every step.
2. decode step: median wall time of `EngineCore.step()` for 1 and 8 greedy requests (EOS ignored) with the real
   SmolLM2-135M model, after their prefill.

    .venv/bin/python benchmarks/executor_overhead.py [--configs uni:1,mp:1,mp:3,ray:1,ray:3] [--steps 32]

With `ray` configs the script starts a local Ray cluster with one logical CPU per rank of the largest TP size.

SmolLM2-135M has 9 query / 3 KV heads, so TP=2 is rejected and TP=3 is the multi-rank case. The machine's load
average is printed first: on a shared 2-core machine, TP=3 runs 3 single-threaded ranks on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from asyncllm import EngineArgs, SamplingParams
from asyncllm.engine.core import EngineCore
from asyncllm.messages.engine import EngineCoreRequest


def measure(backend: str, tp: int, num_steps: int, num_rpcs: int) -> dict[str, float]:
    """Milliseconds: RPC round trip median, decode-step medians at 1 and 8 requests; seconds: start-up."""
    args = EngineArgs(
        num_kv_blocks=256, max_model_len=512, distributed_executor_backend=backend, tensor_parallel_size=tp
    )
    started = time.perf_counter()
    core = EngineCore(args.create_engine_config())
    result = {"startup_s": time.perf_counter() - started}
    try:
        rpc = []
        for _ in range(num_rpcs):
            t = time.perf_counter()
            core.executor.collective_rpc("check_health")
            rpc.append(time.perf_counter() - t)
        result["rpc_ms"] = statistics.median(rpc) * 1e3
        for batch in (1, 8):
            result[f"step{batch}_ms"] = decode_step_ms(core, batch, num_steps)
    finally:
        core.shutdown()
    return result


def decode_step_ms(core: EngineCore, batch: int, num_steps: int) -> float:
    """Median ms of the steps after the first (prefill) step, `batch` requests decoding together."""
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 1, ignore_eos=True)
    for i in range(batch):
        core.add_request(EngineCoreRequest(f"b{batch}-{i}", [1, 504, 3458, 282, 4536, 314 + i], params))
    core.step()  # prefill of every request
    times = []
    while core.has_unfinished_requests():
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="uni:1,mp:1,mp:3,ray:1,ray:3", help="backend:tp pairs, comma-separated")
    parser.add_argument("--steps", type=int, default=32, help="decode steps measured per batch size")
    parser.add_argument("--rpcs", type=int, default=200, help="RPC round trips measured")
    opts = parser.parse_args()
    print(f"load average: {os.getloadavg()}; cpus: {os.cpu_count()}")
    pairs = [(b, int(t)) for b, t in (pair.split(":") for pair in opts.configs.split(","))]
    ray_tps = [tp for backend, tp in pairs if backend == "ray"]
    if ray_tps:  # a local cluster with one logical CPU per rank (TP=3 on 2 cores: ranks share them)
        import ray

        ray.init(num_cpus=max(ray_tps), include_dashboard=False, log_to_driver=False)
    print(f"{'backend':>8} {'tp':>3} {'startup s':>10} {'rpc ms':>8} {'step@1 ms':>10} {'step@8 ms':>10}")
    for backend, tp in pairs:
        r = measure(backend, tp, opts.steps, opts.rpcs)
        print(
            f"{backend:>8} {tp:>3} {r['startup_s']:>10.1f} {r['rpc_ms']:>8.3f} {r['step1_ms']:>10.1f} "
            f"{r['step8_ms']:>10.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
