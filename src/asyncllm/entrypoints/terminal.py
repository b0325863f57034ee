"""`asyncllm generate` and `asyncllm chat`: stream answers to the terminal.

`chat` keeps the conversation (every user and assistant turn goes into the next prompt). Ctrl-C while an answer
streams stops that answer (its request is aborted; what was shown stays in the history); Ctrl-C at the prompt
clears the line; Ctrl-D (end of input) exits. The event loop runs only while an answer streams, so the prompt
is a plain blocking `input()` that Ctrl-C and Ctrl-D interrupt as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from typing import Any, TextIO

from asyncllm.config import EngineArgs
from asyncllm.sampling_params import RequestOutputKind, SamplingParams


def make_sampling_params(max_tokens: int | None, temperature: float, top_p: float, seed: int | None) -> SamplingParams:
    """DELTA-output `SamplingParams` for terminal streaming.

    Raises:
        InvalidRequestError: a value is out of range.
    """
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        output_kind=RequestOutputKind.DELTA,
    )


async def stream_answer(llm: Any, prompt: Any, params: SamplingParams, out: TextIO) -> tuple[str, int, str | None]:
    """Stream one answer to `out`. Returns (text, generated tokens, finish reason); the finish reason is None
    when the answer was cancelled."""
    parts: list[str] = []
    num_tokens = 0
    finish_reason = None
    async with llm.generate(prompt, params) as stream:
        async for output in stream:
            completion = output.outputs[0]
            num_tokens += len(completion.token_ids)
            parts.append(completion.text)
            out.write(completion.text)
            out.flush()
            finish_reason = completion.finish_reason
    return "".join(parts), num_tokens, finish_reason


async def generate(args: EngineArgs, prompt: str, raw: bool, params: SamplingParams) -> int:
    """`asyncllm generate`: one answer to stdout, a timing line to stderr. Returns the exit code."""
    from asyncllm.async_llm import AsyncLLM

    llm = await AsyncLLM.create(args)
    async with llm:
        engine_prompt: Any = prompt if raw else [{"role": "user", "content": prompt}]
        start = time.perf_counter()
        _, num_tokens, finish_reason = await stream_answer(llm, engine_prompt, params, sys.stdout)
        elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    print(f"[{num_tokens} tokens in {elapsed:.2f} s, finish_reason={finish_reason}]", file=sys.stderr)
    return 0


def chat(args: EngineArgs, params: SamplingParams, system: str | None) -> int:
    """`asyncllm chat`: the interactive loop. Returns the exit code."""

    loop = asyncio.new_event_loop()
    try:
        llm = loop.run_until_complete(_start(args))
        history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        print("asyncllm chat: Ctrl-C stops an answer, Ctrl-D exits.", file=sys.stderr)
        try:
            _chat_loop(loop, llm, history, params)
        finally:
            loop.run_until_complete(_stop(llm))
    finally:
        _cancel_remaining_tasks(loop)  # as asyncio.run does: no task is left pending in a closed loop
        loop.close()
    return 0


async def _stop(llm: Any) -> None:
    await llm.shutdown()  # awaited inside the loop: the output reader sees the shutdown and ends meanwhile


def _cancel_remaining_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


async def _start(args: EngineArgs) -> Any:
    from asyncllm.async_llm import AsyncLLM

    return await AsyncLLM.create(args)


def _chat_loop(
    loop: asyncio.AbstractEventLoop, llm: Any, history: list[dict[str, str]], params: SamplingParams
) -> None:
    while True:
        try:
            user = input("> ")
        except KeyboardInterrupt:
            print()
            continue
        except EOFError:
            print()
            return
        if not user.strip():
            continue
        history.append({"role": "user", "content": user})
        text = _answer_interruptibly(loop, llm, history, params)
        history.append({"role": "assistant", "content": text})


def _answer_interruptibly(
    loop: asyncio.AbstractEventLoop, llm: Any, history: list[dict[str, str]], params: SamplingParams
) -> str:
    """Stream one answer; SIGINT cancels only this answer (the task), not the program. A line on stderr gives
    the turn's prompt tokens (the whole history) and generated tokens."""
    parts: list[str] = []
    counts = {"prompt": 0, "generated": 0}

    async def run() -> None:
        async with llm.generate(list(history), params) as stream:
            async for output in stream:
                counts["prompt"] = len(output.prompt_token_ids)
                counts["generated"] += len(output.outputs[0].token_ids)
                parts.append(output.outputs[0].text)
                sys.stdout.write(output.outputs[0].text)
                sys.stdout.flush()

    task = loop.create_task(run())
    loop.add_signal_handler(signal.SIGINT, task.cancel)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task)
            sys.stdout.write("\n")
        if task.cancelled():
            sys.stdout.write(" [stopped]\n")
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    print(f"[{counts['prompt']} prompt tokens, {counts['generated']} generated]", file=sys.stderr, flush=True)
    return "".join(parts)
