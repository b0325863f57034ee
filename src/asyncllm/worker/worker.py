"""`Worker`: one model replica with its KV cache, driven by an executor.

It sets the torch thread count (or adapts it to contention, `worker/thread_policy.py`), loads the model,
sizes and allocates the paged KV cache, and runs each step through its `ModelRunner`. Every public method is
callable by name through `Executor.collective_rpc`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import cast

import torch

from asyncllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from asyncllm.engine_config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.lora.manager import LoRAManager
from asyncllm.messages.scheduler import ModelRunnerOutput, SchedulerOutput
from asyncllm.model.arch import ModelArchConfig
from asyncllm.model.kernels.fp32 import set_gemm_threads
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.loading.loader import load_model
from asyncllm.worker.kv_cache_sizing import allocate_zeroed, available_memory_bytes, default_num_kv_blocks
from asyncllm.worker.model_runner import CausalLM, ModelRunner
from asyncllm.worker.thread_policy import AdaptiveThreads, SystemIdleMeter

logger = logging.getLogger(__name__)
KV_CACHE_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # `CacheConfig.cache_dtype` -> torch


class Worker:
    """Loads the model and runs it.

    At `tensor_parallel_size` N > 1 the worker first joins the gloo group of N ranks, then loads only its shard
    of the weights (see `model/llama.py`) and allocates only its KV heads; every rank samples the same tokens
    (replicated logits, same seeds) and the executor returns rank 0's.

    Args:
        config: the engine config (model, cache and parallel parts are used).
        rank: this worker's tensor-parallel rank (0 for `uni`).
        distributed_init_method: rendezvous URL of the TP group; required when tensor_parallel_size > 1.
    Raises:
        ModelNotFoundError, OSError, ValueError: from loading the model.
        ConfigError: the TP size does not divide the model's head counts.
        RuntimeError: the TP group did not form.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.tp_size = config.parallel.tensor_parallel_size
        num_threads = config.parallel.num_threads
        if num_threads is None and self.tp_size > 1:
            num_threads = 1  # N ranks share the machine's cores; oversubscription costs more than it gains
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        # num_threads=None on one rank: adapt between torch's default count and 1 by measured step time.
        adapt = num_threads is None and torch.get_num_threads() > 1
        set_gemm_threads(torch.get_num_threads())  # packed products keep them when the policy drops to one
        self.thread_policy = AdaptiveThreads(torch.get_num_threads(), idle_meter=SystemIdleMeter()) if adapt else None
        if self.tp_size > 1:
            if distributed_init_method is None:
                raise ValueError("tensor_parallel_size > 1 needs a distributed_init_method")
            init_tensor_parallel(rank, self.tp_size, distributed_init_method)
        self.model = cast(CausalLM, load_model(config.model, pack_weights=True))
        self.arch: ModelArchConfig = self.model.arch
        lora = config.lora
        lora_manager = None
        if lora is not None:
            layers = getattr(self.model, "layers", None)
            if layers is None:
                raise ConfigError(f"EngineArgs.enable_lora: {type(self.model).__name__} has no decoder layers to adapt")
            lora_manager = LoRAManager(self.arch, list(layers), lora.max_loras, lora.max_lora_rank)
        self.model_runner = ModelRunner(
            self.model,
            config.cache.block_size,
            self.arch.vocab_size,
            seed=config.model.seed,
            lora_manager=lora_manager,
            logprobs_mode=config.model.logprobs_mode,
        )

    def linear_kernels(self) -> str:
        """Which kernel runs each linear product of this rank's model, per row class, and why (measured, cached or
        forced; `model/kernels/choice.py`), as logged at load; for `collective_rpc("linear_kernels")`."""
        return str(getattr(self.model, "linear_kernels", ""))

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank holds: num_key_value_heads / tensor_parallel_size."""
        return self.arch.num_key_value_heads // self.tp_size

    def determine_num_kv_blocks(self) -> int:
        """Blocks to allocate (>= 1): `CacheConfig.num_kv_blocks` if set; else `kv_cache_memory_bytes` divided
        by the bytes of one block over all layers; else the default size (`kv_cache_sizing.default_num_kv_blocks`:
        `max_num_seqs` sequences of `max_model_len` tokens, capped by a fraction of available memory). Budgets
        are the engine's total: at TP=N each rank holds 1/N of every block (and counts 1/N of the available
        memory), so the block count does not depend on N."""
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        bytes_per_block = self.arch.kv_cache_bytes_per_block(cache.block_size, cache.cache_itemsize)
        if cache.kv_cache_memory_bytes is not None:
            return max(1, cache.kv_cache_memory_bytes // bytes_per_block)
        max_model_len, _ = self.get_model_info()
        max_num_seqs = self.config.scheduler.max_num_seqs
        return default_num_kv_blocks(
            max_num_seqs, max_model_len, cache.block_size, bytes_per_block, available_memory_bytes()
        )

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: float32 or bfloat16 (`CacheConfig.cache_dtype`)."""
        return KV_CACHE_TORCH_DTYPES[self.config.cache.cache_dtype]

    def _kv_cache_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """One layer's KV cache on this rank: [num_blocks, 2 (K, V), block_size, num_kv_heads / tp_size, head_dim]."""
        return (num_blocks, 2, self.config.cache.block_size, self.num_local_kv_heads, self.arch.head_dim)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate one zeroed [num_blocks, 2, block_size, num_kv_heads / tp_size, head_dim] tensor per layer
        (this rank's KV heads only; float32 or bfloat16, `CacheConfig.cache_dtype`), on lazily committed
        memory (`kv_cache_sizing.allocate_zeroed`), or made resident at once with `CacheConfig.populate`. Logs
        its size (and the seconds populating took) at INFO.

        Raises:
            ConfigError: the operating system refuses that much memory (names the size and what is available).
        """
        arch, dtype = self.arch, self.kv_cache_dtype
        shape = self._kv_cache_shape(num_blocks)
        size = num_blocks * 2 * shape[2] * shape[3] * shape[4] * dtype.itemsize * arch.num_hidden_layers
        populate = self.config.cache.populate
        start = time.perf_counter()
        try:
            self.model_runner.kv_caches = [
                allocate_zeroed(shape, dtype, populate) for _ in range(arch.num_hidden_layers)
            ]
        except (OSError, MemoryError, RuntimeError) as e:
            self.model_runner.kv_caches = []
            raise ConfigError(
                f"the KV cache of {num_blocks} blocks ({size / 2**30:.1f} GiB on this rank) does not fit in memory "
                f"({available_memory_bytes() / 2**30:.1f} GiB available): lower num_kv_blocks or "
                f"kv_cache_memory_bytes ({type(e).__name__}: {e})"
            ) from e
        seconds = time.perf_counter() - start
        residency = f"resident: populated in {seconds:.2f} s" if populate else "reserved; resident where written"
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens), %s, %.1f MiB on rank %d (%s)",
            num_blocks,
            shape[2],
            num_blocks * shape[2],
            str(dtype).removeprefix("torch."),
            size / 2**20,
            self.rank,
            residency,
        )
        if self.config.cache.cache_dtype_reason and self.rank == 0:  # `kv_cache_dtype="auto"`: what and why
            logger.info("%s", self.config.cache.cache_dtype_reason)
        self.warm_up()

    @torch.inference_mode()
    def warm_up(self, num_tokens: int = 32) -> None:
        """Run a dummy prefill and a decode in a scratch KV cache, so the first real request does not pay
        torch's one-time kernel set-up (seconds on a busy 2-core machine). The real KV cache is untouched."""
        arch, block_size = self.arch, self.config.cache.block_size
        num_blocks = -(-(num_tokens + 1) // block_size)
        shape, dtype = self._kv_cache_shape(num_blocks), self.kv_cache_dtype
        scratch = [torch.zeros(shape, dtype=dtype) for _ in range(arch.num_hidden_layers)]
        table = [list(range(num_blocks))]
        prefill = build_attention_metadata([num_tokens], [num_tokens], table, block_size)
        hidden = self.model(torch.zeros(num_tokens, dtype=torch.long), torch.arange(num_tokens), scratch, prefill)
        self.model.compute_logits(hidden[-1:])
        decode = build_attention_metadata([1], [num_tokens + 1], table, block_size)
        hidden = self.model(torch.zeros(1, dtype=torch.long), torch.tensor([num_tokens]), scratch, decode)
        self.model.compute_logits(hidden)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step; see `ModelRunner.execute_model`. Timed by the thread policy, if any."""
        if self.thread_policy is None or scheduler_output.total_num_scheduled_tokens == 0:
            return self.model_runner.execute_model(scheduler_output)
        key = (scheduler_output.total_num_scheduled_tokens, len(scheduler_output.num_scheduled_tokens))
        return cast(
            ModelRunnerOutput, self.thread_policy.run(key, lambda: self.model_runner.execute_model(scheduler_output))
        )

    def get_kv_cache_bytes(self) -> int:
        """Bytes of this rank's KV cache tensors (reserved; resident only where written)."""
        return sum(t.nbytes for t in self.model_runner.kv_caches)

    def get_model_info(self) -> tuple[int, int]:
        """(max_model_len, vocab_size): max_model_len is the configured value capped by the model's context."""
        context = self.arch.max_position_embeddings
        return min(self.config.model.max_model_len or context, context), self.arch.vocab_size

    def get_hidden_size(self) -> int:
        """The model's hidden size (width of prompt embeddings and of pooled embeddings)."""
        return self.arch.hidden_size

    def count_requests(self) -> int:
        """Requests whose state the model runner caches now (leak checks: 0 once the engine is idle)."""
        return len(self.model_runner.requests)

    def list_loras(self) -> list[int]:
        """Ids of the LoRA adapters loaded in this worker, least recently used first (empty when LoRA is off)."""
        manager = self.model_runner.lora_manager
        return [] if manager is None else manager.list_loras()

    def get_pid(self) -> int:
        """This worker's process id (tests and tools use it to find worker processes)."""
        return os.getpid()

    def check_health(self) -> None:
        """Nothing to check in-process: a live worker is healthy."""

    def shutdown(self) -> None:
        """Drop the KV cache and the per-request state."""
        self.model_runner.kv_caches = []
        self.model_runner.requests.clear()
        if self.tp_size > 1:
            destroy_tensor_parallel()
