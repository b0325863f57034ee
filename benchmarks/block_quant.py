"""Block-quantized weights (`quantization="q8_0" | "q4_0" | "gguf"`, `model/kernels/block_quant.py`) against today's
int8 and fp32: kernels, the engine at batch 1 with its memory, and accuracy.

1. Kernels: SmolLM2-135M's fused linear shapes and LM head (30 layers of random weights, so they stream from
   memory as in a real step), `linear()` at 1, 8, 32, 64 and 256 rows per product, for Q4_0 / Q4_1 / Q8_0 blocks
   (the best kernel path this CPU has), the "q4_0" and "gguf" modes as the engine stores the default model (Q4_0
   or Q4_1 layers, a Q8_0 head; `--paths vnni,...` adds them forced onto other paths), int8 (the chooser's kernels)
   and fp32 (the chooser's kernels). Time per step (all 121 products) = best of `--repeats` interleaved passes.
2. Engine: `AsyncLLM` (engine in its own process), batch 1: a 64-token prompt, 128 greedy tokens (EOS ignored);
   decode tok/s = 127 / (end - first token), and the engine process's RSS (`VmRSS`) after the run, for fp32, int8,
   gguf, q4_0 and q8_0 on the default model.
3. Accuracy: each mode's model against fp32 (the GGUF dequantized) on held-out prompts (not the int8 calibration
   text): max |logit diff| at every prompt position (worst and mean over positions), the greedy top-1 agreement
   rate over positions, and the error of fp32's top-1 token's log-probability; the last two also for llama.cpp's
   `llama-server` on the same GGUF and prompts (teacher-forced, one request per prefix), when it is built.

The CPU's name and flags come first. Not for a busy machine: the numbers are only worth a quiet host.

    .venv/bin/python benchmarks/block_quant.py [--sections kernels,engine,accuracy] [--modes fp32,gguf] [--paths [P,..]]
        [--smoke] [--json PATH] [--rows 1,8,32] [--threads 1 --cpu-time]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from memory import child_pids, rss_mb  # benchmarks/ is on sys.path when run as a script
from throughput import machine_info

from asyncllm import AsyncLLM, EngineArgs, SamplingParams
from asyncllm.config import DEFAULT_MODEL, ModelConfig
from asyncllm.model.kernels.block_quant import block_kernels, block_linear, quantize_blocks
from asyncllm.model.kernels.fp32 import fp32_chooser, pack_fp32
from asyncllm.model.kernels.int8 import int8_chooser, quantize_int8
from asyncllm.model.kernels.linear import linear

HIDDEN, LAYERS, VOCAB = 576, 30, 49152
SHAPES = [(HIDDEN, 960), (HIDDEN, HIDDEN), (HIDDEN, 3072), (1536, HIDDEN)]  # qkv, o, gate_up, down ([in, out])
ROWS = (1, 8, 32, 64, 256)
MODES: tuple[str | None, ...] = (None, "int8", "gguf", "q4_0", "q8_0")
PROMPT_TOKENS, DECODE_TOKENS = 64, 128
HELD_OUT = [  # no words of the int8 calibration text (model/loading/loader.py)
    "How do bees make honey?",
    "Give me three tips for sleeping better.",
    "What does a librarian do all day?",
    "Describe how to boil an egg.",
    "Why do cats purr?",
    "The goalkeeper dived to his left, but the ball curled into the top corner.",
]


def kernel_weights(layers: int, vocab: int, paths: list[str]) -> dict[str, list[Any]]:
    """The products of one step per kernel: fp32, int8, each block kind throughout, the "q4_0" and "gguf" modes
    as the engine stores the default model (Q4_0 or the file's Q4_1 layers, a Q8_0 head), and those two modes
    forced onto each of `paths` (block kernel paths)."""
    gen = torch.Generator().manual_seed(0)
    plain = [torch.randn(i, o, generator=gen) * i**-0.5 for _ in range(layers) for i, o in SHAPES]
    plain.append(torch.randn(HIDDEN, vocab, generator=gen) * HIDDEN**-0.5)
    weights: dict[str, list[Any]] = {
        "fp32 chosen": [pack_fp32(w, fp32_chooser()) for w in plain],
        "int8 chosen": [quantize_int8(w, int8_chooser()) for w in plain],
    }
    for kind in ("q4_0", "q4_1", "q8_0"):
        weights[kind] = [quantize_blocks(w, kind) for w in plain]  # type: ignore[arg-type]
    # the engine's modes on the default model: "q4_0" keeps the head at Q8_0, "gguf" keeps the file's Q4_1 layers
    # and its Q8_0 token embedding (the tied head)
    weights["q4_0 mode"] = weights["q4_0"][:-1] + weights["q8_0"][-1:]
    weights["gguf mode"] = weights["q4_1"][:-1] + weights["q8_0"][-1:]
    for path in paths:
        for mode in ("q4_0 mode", "gguf mode"):
            weights[f"{mode} {path}"] = [(w, path) for w in weights[mode]]
    return weights


def one_pass(weights: list[Any], rows: int) -> Callable[[], None]:
    inputs = {i: torch.randn(rows, i) for i in (HIDDEN, 1536)}

    def run() -> None:
        for w in weights:
            if isinstance(w, tuple):
                block_linear(inputs[w[0].shape[0]], w[0], w[1])
            else:
                linear(inputs[w.shape[0]], w)

    return run


def bench_kernels(args: argparse.Namespace) -> dict[str, Any]:
    layers, vocab = (2, 4096) if args.smoke else (LAYERS, VOCAB)
    rows_list = (1, 8) if args.smoke else tuple(int(r) for r in args.rows.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    chosen = block_kernels()
    available = list(chosen[0].block_quant_paths()) if chosen is not None else []
    wanted = available[1:] if args.paths == "slower" else [p for p in args.paths.split(",") if p]
    unknown = [p for p in wanted if p not in available]
    if unknown:
        raise SystemExit(f"--paths {','.join(unknown)}: not block kernel paths of this build and CPU ({available})")
    weights = kernel_weights(layers, vocab, wanted)
    result: dict[str, dict[str, float]] = {name: {} for name in weights}
    for rows in rows_list:
        passes = {name: one_pass(ws, rows) for name, ws in weights.items()}
        best = dict.fromkeys(passes, float("inf"))
        for _ in range(1 if args.smoke else args.repeats):  # interleaved: a burst of load hits every kernel alike
            for name, run in passes.items():
                start = clock()
                run()
                best[name] = min(best[name], clock() - start)
        for name, seconds in best.items():
            result[name][str(rows)] = seconds * 1e3
    print(f"{'ms per step (121 products)':28}" + "".join(f"{r:>9}" for r in rows_list))
    for name, by_rows in result.items():
        print(f"{name:28}" + "".join(f"{by_rows[str(r)]:9.2f}" for r in rows_list))
    clock_name = "process CPU time" if args.cpu_time else "wall time"
    return {"layers": layers, "vocab": vocab, "threads": torch.get_num_threads(), "clock": clock_name,
            "ms_per_step": result}  # fmt: skip


async def engine_run(model: str, mode: str | None, decode_tokens: int) -> dict[str, float]:
    args = EngineArgs(model=model, quantization=mode, num_kv_blocks=64, max_model_len=512)  # type: ignore[arg-type]
    before = set(child_pids())
    async with AsyncLLM.create(args) as llm:
        engine_pids = [pid for pid in child_pids() if pid not in before]
        prompt = list(range(1000, 1000 + PROMPT_TOKENS))
        params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
        first = end = 0.0
        start = time.perf_counter()
        async for _out in llm.generate({"prompt_token_ids": prompt}, params):
            now = time.perf_counter()
            first = first or now
            end = now
        rss = sum(rss_mb(pid) for pid in engine_pids)
    return {
        "ttft_s": first - start,
        "decode_tok_per_s": (decode_tokens - 1) / (end - first) if end > first else float("nan"),
        "engine_rss_mb": rss,
    }


def bench_engine(args: argparse.Namespace) -> dict[str, Any]:
    results = {}
    for mode in MODES:
        name = mode or "fp32"
        if name not in args.modes.split(","):
            continue
        results[name] = asyncio.run(engine_run(args.model, mode, 8 if args.smoke else DECODE_TOKENS))
        r = results[name]
        print(f"engine {name:6}: {r['decode_tok_per_s']:7.1f} tok/s batch 1, TTFT {r['ttft_s']:.3f} s, "
              f"RSS {r['engine_rss_mb']:.0f} MB")  # fmt: skip
    return results


def top1_logprob_errors(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """|log p(t) - log p_ref(t)| of the reference's top-1 token t at each position ([positions] float32), from
    `[positions, vocab]` log-softmax rows: the one error llama-server's top log-probabilities also give."""
    top = ref_log_probs.argmax(-1, keepdim=True)
    return (log_probs.gather(-1, top) - ref_log_probs.gather(-1, top)).abs().squeeze(-1)


def llama_cpp_top_logprobs(base_url: str, prompt: list[int], k: int = 20) -> tuple[dict[int, float], int]:
    """llama-server's top-`k` next-token log-probabilities after `prompt` (token ids): a softmax of the raw logits,
    no sampler applied (`post_sampling_probs` off, greedy), and the number of prompt tokens it evaluated in all
    (to check that it added no BOS). `/completion` of llama.cpp's server; its prompt cache reuses the prefix."""
    import httpx

    body = {"prompt": prompt, "n_predict": 1, "n_probs": k, "temperature": 0, "post_sampling_probs": False,
            "cache_prompt": True}  # fmt: skip
    reply = httpx.post(f"{base_url}/completion", json=body, timeout=600).json()
    entry = reply["completion_probabilities"][0]
    return {int(t["id"]): float(t["logprob"]) for t in entry["top_logprobs"]}, int(reply["tokens_evaluated"])


def bench_llama_cpp_accuracy(path: str, prompts: list[list[int]], reference: list[torch.Tensor]) -> dict[str, Any]:
    """llama.cpp (`llama-server` on the same GGUF, its own Q4_1 kernels) against our fp32 on the held-out prompts,
    position by position (teacher-forced: each prefix is one request): greedy agreement, and the top-1 log-prob
    error (`top1_logprob_errors`; a position where fp32's top token is not in llama.cpp's top 20 counts as missing)."""
    from batch1 import LLAMA_SERVER, server_cmd
    from serving_shapes import free_port, running_command

    if not LLAMA_SERVER.exists():
        print("accuracy llama.cpp: llama-server is not built (benchmarks/llama_cpp/setup.sh): no row")
        return {"skipped": "llama-server not built"}
    port = free_port()
    cmd, env = server_cmd("llama-server", pathlib.Path(path), port)
    errors, agree, total, missing, extra_tokens = [], 0, 0, 0, 0
    with running_command("llama-server", cmd, env, port) as base_url:
        for ids, ref in zip(prompts, reference, strict=True):
            ref_log_probs = ref.log_softmax(-1)
            for pos in range(1, len(ids) + 1):
                top, evaluated = llama_cpp_top_logprobs(base_url, ids[:pos])
                extra_tokens = max(extra_tokens, evaluated - pos)
                want = int(ref_log_probs[pos - 1].argmax())
                agree += int(max(top, key=top.__getitem__) == want)
                total += 1
                if want in top:
                    errors.append(abs(top[want] - float(ref_log_probs[pos - 1, want])))
                else:
                    missing += 1
    if extra_tokens:
        raise RuntimeError(f"llama-server evaluated {extra_tokens} more token(s) than sent (a BOS?): not comparable")
    result = {"top1_agreement": agree / total, "max_top1_logprob_error": max(errors),
              "mean_top1_logprob_error": sum(errors) / len(errors), "positions": total, "missing": missing,
              "server": " ".join(cmd)}  # fmt: skip
    print(f"accuracy llama.cpp: greedy agreement {result['top1_agreement']:.3f}; top-1 log-prob error max "
          f"{result['max_top1_logprob_error']:.3f}, mean {result['mean_top1_logprob_error']:.4f} ({missing} of "
          f"{total} positions without fp32's top token in llama.cpp's top 20)")  # fmt: skip
    return result


def bench_accuracy(args: argparse.Namespace) -> dict[str, Any]:
    from asyncllm.model.loading.loader import load_model
    from asyncllm.model.loading.resolve import resolve_model_path
    from asyncllm.model.loading.tokenizer import Tokenizer

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root, for tests/
    from tests.reference import next_token_logits

    path = str(resolve_model_path(args.model))
    tokenizer = Tokenizer.load(path)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in HELD_OUT]
    prompts = prompts[:1] if args.smoke else prompts
    fp32 = load_model(ModelConfig(model=path, model_path=path))
    reference = [next_token_logits(fp32, ids) for ids in prompts]
    results = {}
    for mode in MODES[2:3] if args.smoke else MODES[1:]:
        model = load_model(ModelConfig(model=path, model_path=path, quantization=mode))  # type: ignore[arg-type]
        worst, means, agree, total, lp_errors = 0.0, [], 0, 0, []
        for ids, ref in zip(prompts, reference, strict=True):
            got = next_token_logits(model, ids)
            diff = (got - ref).abs().amax(-1)
            worst, means = max(worst, float(diff.max())), [*means, float(diff.mean())]
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            total += len(ids)
            lp_errors += top1_logprob_errors(got.log_softmax(-1), ref.log_softmax(-1)).tolist()
        results[str(mode)] = {"max_abs_logit_error": worst, "mean_abs_logit_error": sum(means) / len(means),
                              "top1_agreement": agree / total, "max_top1_logprob_error": max(lp_errors),
                              "mean_top1_logprob_error": sum(lp_errors) / len(lp_errors)}  # fmt: skip
        r = results[str(mode)]
        print(f"accuracy {mode:6}: max |logit error| {r['max_abs_logit_error']:.3f} (mean over positions "
              f"{r['mean_abs_logit_error']:.3f}), greedy agreement {r['top1_agreement']:.3f}; top-1 log-prob error "
              f"max {r['max_top1_logprob_error']:.3f}, mean {r['mean_top1_logprob_error']:.4f}")  # fmt: skip
    if not args.smoke:
        results["llama.cpp"] = bench_llama_cpp_accuracy(path, prompts, reference)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="kernels,engine,accuracy")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--repeats", type=int, default=7)
    paths_help = "also time the q4_0 and gguf modes forced onto these block kernel paths (comma-separated; none: all)"
    parser.add_argument("--paths", nargs="?", const="slower", default="", help=paths_help)
    parser.add_argument("--modes", default="fp32,int8,gguf,q4_0,q8_0", help="the engine section's modes")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 8 tokens: checks the script runs")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="the kernels section's rows per product")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for the kernels (0: torch's default)")
    parser.add_argument("--cpu-time", action="store_true", help="time by process CPU time (for --threads 1 on a "
                        "shared host: another process's load does not count)")  # fmt: skip
    parser.add_argument("--json", default="benchmarks/results/block_quant.json")
    args = parser.parse_args()
    info = machine_info()
    chosen = block_kernels()
    print(f"CPU: {info['cpu']} ({info['cores']} cores; flags {' '.join(info['flags'])}); block kernel path: "
          f"{chosen[1] if chosen else 'NONE (dequantizing fallback)'}")  # fmt: skip
    result: dict[str, Any] = {"benchmark": "block_quant", "machine": info, "smoke": args.smoke}
    sections = {"kernels": bench_kernels, "engine": bench_engine, "accuracy": bench_accuracy}
    for name in args.sections.split(","):
        result[name] = sections[name](args)
    result["load_after"] = list(os.getloadavg())
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
