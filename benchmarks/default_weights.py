"""What the default `quantization="auto"` costs in accuracy on the two real models: the file's own blocks ("gguf")
against float32 (the same GGUF dequantized), the measurements behind the default (README "Speed").

1. Teacher-forced, on held-out prompts (`block_quant.HELD_OUT`; chat template for SmolLM2, plain text for the Gemma
   3 270M base model): max / mean |logit error| per position, greedy (top-1) agreement with fp32, and the error of
   fp32's top-1 token's log-probability (mean / max), as `block_quant.py --sections accuracy` measures them.
2. Free-running (SmolLM2 only, engine in a thread): greedy answers (48 tokens) to 24 short factual chat questions
   for fp32, gguf, q8_0 and int8, each counted correct when it contains the expected word; the answers are kept.

Not a speed benchmark: the numbers do not depend on the load.

    .venv/bin/python benchmarks/default_weights.py [--json benchmarks/results/default_weights.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
from typing import Any

from block_quant import HELD_OUT, top1_logprob_errors  # benchmarks/ is on sys.path when run as a script

from asyncllm import AsyncLLM, EngineArgs, SamplingParams
from asyncllm.config import ModelConfig

MODELS = {"smollm2-135m-instruct": True, "gemma-3-270m": False}  # name -> prompts through the chat template
QUESTIONS = [  # (question, words of which one must appear in a correct answer)
    ("What is the capital of France?", ["Paris"]),
    ("What is the capital of Germany?", ["Berlin"]),
    ("What is the capital of Italy?", ["Rome"]),
    ("What is the capital of Japan?", ["Tokyo"]),
    ("What is the capital of Spain?", ["Madrid"]),
    ("What is the capital of the United Kingdom?", ["London"]),
    ("What is the capital of Canada?", ["Ottawa"]),
    ("What is the capital of Egypt?", ["Cairo"]),
    ("What is the capital of Russia?", ["Moscow"]),
    ("What is the capital of China?", ["Beijing"]),
    ("How many days are in a week?", ["seven", "7"]),
    ("What color is the sky on a clear day?", ["blue"]),
    ("What is the largest planet in our solar system?", ["Jupiter"]),
    ("Who wrote Romeo and Juliet?", ["Shakespeare"]),
    ("What is the boiling point of water in Celsius?", ["100"]),
    ("What gas do plants absorb from the air?", ["carbon dioxide", "CO2"]),
    ("How many legs does a spider have?", ["eight", "8"]),
    ("What is the chemical symbol for gold?", ["Au"]),
    ("What is the freezing point of water in Fahrenheit?", ["32"]),
    ("Which ocean is the largest?", ["Pacific"]),
    ("What is the tallest mountain in the world?", ["Everest"]),
    ("Who painted the Mona Lisa?", ["Leonardo", "da Vinci"]),
    ("What is 3 times 4?", ["12", "twelve"]),
    ("What is the square root of 81?", ["9", "nine"]),
]
FREE_RUNNING_MODES = ("none", "gguf", "q8_0", "int8")


def teacher_forced(model_name: str, chat: bool) -> dict[str, Any]:
    """fp32 against gguf on `HELD_OUT`, every prompt position."""
    from asyncllm.model.loading.loader import load_model
    from asyncllm.model.loading.resolve import resolve_model_path
    from asyncllm.model.loading.tokenizer import Tokenizer

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root, for tests/
    from tests.reference import next_token_logits

    path = str(resolve_model_path(model_name))
    tokenizer = Tokenizer.load(path)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in HELD_OUT]
    prompts = [tokenizer.encode(t) for t in texts]
    fp32 = load_model(ModelConfig(model=path, model_path=path))
    gguf = load_model(ModelConfig(model=path, model_path=path, quantization="gguf"))
    worst, means, agree, total, errors = 0.0, [], 0, 0, []
    for ids in prompts:
        ref, got = next_token_logits(fp32, ids), next_token_logits(gguf, ids)
        diff = (got - ref).abs().amax(-1)
        worst, means = max(worst, float(diff.max())), [*means, float(diff.mean())]
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
        errors += top1_logprob_errors(got.log_softmax(-1), ref.log_softmax(-1)).tolist()
    result = {"weights": gguf.linear_kernels, "positions": total, "max_abs_logit_error": worst,
              "mean_abs_logit_error": sum(means) / len(means), "top1_agreement": agree / total,
              "max_top1_logprob_error": max(errors), "mean_top1_logprob_error": sum(errors) / len(errors)}  # fmt: skip
    print(f"{model_name} gguf vs fp32 ({total} positions): greedy agreement {result['top1_agreement']:.3f}; top-1 "
          f"log-prob error mean {result['mean_top1_logprob_error']:.3f}, max {result['max_top1_logprob_error']:.3f}; "
          f"|logit error| max {worst:.2f}")  # fmt: skip
    return result


async def answers(mode: str) -> list[str]:
    """Greedy answers of the default model to `QUESTIONS` under `quantization=mode`."""
    args = EngineArgs(quantization=mode, engine_process=False, num_kv_blocks=256, max_model_len=512)  # type: ignore[arg-type]
    async with AsyncLLM.create(args) as llm:
        params = SamplingParams(max_tokens=48, temperature=0.0)
        outs = await asyncio.gather(
            *(llm.generate([{"role": "user", "content": q}], params).collect() for q, _ in QUESTIONS)
        )
    return [o.outputs[0].text for o in outs]


def free_running() -> dict[str, Any]:
    result: dict[str, Any] = {}
    for mode in FREE_RUNNING_MODES:
        texts = asyncio.run(answers(mode))
        correct = [any(w.lower() in t.lower() for w in words) for t, (_, words) in zip(texts, QUESTIONS, strict=True)]
        wrong = [q for (q, _), ok in zip(QUESTIONS, correct, strict=True) if not ok]
        result[mode] = {"correct": sum(correct), "of": len(QUESTIONS), "wrong": wrong, "answers": texts}
        print(f"free-running {mode:5}: {sum(correct)} of {len(QUESTIONS)} correct; wrong: {wrong}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="benchmarks/results/default_weights.json")
    args = parser.parse_args()
    results = {"teacher_forced": {name: teacher_forced(name, chat) for name, chat in MODELS.items()}}
    results["free_running"] = free_running()
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
