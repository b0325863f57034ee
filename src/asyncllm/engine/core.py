"""`EngineCore`: the inner loop of the engine. A step is: schedule, run the model, update the requests.

It owns the scheduler (and through it every request's state and the KV cache blocks) and the executor (the
workers). It is not thread-safe: one thread (the client's engine thread, or the engine process's busy loop)
calls every method. Follows vLLM v1's `EngineCore` (vllm/v1/engine/core.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from asyncllm.engine_config import EngineConfig
from asyncllm.errors import InvalidRequestError
from asyncllm.executors import get_executor_class
from asyncllm.executors.base import Executor
from asyncllm.lora.checker import LoRAChecker
from asyncllm.messages.engine import EngineCoreOutputs, EngineCoreRequest, EngineReadyInfo, SchedulerStats
from asyncllm.processing.prompt_embeds import check_embeds_params, to_prompt_embeds_array
from asyncllm.sched.grammar import StructuredOutputManager, make_tokenizer_loader
from asyncllm.sched.request import RequestStatus
from asyncllm.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)
GRAMMAR_WAIT_SECONDS = 0.005  # an idle step waits this long for a compiling grammar instead of spinning


def check_request(request: EngineCoreRequest, info: EngineReadyInfo) -> None:
    """The checks the engine cannot trust to the sender: prompt length and token ids (against the model),
    sampling parameters (re-run: a struct can be changed after its decoding validated it).

    Raises:
        InvalidRequestError: naming what is wrong.
    """
    ids = request.prompt_token_ids
    if not ids or len(ids) >= info.max_model_len:
        raise InvalidRequestError(f"the prompt has {len(ids)} tokens; 1 to {info.max_model_len - 1} are allowed")
    bad = [t for t in ids if not 0 <= t < info.vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {info.vocab_size})")
    params = request.sampling_params
    params.validate()
    params.validate_vocab(info.vocab_size)
    if params.max_tokens is not None and len(ids) + params.max_tokens > info.max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) > max_model_len ({info.max_model_len})"
        )
    if request.pooling_params is not None:
        request.pooling_params.validate(info.hidden_size or None)
    if request.prompt_embeds is not None:
        embeds = to_prompt_embeds_array(request.prompt_embeds, info.hidden_size)
        if embeds.shape[0] != len(ids):
            raise InvalidRequestError(f"prompt_embeds has {embeds.shape[0]} rows for {len(ids)} prompt positions")
        check_embeds_params(params)


def _make_lora_checker(config: EngineConfig) -> LoRAChecker:
    """The engine's adapter check: with the model's module shapes and layer count when LoRA is on."""
    if config.lora is None:
        return LoRAChecker(None)
    from asyncllm.lora.weights import arch_module_shapes
    from asyncllm.model.loading.arch_config import read_arch_config

    arch = read_arch_config(config.model.model_path)
    return LoRAChecker(config.lora, arch_module_shapes(arch), arch.num_hidden_layers)


class EngineCore:
    """Builds the executor, sizes and allocates the KV cache, builds the scheduler, and runs steps.

    Attributes:
        ready_info: KV block count, max model length and vocabulary size, for the frontend.
    Args:
        config: the engine config.
        executor_class: overrides `config.parallel.distributed_executor_backend` (tests, custom executors).
    Raises:
        ConfigError: unknown executor backend.
        ExecutorError: a worker failed to start, load the model or allocate the cache.
    """

    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        self.executor = (executor_class or get_executor_class(config.parallel.distributed_executor_backend))(config)
        num_blocks = self.executor.determine_num_kv_blocks()
        self.executor.initialize_kv_cache(num_blocks)
        self.ready_info = self._cap_max_model_len(self.executor.get_ready_info(num_blocks))
        self.structured_output_manager = StructuredOutputManager(
            make_tokenizer_loader(config.model.model_path),
            self.ready_info.vocab_size,
            prebuild=config.scheduler.prebuild_grammar_compiler,
        )
        self.scheduler = Scheduler(
            config.scheduler,
            num_blocks,
            config.cache.block_size,
            self.ready_info.max_model_len,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            kv_cache_bytes=self.executor.get_kv_cache_bytes(),
            structured_output_manager=self.structured_output_manager,
            speculative_config=config.speculative,
            max_loras=None if config.lora is None else config.lora.max_loras,
        )
        self.lora_checker = _make_lora_checker(config)

    def _cap_max_model_len(self, info: EngineReadyInfo) -> EngineReadyInfo:
        """A sequence must fit in the whole KV cache, or it could never finish: cap max_model_len to it."""
        capacity = info.num_kv_blocks * self.config.cache.block_size
        if capacity >= info.max_model_len:
            return info
        logger.warning(
            "KV cache holds %d tokens < max_model_len %d: capping max_model_len", capacity, info.max_model_len
        )
        return EngineReadyInfo(info.num_kv_blocks, capacity, info.vocab_size, info.hidden_size)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. The frontend validated it; a request that arrives otherwise (a raw frame) is checked
        again here, so no message can make a step fail for every request.

        Raises:
            InvalidRequestError: a prompt that is empty, too long, or has a token id outside the vocabulary, a
                sampling parameter the frontend would have refused, a LoRA adapter that is off, unreadable or does
                not fit the model, or the id of a request still in the engine (the request fails alone).
        """
        check_request(request, self.ready_info)
        if request.lora_request is not None:
            request.lora_request = self.lora_checker.check(request.lora_request)
        if request.request_id in self.scheduler.requests:  # two live requests under one id break the step
            raise InvalidRequestError(f"request id {request.request_id!r} is already in the engine")
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish these requests now and free their blocks; no output is emitted for them; unknown ids are
        ignored. They are listed in `finished_requests` of the next step's outputs."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model, update the requests.

        Returns:
            The step's outputs; no outputs when nothing was scheduled.
        Raises:
            ExecutorError: a worker failed (the engine is then unusable).
        """
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0 and not scheduler_output.finished_req_ids:
            self.structured_output_manager.wait_for_pending(GRAMMAR_WAIT_SECONDS)
            return self.scheduler.make_empty_outputs()
        started = time.perf_counter()
        model_runner_output = self.executor.execute_model(scheduler_output)
        if self.scheduler.drafter is not None:
            self.scheduler.drafter.observe_step(scheduler_output, time.perf_counter() - started)
        return self.scheduler.update_from_output(scheduler_output, model_runner_output)

    def has_unfinished_requests(self) -> bool:
        """True while a step has work: unfinished requests, or finished ones the workers must still drop."""
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests()

    # ---- utilities (`messages.engine.UTILITY_METHODS` names these methods, and only these) -------------

    def get_scheduler_stats(self) -> SchedulerStats:
        """The scheduler's counts now (running, waiting, free and total KV blocks, prefix-cache counters)."""
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Returns False (nothing changed) while requests hold KV cache blocks."""
        return self.scheduler.reset_prefix_cache()

    def set_scheduler_paused(self, paused: bool) -> bool:
        """Pause (True) or resume (False) scheduling: while paused no request runs and none is dropped; each keeps
        its place and its KV blocks (vLLM's pause mode "keep"). Returns True."""
        self.scheduler.paused = bool(paused)
        return True

    def collective_rpc(
        self,
        method: str,
        args: list[Any] | tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> list[Any]:
        """Call `Worker.<method>(*args, **kwargs)` on every worker; one result per worker, by rank.

        Raises:
            ExecutorError: a worker raised, died, or did not answer within `timeout` seconds.
        """
        return self.executor.collective_rpc(method, tuple(args), kwargs, timeout, unique_reply_rank)

    def count_request_states(self) -> dict[str, int]:
        """How many requests each per-request structure holds now (leak checks; all 0 when idle): the scheduler's
        request map, waiting queue, running list and KV block tables, grammars pending, and the requests cached
        by the busiest worker's model runner (finished requests leave it in the step after they finish)."""
        scheduler = self.scheduler
        manager = scheduler.kv_cache_manager
        return {
            "scheduler.requests": len(scheduler.requests),
            "scheduler.waiting": len(scheduler.waiting),
            "scheduler.running": len(scheduler.running),
            "kv_cache_manager.block_tables": len(manager._req_to_blocks),
            "kv_cache_manager.num_cached_blocks": len(manager._req_to_num_cached_blocks),
            "structured_outputs.pending": len(self.structured_output_manager.pending),
            "model_runner.requests": max(self.executor.collective_rpc("count_requests")),
        }

    def echo(self, *args: Any) -> list[Any]:
        """Return the arguments (round-trip probes of the client <-> core path)."""
        return list(args)

    # ---- health ------------------------------------------------------------------------------------------

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback()` (from any thread) when a worker dies; the busy loop queues EXECUTOR_FAILED."""
        self.executor.register_failure_callback(callback)

    def check_health(self) -> None:
        """Raises `ExecutorError` (the executor's reason) if a worker died."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the executor and its workers, and the grammar compile threads. Idempotent."""
        self.structured_output_manager.shutdown()
        self.executor.shutdown()
