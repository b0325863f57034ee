"""`LLM`: vLLM's synchronous offline entry point over the same engine as `AsyncLLM`.

    from asyncllm import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct")
    outputs = llm.generate(["Hello, my name is", "The capital of France is"], SamplingParams(temperature=0.8))

Every call blocks until its requests finished. The `AsyncLLM` inside runs on a private event loop in a daemon
thread of its own, so an `LLM` works from plain scripts and from code that already runs an event loop (a
notebook): the caller's thread only waits. The requests of one call are submitted together and batched by the
engine; results come back in the prompts' order.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import msgspec

from asyncllm.async_llm import AsyncLLM
from asyncllm.config import DEFAULT_MODEL, EngineArgs
from asyncllm.errors import InvalidRequestError
from asyncllm.lora.request import LoRARequest
from asyncllm.metrics.reader import Metric
from asyncllm.outputs import PoolingRequestOutput, RequestOutput
from asyncllm.pooling_params import PoolingParams
from asyncllm.processing.input_processor import PromptType
from asyncllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM"]

T = TypeVar("T")


class LLM:
    """A synchronous LLM (vLLM's `vllm.LLM`).

    Args:
        model: as `EngineArgs.model` (default: the default model).
        **kwargs: any other `EngineArgs` field (`max_model_len=`, `seed=`, `enforce_eager=`, `dtype=`, ...).
    Raises:
        ConfigError: an unknown argument or a bad value (naming it).
        ModelNotFoundError, EngineDeadError: as `AsyncLLM.from_engine_args`.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        args = EngineArgs.from_dict({"model": model, **kwargs})
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="asyncllm-LLM-loop", daemon=True)
        self._thread.start()
        try:
            self.llm_engine: AsyncLLM = self._run(_start(args))
        except BaseException:
            _stop_loop(self._loop, self._thread)
            raise
        self._finalizer = weakref.finalize(self, _close, self.llm_engine, self._loop, self._thread)

    # ---- vLLM's LLM API ----------------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,  # vLLM's progress bar: asyncllm shows none
        lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for one prompt or a list of them (vLLM's `LLM.generate`).

        Args:
            prompts: a prompt (text, `TokensPrompt` / `TextPrompt` dict) or a list of them.
            sampling_params: one for every prompt, or one per prompt; None = `SamplingParams()`.
            use_tqdm: accepted for vLLM code; no progress bar is shown.
            lora_request: one adapter for every prompt, or one per prompt.
            priority: one per prompt (with `scheduling_policy="priority"`).
        Returns:
            One finished `RequestOutput` per prompt, in the prompts' order.
        Raises:
            InvalidRequestError: a bad prompt or parameters (no request runs), or lists of different lengths.
            EngineGenerateError, EngineDeadError: a request failed in the engine, or the engine died.
        """
        single = isinstance(prompts, str | Mapping)
        prompt_list: list[Any] = [prompts] if single else list(prompts)
        n = len(prompt_list)
        params = _per_prompt("sampling_params", sampling_params, n, SamplingParams)
        loras = _per_prompt("lora_request", lora_request, n, LoRARequest)
        priorities = [0] * n if priority is None else list(priority)
        if len(priorities) != n:
            raise InvalidRequestError(f"priority has {len(priorities)} entries for {n} prompts")
        return self._run(self._generate_all(prompt_list, params, loras, priorities))

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or a list of them (vLLM's `LLM.chat`), each rendered
        with the model's chat template.

        Raises:
            InvalidRequestError: a bad conversation, or an option asyncllm does not take here (`chat_template`,
                `add_generation_prompt=False`, `continue_final_message=True`, `tools`: use `AsyncLLM.chat` for
                tools), naming it.
        """
        unsupported = {
            "chat_template": chat_template is not None,
            "add_generation_prompt=False": not add_generation_prompt,
            "continue_final_message=True": continue_final_message,
            "tools (use AsyncLLM.chat)": tools is not None,
        }
        refused = [name for name, given in unsupported.items() if given]
        if refused:
            raise InvalidRequestError(f"LLM.chat does not take {refused}")
        one = bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if one else list(messages)
        return self.generate(conversations, sampling_params, lora_request=lora_request)  # type: ignore[arg-type]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,  # vLLM's progress bar: asyncllm shows none
    ) -> list[PoolingRequestOutput]:
        """Embed one prompt or a list of them (vLLM's `LLM.encode`; `AsyncLLM.encode`, docs/embeddings.md).

        Returns:
            One `PoolingRequestOutput` per prompt, in order; the vector is its `embedding` list (vLLM's is
            `outputs.data`, a tensor).
        Raises:
            InvalidRequestError: a bad prompt or pooling parameters.
        """
        single = isinstance(prompts, str | Mapping)
        prompt_list: list[Any] = [prompts] if single else list(prompts)
        results = self._run(_encode(self.llm_engine, prompt_list, pooling_params))
        return results

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now, as `Counter` / `Gauge` / `Histogram` / `Vector` objects (vLLM's
        `LLM.get_metrics()`; `asyncllm.metrics.reader`)."""
        return self.llm_engine.get_metrics()

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (`AsyncLLM.get_tokenizer`)."""
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix; False while requests hold KV blocks."""
        return self._run(self.llm_engine.reset_prefix_cache())

    def shutdown(self) -> None:
        """Stop the engine and the private event loop. Idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    # ---- internals -----------------------------------------------------------------------------------------

    async def _generate_all(
        self,
        prompts: list[Any],
        params: list[SamplingParams | None],
        loras: list[LoRARequest | None],
        priorities: list[int],
    ) -> list[RequestOutput]:
        llm = self.llm_engine
        streams = [  # every prompt is validated before any waits (a bad one raises here)
            llm.generate(prompt, _final_only(p), priority=priority, lora_request=lora)
            for prompt, p, lora, priority in zip(prompts, params, loras, priorities, strict=True)
        ]
        tasks = [asyncio.ensure_future(stream.collect()) for stream in streams]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the private loop and wait for its result (its exception is raised here)."""
        if not self._thread.is_alive():
            coroutine.close()
            raise RuntimeError("this LLM was shut down")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()


def _per_prompt(name: str, value: Any, n: int, kind: type) -> list[Any]:
    """`value` for each of `n` prompts: one value for all, or a list of exactly n."""
    if value is None or isinstance(value, kind):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise InvalidRequestError(f"{name} has {len(values)} entries for {n} prompts")
    return values


def _final_only(params: SamplingParams | None) -> SamplingParams:
    """The request's parameters with one output at the end (what `LLM` returns, as vLLM's `LLM` asks for)."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling_params must be a SamplingParams, not {type(params).__name__}")
    return msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _close(llm: AsyncLLM, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Shut the engine down on its loop, then stop the loop (finalizer: no reference to the `LLM`)."""
    if thread.is_alive():
        asyncio.run_coroutine_threadsafe(_shutdown(llm), loop).result()
    _stop_loop(loop, thread)


async def _start(args: EngineArgs) -> AsyncLLM:
    """Start the engine (in a worker thread: `AsyncLLM.create`), its output handler on the private loop."""
    return await AsyncLLM.create(args)


async def _encode(llm: AsyncLLM, prompts: list[Any], params: PoolingParams | None) -> list[PoolingRequestOutput]:
    result = await llm.encode(prompts, params)
    return result if isinstance(result, list) else [result]


async def _shutdown(llm: AsyncLLM) -> None:
    await llm.shutdown()


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if thread.is_alive():
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
    loop.close()
