"""What a bfloat16 KV cache costs in accuracy beside each weight format, through the real engine: the measurement
behind `kv_cache_dtype="auto"` (`model/loading/kv_cache_choice.py`).

Teacher-forced prompt log-probabilities (`prompt_logprobs=1`) of fixed token sequences, for float32, int8 and the
default model's own Q4_1 blocks ("gguf") on a float32 and on a bfloat16 cache, each against float32 weights on a
float32 cache: mean and largest |delta log-probability| of the sequence's own next token, and how often the most
likely token agrees. The sequences: the held-out chat prompts of `block_quant.py` with 64 greedy tokens of the
reference appended, and two long passages (329 and 649 tokens), so prefill reads long prefixes back from the
cache. Every sequence is prefilled in chunks of `--chunk` tokens (the default 1024: the long ones in one chunk).

Not a speed benchmark: the numbers do not depend on the load. Which path the bfloat16 cache's prefill takes (the
kernel's bfloat16 products or widening) depends on the CPU, so name it with the result.

    .venv/bin/python benchmarks/kv_cache_accuracy.py [--json benchmarks/results/kv_cache_accuracy_<host>.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from block_quant import HELD_OUT  # benchmarks/ is on sys.path when run as a script

from asyncllm import LLM, SamplingParams
from asyncllm.utils.cpu_info import cpu_info

WEIGHTS = {"fp32": "none", "int8": "int8", "gguf": "gguf"}  # row name -> EngineArgs.quantization
PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how books were "
    "made, sold and read across Europe. "
)
GREEDY_TOKENS = 64


def engine(quantization: str, kv_cache_dtype: str, chunk: int) -> LLM:
    return LLM(
        quantization=quantization,  # type: ignore[arg-type]
        kv_cache_dtype=kv_cache_dtype,
        engine_process=False,
        max_model_len=2048,
        max_num_batched_tokens=chunk,
    )


def sequences(llm: LLM) -> list[list[int]]:
    """The token sequences: chat prompts + the reference's greedy continuation, and the two long passages."""
    chats = [[{"role": "user", "content": p}] for p in HELD_OUT]
    outs = llm.chat(chats, SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True))
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    tokenizer = llm.get_tokenizer()
    return [*seqs, tokenizer.encode(PASSAGE * 12 + "Summarize the passage:"), tokenizer.encode(PASSAGE * 24)]


def prompt_logprobs(llm: LLM, seqs: list[list[int]]) -> list[list[tuple[float, int]]]:
    """Per sequence, per position after the first: (log-probability of the sequence's next token, most likely
    token)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params)
    rows = []
    for seq, out in zip(seqs, outs, strict=True):
        assert out.prompt_logprobs is not None
        per = []
        for token, logprobs in zip(seq[1:], out.prompt_logprobs[1:], strict=True):
            assert logprobs is not None
            top = max(logprobs.items(), key=lambda item: item[1].logprob)[0]
            per.append((logprobs[token].logprob, top))
        rows.append(per)
    return rows


def compare(reference: list[list[tuple[float, int]]], got: list[list[tuple[float, int]]]) -> dict[str, float]:
    pairs = [(a, b) for ref, have in zip(reference, got, strict=True) for a, b in zip(ref, have, strict=True)]
    deltas = [abs(a[0] - b[0]) for a, b in pairs]
    agree = sum(a[1] == b[1] for a, b in pairs)
    return {
        "mean_abs_delta_logprob": sum(deltas) / len(deltas),
        "max_abs_delta_logprob": max(deltas),
        "top1_agreement": agree / len(deltas),
        "positions": len(deltas),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    parser.add_argument("--chunk", type=int, default=1024, help="max_num_batched_tokens (prefill chunk), tokens")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    reference_llm = engine("none", "float32", args.chunk)
    seqs = sequences(reference_llm)
    reference = prompt_logprobs(reference_llm, seqs)
    reference_llm.shutdown()
    print(f"{cpu_info().model}, avx512_bf16: {cpu_info().has('avx512_bf16')}; {len(seqs)} sequences of "
          f"{min(map(len, seqs))}-{max(map(len, seqs))} tokens; against fp32 weights on a float32 cache")  # fmt: skip
    print(f"{'weights':8} {'KV cache':9} {'mean |dlogprob|':>16} {'max':>7} {'top-1 agreement':>16}")
    results: dict[str, Any] = {}
    for name in args.weights:
        for dtype in ("float32", "bfloat16"):
            if (name, dtype) == ("fp32", "float32"):
                continue  # the reference itself
            llm = engine(WEIGHTS[name], dtype, args.chunk)
            row = compare(reference, prompt_logprobs(llm, seqs))
            llm.shutdown()
            results[f"{name}/{dtype}"] = row
            print(f"{name:8} {dtype:9} {row['mean_abs_delta_logprob']:16.4f} {row['max_abs_delta_logprob']:7.3f} "
                  f"{row['top1_agreement']:16.2%}")  # fmt: skip
    if args.json:
        report = {"cpu": cpu_info().model, "avx512_bf16": cpu_info().has("avx512_bf16"), "chunk": args.chunk,
                  "sequence_lengths": [len(s) for s in seqs], "results": results}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
