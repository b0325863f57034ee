"""`AsyncLLM`: the async front door (asyncio or trio, through anyio). Submit prompts, stream `RequestOutput`s,
abort, shut down; and administer the engine (health, scheduler stats, data-parallel scaling, prefix-cache reset,
RPCs to every worker) through the client's typed utility calls (`UTILITY_METHODS`).

Data flow: `generate()` -> InputProcessor (tokenize + validate, synchronously) -> OutputProcessor state +
EngineCoreClient.add_request -> engine core (its own process by default, or a background thread) -> the client's
output reader (one background task on the loop the AsyncLLM is used from: an asyncio task or a trio system task)
-> the output handler (`output_handler.py`) -> OutputProcessor -> each request's collector -> its
`GenerateOutputStream`, which waits on its collector only. The request path
(streams, registration, sending, aborts of closed streams, `encode()`'s requests) is `submission.py`'s
`RequestSubmitter`; this module is the public surface.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import sniffio

from asyncllm.config import AsyncEngineArgs, EngineArgs, load_chat_template
from asyncllm.engine.client import EngineCoreClient
from asyncllm.engine.dp_client import DPEngineCoreClient, make_engine_client
from asyncllm.engine_config import EngineConfig
from asyncllm.errors import AsyncLLMError, ConfigError, EngineDeadError, InvalidRequestError
from asyncllm.lora.request import LoRARequest
from asyncllm.messages.engine import SchedulerStats
from asyncllm.metrics.defaults import resolve_stat_loggers
from asyncllm.metrics.loggers import StatLoggerBase
from asyncllm.metrics.prometheus import PrometheusStatLogger
from asyncllm.metrics.reader import Metric, get_metrics_snapshot
from asyncllm.output_handler import OutputHandler
from asyncllm.outputs import PoolingRequestOutput, RequestOutput
from asyncllm.pausing import PauseGate, PauseMode, poll_until, resolve_pause_mode
from asyncllm.pooling_params import PoolingParams
from asyncllm.processing.input_processor import InputProcessor, PromptType, RequestOptions
from asyncllm.processing.no_tokenizer import NoTokenizer
from asyncllm.processing.output_processor import OutputProcessor
from asyncllm.processing.tool_calling import ToolChoice, plan_chat
from asyncllm.sampling_params import SamplingParams
from asyncllm.starting import StartingAsyncLLM, bind_start
from asyncllm.stopping import PendingShutdown
from asyncllm.streams import GenerateOutputStream, RequestOutputCollector
from asyncllm.submission import LONG_PROMPT_CHARS, RequestSubmitter, is_long_prompt
from asyncllm.utils.loops import current_loop

RESET_DEADLINE_SECONDS = 30.0  # pause_generation(clear_cache=True) waits this long at most for blocks to be freed

__all__ = ["LONG_PROMPT_CHARS", "AsyncEngineArgs", "AsyncLLM", "PendingShutdown", "is_long_prompt"]


class AsyncLLM:
    """Streaming LLM inference on an engine core.

    Build inside a coroutine with `llm = await AsyncLLM.create(EngineArgs(...))` or `async with
    AsyncLLM.create(EngineArgs(...)) as llm:` (start-up runs in a worker thread: the event loop keeps
    running); from synchronous code with `AsyncLLM.from_engine_args(...)` (blocks). Use as `async with llm:`
    or call `shutdown()` (awaited, or synchronously as vLLM's).

    Outputs are read and processed in the background, from the first request (or the end of `create()`) on, by
    one task on the event loop the AsyncLLM is used from (one live loop at a time; a later loop takes over once
    the previous one has ended): stop strings, aborts and stats move whether or not any stream is being read.

    Args:
        config: the engine configuration (for reference).
        tokenizer: `asyncllm.model.loading.tokenizer.Tokenizer` of the model.
        client: a ready engine-core client.
        stat_loggers: receive every step's stats; None = the defaults (`make_default_stat_loggers`); logger
            instances replace them; logger classes (vLLM's way) are built and added to them
            (`metrics.defaults.resolve_stat_loggers`).
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        client: EngineCoreClient,
        stat_loggers: Sequence[StatLoggerBase | Any] | None = None,
    ) -> None:
        self.config = config
        self.stat_loggers = resolve_stat_loggers(config, stat_loggers)
        self._tokenizer = tokenizer
        self._client = client
        info = client.ready_info
        kv_cache_blocks = (info.num_kv_blocks, config.cache.block_size)
        self._input_processor = InputProcessor(
            tokenizer,
            info.max_model_len,
            info.vocab_size,
            kv_cache_blocks,
            info.hidden_size,
            lora_config=config.lora,
            max_logprobs=config.model.max_logprobs,
            callables_in_process=callables_reach_the_worker(config),
            max_prompt_len=config.model.max_prompt_len,
        )
        self._output_processor = OutputProcessor(tokenizer.hf)
        cache_info = {
            "block_size": str(config.cache.block_size),
            "num_gpu_blocks": str(info.num_kv_blocks),  # vLLM's label name; here CPU memory blocks
            "enable_prefix_caching": str(config.cache.enable_prefix_caching),
            "cache_dtype": config.cache.cache_dtype,  # vLLM's label, resolved: "float32" or "bfloat16"
        }
        for stat_logger in self.stat_loggers:
            if isinstance(stat_logger, PrometheusStatLogger):
                stat_logger.log_cache_config(cache_info)
        self._handler = OutputHandler(client, self._output_processor, self.stat_loggers)
        self._submitter = RequestSubmitter(self._input_processor, self._output_processor, client, self._handler)
        self._pause = PauseGate()
        # Stops the engine if this object is collected or the interpreter exits without shutdown().
        self._finalizer = weakref.finalize(self, client.shutdown)

    @classmethod
    def create(
        cls, args: EngineArgs, stat_loggers: Sequence[StatLoggerBase | Any] | None = None
    ) -> StartingAsyncLLM[AsyncLLM]:
        """Start an engine without blocking the event loop: `llm = await AsyncLLM.create(args)`, or
        `async with AsyncLLM.create(args) as llm:` (shuts it down on exit).

        Everything `from_engine_args` does (model resolution and first-time download, tokenizer loading, the
        engine's start-up and handshake) runs in a daemon thread. Cancelling the await cannot interrupt that
        thread: the engine it starts is shut down as soon as it is up. The background output handler starts on the
        awaiting loop.

        Args and Raises: as `from_engine_args` (raised by the await).
        """
        return StartingAsyncLLM(bind_start(cls.from_engine_args, args, stat_loggers))

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: Sequence[StatLoggerBase | Any] | None = None) -> AsyncLLM:
        """Resolve the model, load its tokenizer, and start the engine core (blocks until it is ready).

        Blocks the calling thread for the whole start-up (seconds); inside a coroutine use `await
        AsyncLLM.create(args)` instead.

        Args:
            args: the engine arguments.
            stat_loggers: receive every step's stats; None = the defaults (`make_default_stat_loggers`); logger
                instances replace them, logger classes (vLLM's) are added to them.
        Raises:
            ConfigError: bad engine arguments.
            ModelNotFoundError: the model cannot be resolved.
            EngineDeadError: the engine process failed to start (the message carries the engine's error).
        """
        from asyncllm.model.loading.arch_config import read_arch_config
        from asyncllm.model.loading.tokenizer import Tokenizer

        config = args.create_engine_config()
        if config.model.skip_tokenizer_init:  # vLLM's: token ids in and out, no tokenizer loaded
            tokenizer: Any = NoTokenizer(read_arch_config(config.model.model_path).eos_token_id)
        else:
            tokenizer = Tokenizer.load(config.model.model_path)
            if args.chat_template is not None:
                tokenizer.chat_template = load_chat_template(args.chat_template)
        llm = cls(config, tokenizer, make_engine_client(config), stat_loggers)
        return llm

    # ---- properties ---------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        """True once the engine died (sticky)."""
        return self._handler.errored

    @property
    def is_running(self) -> bool:
        """True while the engine serves requests (not shut down, not dead)."""
        return not self._handler.shut_down and not self.errored

    @property
    def prometheus_registry(self) -> Any:
        """The `CollectorRegistry` of the first `PrometheusStatLogger` in `stat_loggers`, or None."""
        for stat_logger in self.stat_loggers:
            if isinstance(stat_logger, PrometheusStatLogger):
                return stat_logger.registry
        return None

    @property
    def max_model_len(self) -> int:
        """Tokens per sequence at most (prompt + output), as the engine resolved it at start-up."""
        max_model_len: int = self._client.ready_info.max_model_len
        return max_model_len

    async def do_log_stats(self) -> None:
        """Have every stat logger write what it recorded now (vLLM's `do_log_stats`: the stats line at once)."""
        for stat_logger in self.stat_loggers:
            stat_logger.log()

    def get_metrics(self) -> list[Metric]:
        """The engine's Prometheus metrics now, as objects (vLLM's `LLM.get_metrics()`; `metrics.reader`):
        `Counter`, `Gauge`, `Histogram`, `Vector`. [] without prometheus-client."""
        prefix = next((s.prefix for s in self.stat_loggers if isinstance(s, PrometheusStatLogger)), "asyncllm")
        return get_metrics_snapshot(self.prometheus_registry, prefix)

    def get_tokenizer(self) -> Any:
        """The model's `asyncllm.model.loading.tokenizer.Tokenizer` (with `skip_tokenizer_init`: a
        `processing.no_tokenizer.NoTokenizer`, whose text operations raise `InvalidRequestError`)."""
        return self._tokenizer

    # ---- requests -----------------------------------------------------------------------------------

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        *,
        cache_salt: str | None = None,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> GenerateOutputStream:
        """Submit one prompt; returns its output stream at once.

        A short prompt is tokenized and validated here, so bad input raises here (vLLM raises it from the
        stream's first iteration; `docs/vllm_compat.md`). A long one (text or chat
        content over `LONG_PROMPT_CHARS` characters) is tokenized in a worker thread when the stream is first
        awaited, so the event loop never stalls on it (vLLM's `generate` validates at its first iteration too);
        its errors then raise from that first await.

        Args:
            prompt: text, `{"prompt_token_ids": [...]}` / `{"prompt": text}` (vLLM's `TokensPrompt` /
                `TextPrompt` from `asyncllm.inputs`, optionally with "cache_salt"), or chat messages
                `[{"role", "content"}, ...]`.
            sampling_params: None means `SamplingParams()`; with `n > 1` the n completions share this stream
                (see `asyncllm.processing.parallel_sampling`).
            request_id: the user's id, carried by every output; None makes one (uuid4 hex). It need not be
                unique: inside, the request is keyed by an internal id made here (vLLM's `external_req_id`
                beside `request_id`), so an id reused right after its abort, or sent by two callers at once,
                never mixes their outputs; `abort(request_id)` reaches every in-flight request with it.
            priority: lower runs first with `scheduling_policy="priority"` (ignored by "fcfs").
            cache_salt: tenant isolation for the prefix cache: mixed into the hash of the first KV cache block,
                so requests with different salts (or one salted, one not) never share cached blocks and cannot
                learn each other's prompts from time to first token (vLLM's `cache_salt`). None = unsalted.
            data_parallel_rank: with `data_parallel_size > 1`, run on this engine rank instead of the one the
                load balancer picks (docs/data_parallel.md).
            lora_request: run with this PEFT LoRA adapter (`asyncllm.lora.LoRARequest(lora_name, lora_int_id,
                lora_path)`; needs `EngineArgs(enable_lora=True)`, docs/lora.md); its directory is read and checked
                here. None = the base model.
        Returns:
            A `GenerateOutputStream` of `RequestOutput`s; the last has `finished=True`.
        Raises:
            InvalidRequestError: bad input (nothing reaches the engine), naming the field.
            EngineDeadError: the engine died or was shut down.
            EventLoopError: another event loop, running in another thread, uses this AsyncLLM.
        """
        self._ensure_running()
        loop = self._bind_to_current_loop()
        submitter = self._submitter
        stream = submitter.stream_later if loop is not None and is_long_prompt(prompt) else submitter.stream_now
        options = RequestOptions(request_id, priority, cache_salt, data_parallel_rank, lora_request)
        hold = self._pause.wait_resumed if self._pause.paused else None
        return stream(prompt, sampling_params, options, self._next_output, loop, hold)

    async def encode(
        self,
        prompt: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        *,
        data_parallel_rank: int | None = None,
    ) -> PoolingRequestOutput | list[PoolingRequestOutput]:
        """Embed one prompt, or a list of prompts, with the model's pooled final-norm hidden states.

        Each prompt becomes one engine request that runs its prefill only, batched with whatever else runs
        (generation requests included), skips the prefix cache and frees its KV blocks once pooled
        (docs/embeddings.md). Every prompt is validated before any is sent.

        Args:
            prompt: text, `{"prompt_token_ids": [...]}` (or `{"prompt": text}`), or a list of those.
            pooling_params: None means `PoolingParams()` ("last" pooling, normalized, every dimension).
            request_id: the user's id (a list's prompts get `f"{request_id}-{i}"`); None makes them.
            priority: lower runs first with `scheduling_policy="priority"`.
            data_parallel_rank: pin to this engine rank (data parallelism).
        Returns:
            A `PoolingRequestOutput`, or a list of them in the prompts' order for a list.
        Raises:
            InvalidRequestError: bad prompt or pooling parameters (nothing reaches the engine), naming the field.
            StreamIncompleteError: the request was aborted (`abort(request_id)`) before its vector was made.
            EngineGenerateError, EngineDeadError: the request failed in the engine, or the engine died.
        """
        self._ensure_running()
        self._bind_to_current_loop()
        await self._pause.wait_resumed()
        self._ensure_running()
        single = isinstance(prompt, str | Mapping)
        prompts = [prompt] if single else list(prompt)
        if not prompts:
            raise InvalidRequestError("encode() got an empty list of prompts")
        params = PoolingParams() if pooling_params is None else pooling_params
        results = await self._submitter.encode(
            prompts,  # type: ignore[arg-type]
            params,
            request_id,
            priority,
            single,
            data_parallel_rank,
            self._next_output,
        )
        return results[0] if single else results

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice = "auto",
        parallel_tool_calls: bool = True,
        tool_parser: str = "hermes",
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutput:
        """Run one chat turn to the end, with optional tool calling (OpenAI's `tools` / `tool_choice`).

        See `asyncllm.processing.tool_calling`: "required" or `{"type": "function", "function": {"name": ...}}`
        force a call valid for the tool's parameter schema (structured outputs); "auto" parses the model's own
        calls with `tool_parser`; "none" offers no tools. `request_id`, `priority`, `cache_salt` and `lora_request`
        are `generate()`'s.
        Returns:
            The final `RequestOutput`; each completion carries `tool_calls` (None when it called no tool).
        Raises:
            InvalidRequestError: bad messages, tools, tool_choice or parameters (nothing reaches the engine).
            EngineGenerateError, EngineDeadError: as `generate()`'s stream.
        """
        plan = plan_chat(
            self._tokenizer, messages, sampling_params, tools, tool_choice, parallel_tool_calls, tool_parser
        )
        output = await self.generate(
            plan.prompt, plan.sampling_params, request_id, priority, cache_salt=cache_salt, lora_request=lora_request
        ).collect()
        return plan.finish(output)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests by the user's id; each open stream then ends with a final output (finish_reason "abort").

        An id reaches every in-flight request submitted with it (several when callers share an id, as in vLLM),
        never a request submitted after this call. Unknown or finished ids are ignored.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._handler.abort_in_engine(self._output_processor.abort_requests(ids))

    # ---- engine administration ------------------------------------------------------------------------

    async def check_health(self) -> None:
        """Return if the engine serves; a coroutine, as vLLM's (`await llm.check_health()`).

        Raises:
            EngineDeadError: the engine died or was shut down.
        """
        self._ensure_running()

    # ---- pausing (vLLM's API for weight updates between RL rollouts; `asyncllm.pausing`) ----------------

    async def pause_generation(
        self,
        *,
        mode: PauseMode | None = None,
        wait_for_inflight_requests: bool | None = None,
        clear_cache: bool = True,
    ) -> None:
        """Pause generation: new `generate()` / `encode()` requests wait (unsent) until `resume_generation()`.

        Args:
            mode: "abort" (default): in-flight requests end at once with finish_reason "abort"; "wait": they run
                to their end, and this returns once the last one finished; "keep": the engine stops scheduling,
                they keep their place and KV blocks and go on after `resume_generation()`.
            wait_for_inflight_requests: vLLM's older spelling: True = mode "wait", False = "abort".
            clear_cache: once nothing runs, forget every cached prompt prefix (`reset_prefix_cache()`), so
                requests after new weights never reuse KV computed with the old ones.
        Raises:
            InvalidRequestError: an unknown mode, `mode` and `wait_for_inflight_requests` disagreeing, or mode
                "keep" with `clear_cache=True` (the kept requests hold KV blocks; nothing is paused then).
            EngineDeadError: the engine died or was shut down.
            AsyncLLMError: the prefix cache could not be cleared (a request still held KV blocks).
        """
        resolved = resolve_pause_mode(mode, wait_for_inflight_requests)
        if resolved == "keep" and clear_cache:
            raise InvalidRequestError(
                "pause_generation(mode='keep', clear_cache=True) cannot be honoured: the kept requests hold their KV "
                "blocks, so the prefix cache cannot be cleared; pass clear_cache=False"
            )
        if resolved == "wait" and self._pause.engine_frozen:
            raise InvalidRequestError(
                "pause_generation(mode='wait') would never return: a pause with mode='keep' holds the requests; "
                "call resume_generation() first"
            )
        self._ensure_running()
        self._bind_to_current_loop()
        self._pause.pause()
        if resolved == "keep":
            await self._client.call_utility_async("set_scheduler_paused", True)
            self._pause.engine_frozen = True
            return
        if resolved == "abort":
            await self.abort(self._output_processor.user_request_ids())

        async def drained() -> bool:
            self._ensure_running()
            return self._output_processor.num_unfinished_requests == 0

        await poll_until(drained, None)
        if clear_cache and not await poll_until(self.reset_prefix_cache, RESET_DEADLINE_SECONDS):
            raise AsyncLLMError("pause_generation could not clear the prefix cache: requests still hold KV blocks")

    async def resume_generation(self) -> None:
        """Resume after `pause_generation()`: kept requests go on, and the requests held meanwhile go to the
        engine. Idempotent."""
        if self._pause.engine_frozen:
            self._ensure_running()
            await self._client.call_utility_async("set_scheduler_paused", False)
            self._pause.engine_frozen = False
        self._pause.resume()

    async def is_paused(self) -> bool:
        """True between `pause_generation()` and `resume_generation()`."""
        return self._pause.paused

    def has_unfinished_requests(self) -> bool:
        """True while a submitted request has not finished (vLLM's `output_processor.has_unfinished_requests()`);
        requests held by a pause are not submitted yet."""
        return self._output_processor.num_unfinished_requests > 0

    @property
    def num_unfinished_requests(self) -> int:
        """Engine requests submitted and not finished (each completion of an n > 1 request counts)."""
        return self._output_processor.num_unfinished_requests

    async def get_scheduler_stats(self) -> SchedulerStats:
        """The engine scheduler's current counts (running, waiting, free and total KV blocks); with data
        parallelism, summed over the engines (`get_scheduler_stats_per_engine` gives each).

        Raises:
            EngineDeadError: the engine died or was shut down.
        """
        self._ensure_running()
        stats: SchedulerStats = await self._client.call_utility_async("get_scheduler_stats")
        return stats

    async def get_scheduler_stats_per_engine(self) -> dict[int, SchedulerStats]:
        """Each engine core's scheduler counts, by data-parallel rank (`{0: ...}` without data parallelism).

        Raises:
            EngineDeadError: the engine died or was shut down.
        """
        self._ensure_running()
        stats: dict[int, SchedulerStats] = await self._client.call_utility_per_engine_async("get_scheduler_stats")
        return stats

    @property
    def data_parallel_size(self) -> int:
        """Engine cores serving (or draining) now."""
        client = self._client
        return client.data_parallel_size if isinstance(client, DPEngineCoreClient) else 1

    async def scale_data_parallel(self, num_engines: int) -> None:
        """Grow or shrink to `num_engines` engine cores while serving (docs/data_parallel.md): new engines take
        the lowest free ranks; removed ones (the highest ranks) first drain (their in-flight requests finish
        normally, no new request goes to them), then stop. Remaining ranks keep their numbers.

        Raises:
            ConfigError: `num_engines` < 1, a scaling already under way, or an AsyncLLM started with
                `data_parallel_size=1` (it has a single-engine client; start with 2 or more to scale).
            EngineDeadError: the engine died, or a new engine failed to start.
        """
        self._ensure_running()
        if not isinstance(self._client, DPEngineCoreClient):
            raise ConfigError("scale_data_parallel needs an AsyncLLM started with data_parallel_size >= 2")
        await self._client.scale_data_parallel(num_engines)

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix in the engine (e.g. after changing weights, or for fair benchmarks).

        Returns:
            True when reset; False (nothing changed) while requests are running and hold KV cache blocks.
        Raises:
            EngineDeadError: the engine died or was shut down.
        """
        self._ensure_running()
        reset: bool = await self._client.call_utility_async("reset_prefix_cache")
        return reset

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,  # vLLM's API: the workers' own reply deadline, seconds
    ) -> list[Any]:
        """Call `Worker.<method>(*args, **kwargs)` on every worker, inside the engine.

        Arguments and results cross the process boundary as msgpack (plain values, numpy arrays, tensors).
        Returns:
            One result per worker, by rank.
        Raises:
            EngineGenerateError: the call failed in a worker (the engine keeps serving).
            EngineDeadError: the engine died or was shut down.
        """
        self._ensure_running()
        client = self._client
        results: list[Any] = await client.call_utility_async("collective_rpc", method, list(args), kwargs, timeout)
        return results

    # ---- lifecycle ----------------------------------------------------------------------------------

    def shutdown(self) -> PendingShutdown:
        """Stop the output handler and the engine; open streams raise `EngineDeadError` at once. Idempotent.

        Synchronous as vLLM's, and awaitable: `await llm.shutdown()` stops the engine in a daemon thread while
        the loop runs on; `llm.shutdown()` without `await` stops it before returning (outside a loop) or at the
        end of the statement (inside a coroutine, blocking the loop meanwhile, as vLLM's does). See
        `asyncllm.stopping`. The result also runs wherever a coroutine is expected (`asyncio.run`, `create_task`,
        `trio.run(llm.shutdown)`).
        """
        if not self._handler.shut_down:
            self._handler.shut_down = True
            self._output_processor.propagate_error(EngineDeadError("the engine was shut down"))
        return PendingShutdown(self._finalizer)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.shutdown()

    # ---- internals ----------------------------------------------------------------------------------

    def _bind_to_current_loop(self) -> Any:
        """Bind to the running event loop (None outside one) and make sure the output handler runs on it (the
        client's binding: it rebinds once a previous loop has ended).

        Raises:
            EventLoopError: another event loop, running in another thread, uses this AsyncLLM.
        """
        try:
            loop = current_loop()
        except sniffio.AsyncLibraryNotFoundError:
            return None
        self._client.bind_to_current_loop()
        return loop

    async def _next_output(self, collector: RequestOutputCollector) -> RequestOutput:
        """Wait for `collector`'s next output (see `OutputHandler.next_output`)."""
        self._bind_to_current_loop()
        return await self._handler.next_output(collector)

    def _ensure_running(self) -> None:
        self._handler.ensure_running()


def callables_reach_the_worker(config: EngineConfig) -> bool:
    """True when the worker samples in this process (engine core in a thread, "uni" executor, one engine, no
    speculative decoding), so per-request callables (`SamplingParams.logits_processors`) can reach it."""
    parallel = config.parallel
    return (
        not parallel.engine_process
        and parallel.distributed_executor_backend == "uni"
        and parallel.data_parallel_size == 1
        and config.speculative is None
    )
