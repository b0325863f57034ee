"""User-facing `EngineArgs`, resolved into the small frozen configs the engine is built from.

`EngineArgs` is what users write; `EngineArgs.create_engine_config()` resolves the model (downloading the
default model once) and splits the arguments into `ModelConfig`, `CacheConfig`, `SchedulerConfig` and
`ParallelConfig`, each frozen, each passed only to the parts that need it. The parts live in `engine_config.py`
and are importable from here too.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncllm.engine_config import (
    BLOCK_QUANTIZATIONS,
    KV_CACHE_DTYPES,
    LINEAR_KERNEL_ENV,
    LOGPROBS_MODES,
    CacheConfig,
    DataParallelBackend,
    EngineConfig,
    LoadFormat,
    LogprobsMode,
    LoRAConfig,
    MetricsPrefix,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    Quantization,
    QuantizationArg,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    executor_backend_name,
    parse_linear_kernels,
)
from asyncllm.errors import ConfigError

if TYPE_CHECKING:
    from asyncllm.model.loading.gguf_metadata import GGUFTensorInfo

__all__ = [
    "DEFAULT_MODEL",
    "AsyncEngineArgs",
    "CacheConfig",
    "DataParallelBackend",
    "EngineArgs",
    "EngineConfig",
    "LoRAConfig",
    "LoadFormat",
    "ModelConfig",
    "ObservabilityConfig",
    "ParallelConfig",
    "Quantization",
    "QuantizationArg",
    "SchedulerConfig",
    "SchedulingPolicy",
    "SpeculativeConfig",
    "executor_backend_name",
]

DEFAULT_MODEL = "smollm2-135m-instruct"


def load_chat_template(value: str | os.PathLike[str]) -> str:
    """The chat template a user gave (`EngineArgs.chat_template`): the text of the file at `value` if it names one,
    else `value` itself when it is Jinja2 template text (has "{{" or "{%").

    Raises:
        ConfigError: neither a readable file nor template text, or a Jinja2 syntax error (with its line).
    """
    import jinja2

    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"EngineArgs.chat_template={value!r}: must be a file path or Jinja2 template text")
    path = pathlib.Path(value)
    text = str(value)
    if "{{" not in text and "{%" not in text:
        try:
            text = path.read_text()
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"EngineArgs.chat_template={_shorten(str(value))!r} is neither a readable file ({exc}) nor Jinja2 "
                "template text"
            ) from exc
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)  # as the tokenizer renders it
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"EngineArgs.chat_template: Jinja2 syntax error on line {exc.lineno}: {exc.message}") from exc
    return text


def _shorten(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(kw_only=True)
class EngineArgs:
    """Arguments of an engine, as users write them. Unknown keys are rejected (TypeError from the
    constructor, ConfigError from `from_dict`).

    Fields:
        model: "smollm2-135m-instruct" (default; fetched once into the user cache), a `.gguf` path, or an HF
            directory with config.json, *.safetensors and tokenizer.json (paths as str or `pathlib.Path`).
        max_model_len: tokens per sequence at most; None = the model's context length.
        block_size: tokens per KV cache block.
        num_kv_blocks: KV cache blocks (override); None = sized from `kv_cache_memory_bytes`.
        kv_cache_memory_bytes: KV cache budget in bytes; None (default) = enough for `max_num_seqs` sequences
            of `max_model_len` tokens, capped by 5% of the memory available at start (see the README).
        max_num_seqs: concurrent running requests at most.
        max_num_batched_tokens: tokens per step at most.
        long_prefill_token_threshold: a request computes at most this many prompt tokens in one step (vLLM's
            option of that name: a long prompt goes in chunks of this size, so the decodes sharing its steps wait
            less per token); 0 (default): only `max_num_batched_tokens` bounds a chunk.
        num_threads: torch threads per worker; None = torch's default.
        seed: global seed.
        engine_process: engine core in its own process (True, default: model work never competes with the
            caller's event loop, and a crash there cannot take the caller down) or in a background thread (False).
        load_format: "auto" or "dummy" (random weights).
        quantization: "auto" (default), None or "none" (float32 weights), "int8", "q8_0", "q4_0" or "gguf". "auto":
            "gguf" for a GGUF file whose layer linear weights are all block-quantized already (the default model's
            Q4_1 file: batch-1 decoding ~5x fp32's speed in ~1/4 of its memory; accuracy against fp32 in README
            "Speed"), float32 for anything else (float weights, HF directories, load_format="dummy") and where the
            block modes cannot run (tensor_parallel_size > 1); the start-up log names the choice and why
            (`model/loading/quant_choice.py`). "int8": every linear layer and
            the LM head run with int8 weights (per output channel) and int8 per-row dynamic activations, after
            SmoothQuant; from float or GGUF checkpoints (GGUF is dequantized, then requantized). "q8_0" / "q4_0":
            every linear layer and the LM head stored in blocks of 32 input values (8 or 4 bits and a float16 scale
            per block), products with int8 activation blocks on asyncllm's own kernels
            (`model/kernels/block_quant.py`). "gguf": a GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks kept as they are
            (SmolLM2's Q4_1 file: Q4_1 layers, Q8_0 LM head); other GGUF block types (Q4_K, Q5_0, Q6_K, ...) and
            float checkpoints requantized to Q8_0. The block modes need tensor_parallel_size=1 (asked for explicitly
            with more ranks, a ConfigError); LoRA adapters run on them, their delta added to the block product.
            See README "Speed" and docs/benchmarks.md.
        linear_kernels: force the kernel of a kind of linear product, e.g. {"int8": "int_mm"} or "int8=int_mm"
            (int8: "onednn", "int_mm", "avx2"; fp32: "matmul", "mkl_packed", "onednn"). None (default): each
            is chosen by timing the candidates on the host at first start (cached; docs/kernels.md). The
            environment variable `ASYNCLLM_LINEAR_KERNELS` does the same; this argument wins.
        distributed_executor_backend: "uni" (model in the engine process, default), "mp" (one worker process
            per rank), "ray" (one Ray actor per rank; `asyncllm[ray]`), an `Executor` subclass or
            "package.module:Class". See docs/executors.md.
        tensor_parallel_size: ranks sharding the model ("mp"/"ray"); must divide the model's query heads, KV
            heads and MLP width (SmolLM2-135M: 1 or 3).
        ray_address: Ray cluster address for "ray" (None: `RAY_ADDRESS`, the Ray already initialized, or a
            new local cluster).
        ray_placement_timeout_s: seconds to wait for the Ray placement group's CPUs before failing.
        ray_cpus_per_worker: CPUs each rank reserves in the Ray placement group (fractional allowed; default 1).
        data_parallel_size: independent engine cores (each with its own executor) behind this client; requests
            are balanced between them (docs/data_parallel.md). Needs `engine_process=True`.
        data_parallel_backend: "mp" (engine processes on this machine; torch threads split between them) or
            "ray" (each engine core a Ray actor in its own placement group, on any node of the cluster;
            `asyncllm[ray]`; uses `ray_address`, `ray_cpus_per_worker`, `ray_placement_timeout_s`).
        restart_dead_engines: with `data_parallel_size > 1`, a dead engine fails only its own requests and a
            fresh engine takes its rank (default False: the first engine death makes the AsyncLLM dead).
        engine_timeout: seconds the engine may stay silent (no heartbeat) while its outputs are expected
            (requests in flight, a utility call) before the client reports it unresponsive (`EngineDeadError`,
            e.g. a SIGSTOPped or frozen engine process). The heartbeat comes from a thread of the engine beside its
            busy loop, so a long step is not silence. None (default) = off: only an engine that exits is noticed.
            See docs/reliability.md.
        enable_prefix_caching: reuse cached KV blocks of shared prompt prefixes (default on).
        populate_kv_cache: write every page of the KV cache at start-up, so its memory is resident from the start
            and the first requests take no page faults (Linux `madvise(MADV_POPULATE_WRITE)`); start-up then takes
            longer (on a KVM guest here, 2.4 s for 1.1 GB), and a cache that does not fit fails at start.
            `asyncllm serve` turns it on; the library leaves it off (the cache becomes resident as requests first
            write into blocks; README "Memory").
        scheduling_policy: "fcfs" (default) or "priority" (`generate(..., priority=)`, lower first).
        prebuild_grammar_compiler: import xgrammar and build its vocabulary tables in a background thread as
            soon as the engine is up (about 2.5 s of CPU), so the first structured-output request does not wait
            for them; `asyncllm serve` turns it on, the library leaves it off (engines that never constrain
            output pay nothing).
        log_stats: log engine stats (throughput, queue, KV cache, prefix cache hits) periodically.
        stats_log_interval: seconds between two stats log lines (with `log_stats`).
        speculative_config: None (off) or n-gram speculative decoding as in vLLM, a dict or its JSON text:
            {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}.
            See docs/speculative.md.
        enable_lora: accept `generate(..., lora_request=LoRARequest(...))`: PEFT LoRA adapters applied per request
            over the shared base model (docs/lora.md). Not with `quantization="int8"` or a block mode ("auto" gives
            float32 weights with it).
        max_loras: distinct adapters running at once, and adapters kept loaded (LRU); vLLM's default 1.
        max_lora_rank: the largest adapter rank accepted, 1..64; vLLM's default 16.
        chat_template: a Jinja2 chat template for `chat()` and `/v1/chat/completions`, replacing the model's own
            (as vLLM's `--chat-template`): a path to a template file, or the template text. None (default): the
            model's template; a base model without one refuses chat requests (`InvalidRequestError`, HTTP 400).
        enforce_eager: vLLM's switch off CUDA graphs and compilation; asyncllm always runs eagerly (CPU, no graphs,
            no compilation), so True and False both hold as asked, and change nothing (accepted for vLLM code).
        max_logprobs: vLLM's: `logprobs` / `prompt_logprobs` a request may ask for at most (default 20); -1 = the
            whole vocabulary (`SamplingParams(logprobs=-1)`).
        logprobs_mode: vLLM's: what logprobs carry: "raw_logprobs" (default: log_softmax of the model's logits),
            "raw_logits" (the logits themselves), "processed_logprobs" / "processed_logits" (after every edit the
            sampler makes: logits processors, bad words, bias, penalties, temperature, min-p, top-k, top-p; sample
            logprobs only: prompt logprobs stay raw, and greedy rows are processed with temperature 1).
        skip_tokenizer_init: vLLM's: load no tokenizer: prompts must be token ids, outputs carry token ids and an
            empty text (`detokenize=False`); stop strings, bad words, chat prompts and structured outputs are
            refused. EOS comes from the checkpoint's metadata.
        disable_log_stats: vLLM's switch, the inverse of `log_stats`: True turns the periodic stats log line off
            (asyncllm's default), False turns it on. None (default) leaves `log_stats` alone. Prometheus metrics
            are kept either way (vLLM's True would also stop them).
        metrics_prefix: "asyncllm" (default) or "vllm": the Prometheus metric names' prefix (`vllm:` for vLLM's
            dashboards; `llm.get_metrics()` reads either).
        dtype: vLLM's model dtype: "auto", "float32" or "float" (torch.float32 too) run as asked: asyncllm
            computes in float32 on CPU. "bfloat16", "float16", "half" and other types raise ConfigError (use
            `quantization="int8"`, "q8_0", "q4_0" or "gguf" for smaller weights).
        kv_cache_dtype: vLLM's KV cache element type: "auto" (default), "bfloat16" (K/V rounded to bfloat16 as
            they are cached: half the memory per block, so twice the blocks in the same budget; prefill attention
            multiplies in bfloat16 on CPUs with AVX512_BF16, decode attention widens the cached K/V to float32), or
            asyncllm's "float32". "auto" is float32 for float32 weights (vLLM's rule: the model's dtype) and
            bfloat16 for quantized weights on a CPU with AVX512_BF16 (`model/loading/kv_cache_choice.py`; the
            engine logs the choice and why). Other vLLM values ("fp8", "fp8_e4m3", "fp8_e5m2", ...) raise
            ConfigError. Accuracy: README "Memory".
    Raises:
        ConfigError: from `from_dict` or `create_engine_config` for unknown keys or bad values.
    """

    model: str | os.PathLike[str] = DEFAULT_MODEL
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    long_prefill_token_threshold: int = 0
    num_threads: int | None = None
    seed: int = 0
    engine_process: bool = True
    load_format: LoadFormat = "auto"
    quantization: QuantizationArg | None = "auto"
    linear_kernels: dict[str, str] | str | None = None
    distributed_executor_backend: str | type = "uni"
    tensor_parallel_size: int = 1
    ray_address: str | None = None
    ray_placement_timeout_s: float = 60.0
    ray_cpus_per_worker: float = 1.0
    data_parallel_size: int = 1
    data_parallel_backend: DataParallelBackend = "mp"
    restart_dead_engines: bool = False
    engine_timeout: float | None = None
    enable_prefix_caching: bool = True
    populate_kv_cache: bool = False
    scheduling_policy: SchedulingPolicy = "fcfs"
    prebuild_grammar_compiler: bool = False
    log_stats: bool = False
    stats_log_interval: float = 5.0
    speculative_config: dict[str, Any] | str | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    chat_template: str | None = None
    enforce_eager: bool = False
    max_logprobs: int = 20
    logprobs_mode: LogprobsMode = "raw_logprobs"
    skip_tokenizer_init: bool = False
    disable_log_stats: bool | None = None
    dtype: Any = "auto"
    kv_cache_dtype: str = "auto"
    metrics_prefix: MetricsPrefix = "asyncllm"

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineArgs:
        """Build from a mapping, rejecting keys that are not fields.

        Raises:
            ConfigError: naming the unknown keys.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown EngineArgs keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)

    def validate(self) -> None:
        """Check ranges.

        Raises:
            ConfigError: naming the field and its allowed range.
        """
        if not isinstance(self.model, (str, os.PathLike)):
            raise ConfigError(f"EngineArgs.model={self.model!r}: must be a str or a path (os.PathLike)")
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "tensor_parallel_size": self.tensor_parallel_size,
            "data_parallel_size": self.data_parallel_size,
        }
        optional_positive = {
            "max_model_len": self.max_model_len,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "num_threads": self.num_threads,
        }
        for name, value in {**positive, **optional_positive}.items():
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"EngineArgs.{name}={value!r} is invalid: must be an integer >= 1")
        threshold = self.long_prefill_token_threshold
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise ConfigError(
                f"EngineArgs.long_prefill_token_threshold={threshold!r} is invalid: must be an integer >= 0 (0: off)"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"EngineArgs.load_format={self.load_format!r}: must be 'auto' or 'dummy'")
        if self.quantization not in (None, "auto", "none", "int8", *BLOCK_QUANTIZATIONS):
            raise ConfigError(
                f"EngineArgs.quantization={self.quantization!r}: must be 'auto', None or 'none' (float32), 'int8', "
                "'q8_0', 'q4_0' or 'gguf'"
            )
        if self.quantization in BLOCK_QUANTIZATIONS and self.tensor_parallel_size > 1:
            raise ConfigError(
                f"EngineArgs.quantization={self.quantization!r} does not run with tensor_parallel_size > 1 yet (the "
                "block weights are not sharded across ranks in this version); use TP=1, or 'int8' / None with TP"
            )
        parse_linear_kernels(self.linear_kernels)
        parse_linear_kernels(os.environ.get(LINEAR_KERNEL_ENV), source=LINEAR_KERNEL_ENV)
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"EngineArgs.scheduling_policy={self.scheduling_policy!r}: must be 'fcfs' or 'priority'")
        if not isinstance(self.ray_placement_timeout_s, (int, float)) or not self.ray_placement_timeout_s > 0:
            raise ConfigError(
                f"EngineArgs.ray_placement_timeout_s={self.ray_placement_timeout_s!r}: must be > 0 (seconds)"
            )
        if not isinstance(self.ray_cpus_per_worker, (int, float)) or not self.ray_cpus_per_worker > 0:
            raise ConfigError(f"EngineArgs.ray_cpus_per_worker={self.ray_cpus_per_worker!r}: must be > 0")
        timeout = self.engine_timeout
        number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
        if timeout is not None and (not number or not timeout > 0):
            raise ConfigError(f"EngineArgs.engine_timeout={timeout!r}: must be None or > 0 (seconds)")
        if not isinstance(self.stats_log_interval, (int, float)) or not self.stats_log_interval > 0:
            raise ConfigError(f"EngineArgs.stats_log_interval={self.stats_log_interval!r}: must be > 0")
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"EngineArgs.enforce_eager={self.enforce_eager!r}: must be True or False")
        self._validate_vllm_args()
        if self.speculative_config is not None:
            SpeculativeConfig.from_user(self.speculative_config)
        if self.chat_template is not None:
            load_chat_template(self.chat_template)
        self._validate_data_parallel()
        self._validate_lora()

    def _validate_vllm_args(self) -> None:
        """vLLM's arguments: `max_logprobs`, `logprobs_mode`, `skip_tokenizer_init`, `disable_log_stats`, `dtype`,
        `kv_cache_dtype`."""
        logprobs = self.max_logprobs
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < -1:
            raise ConfigError(f"EngineArgs.max_logprobs={logprobs!r} is invalid: must be -1 (the vocabulary) or >= 0")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"EngineArgs.logprobs_mode={self.logprobs_mode!r}: must be one of {list(LOGPROBS_MODES)}")
        for name in ("skip_tokenizer_init", "disable_log_stats"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name == "disable_log_stats"):
                raise ConfigError(f"EngineArgs.{name}={value!r}: must be True or False")
        if self.disable_log_stats is True and self.log_stats:
            raise ConfigError("EngineArgs.log_stats=True and disable_log_stats=True disagree; give one of them")
        dtype_name(self.dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"EngineArgs.kv_cache_dtype={self.kv_cache_dtype!r} is not supported: must be one of "
                f"{list(KV_CACHE_DTYPES)} (fp8 and float16 caches are not implemented)"
            )
        if self.metrics_prefix not in ("asyncllm", "vllm"):
            raise ConfigError(f"EngineArgs.metrics_prefix={self.metrics_prefix!r}: must be 'asyncllm' or 'vllm'")
        if self.logprobs_mode.startswith("processed_") and self.speculative_config is not None:
            raise ConfigError(
                f"EngineArgs.logprobs_mode={self.logprobs_mode!r} does not work with speculative_config: verified "
                "tokens are scored on the raw logits; use 'raw_logprobs' or 'raw_logits'"
            )

    def _validate_lora(self) -> None:
        from asyncllm.lora.peft import MAX_LORA_RANK

        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ConfigError(f"EngineArgs.max_loras={self.max_loras!r} is invalid: must be an integer >= 1")
        rank = self.max_lora_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_LORA_RANK:
            raise ConfigError(f"EngineArgs.max_lora_rank={rank!r} is invalid: must be an integer in 1..{MAX_LORA_RANK}")
        if self.enable_lora and self.quantization == "int8":
            raise ConfigError(
                "EngineArgs.enable_lora does not work with quantization='int8': SmoothQuant rescales the linear "
                "layers' inputs, which an adapter's A does not expect"
            )

    def _resolve_quantization(
        self, model_path: pathlib.Path, header: tuple[dict[str, Any], list[GGUFTensorInfo]] | None
    ) -> tuple[Quantization | None, str]:
        """`self.quantization` as the engine runs it, and why when it was "auto" ("" otherwise): "none" is None,
        "auto" goes by `model/loading/quant_choice.choose_quantization`."""
        from asyncllm.model.loading.quant_choice import choose_quantization

        if self.quantization != "auto":
            return (None if self.quantization == "none" else self.quantization), ""
        choice = choose_quantization(
            model_path,
            None if header is None else header[1],
            load_format=self.load_format,
            tensor_parallel_size=self.tensor_parallel_size,
        )
        return choice.quantization, choice.reason  # the loader logs the reason at start-up

    def _validate_data_parallel(self) -> None:
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ConfigError(f"EngineArgs.data_parallel_backend={self.data_parallel_backend!r}: must be 'mp' or 'ray'")
        if self.data_parallel_size > 1 and not self.engine_process:
            raise ConfigError(
                "EngineArgs.data_parallel_size > 1 needs engine_process=True: engine cores in threads of one process"
                " share its interpreter lock, so a second one adds no throughput"
            )
        if self.data_parallel_size > 1 and self.engine_timeout is not None:
            raise ConfigError(
                "EngineArgs.engine_timeout is not supported with data_parallel_size > 1 yet: the engines share one"
                " heartbeat socket, so one frozen engine would go unnoticed"
            )

    def create_engine_config(self) -> EngineConfig:
        """Validate, resolve the model to a local path (fetching the default model once), read and check its
        config (every config.json / GGUF metadata key read or known not to change the math: see
        `model/loading/arch_config.py`), and split. All of it before any engine process starts.

        Raises:
            ConfigError: bad values, or a checkpoint config this engine cannot honour (naming the key and value).
            ModelNotFoundError: the model cannot be resolved or fetched.
        """
        from asyncllm.distributed.tp_sizes import check_tp_divides
        from asyncllm.model.loading.arch_config import check_max_model_len, max_prompt_len, read_arch_config
        from asyncllm.model.loading.gguf_config import read_checked_gguf_header
        from asyncllm.model.loading.kv_cache_choice import choose_kv_cache_dtype
        from asyncllm.model.loading.resolve import resolve_model_path
        from asyncllm.utils.cpu_info import cpu_info

        self.validate()
        model_path = resolve_model_path(self.model)
        gguf = model_path.suffix.lower() == ".gguf" and model_path.is_file()
        header = read_checked_gguf_header(model_path) if gguf else None
        arch = read_arch_config(model_path, header)
        check_max_model_len(arch, self.max_model_len)
        tp = self.tensor_parallel_size
        check_tp_divides(arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size, tp)
        if self.enable_lora and arch.architecture in ("gemma2", "gemma3"):
            raise ConfigError(
                f"EngineArgs.enable_lora is not supported for {arch.architecture} models (model/gemma3.py)"
            )
        quantization, quantization_reason = self._resolve_quantization(model_path, header)
        kv_cache = choose_kv_cache_dtype(
            self.kv_cache_dtype,
            quantization,
            head_dim=arch.head_dim,
            attn_logit_softcapping=arch.attn_logit_softcapping,
            cpu=cpu_info(),
        )
        model = ModelConfig(
            max_logprobs=self.max_logprobs,
            logprobs_mode=self.logprobs_mode,
            skip_tokenizer_init=self.skip_tokenizer_init,
            model=os.fspath(self.model),
            model_path=str(model_path),
            load_format=self.load_format,
            max_model_len=self.max_model_len,
            seed=self.seed,
            quantization=quantization,
            quantization_reason=quantization_reason,
            linear_kernels=parse_linear_kernels(self.linear_kernels) or None,
            max_prompt_len=max_prompt_len(arch),
        )
        cache = CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_prefix_caching=bool(self.enable_prefix_caching),
            populate=bool(self.populate_kv_cache),
            cache_dtype=kv_cache.dtype,
            cache_dtype_reason=kv_cache.reason,
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            scheduling_policy=self.scheduling_policy,
            prebuild_grammar_compiler=self.prebuild_grammar_compiler,
        )
        parallel = ParallelConfig(
            engine_process=self.engine_process,
            num_threads=self.num_threads,
            distributed_executor_backend=executor_backend_name(self.distributed_executor_backend, self.engine_process),
            tensor_parallel_size=self.tensor_parallel_size,
            ray_address=self.ray_address,
            ray_placement_timeout_s=float(self.ray_placement_timeout_s),
            ray_cpus_per_worker=float(self.ray_cpus_per_worker),
            data_parallel_size=self.data_parallel_size,
            data_parallel_backend=self.data_parallel_backend,
            restart_dead_engines=bool(self.restart_dead_engines),
            engine_timeout=None if self.engine_timeout is None else float(self.engine_timeout),
        )
        log_stats = bool(self.log_stats) if self.disable_log_stats is None else not self.disable_log_stats
        observability = ObservabilityConfig(
            log_stats=log_stats, stats_log_interval=float(self.stats_log_interval), metrics_prefix=self.metrics_prefix
        )
        speculative = None if self.speculative_config is None else SpeculativeConfig.from_user(self.speculative_config)
        return EngineConfig(
            model=model,
            cache=cache,
            scheduler=scheduler,
            parallel=parallel,
            observability=observability,
            speculative=speculative,
            lora=LoRAConfig(self.max_loras, self.max_lora_rank) if self.enable_lora else None,
        )


FLOAT32_DTYPES = ("auto", "float32", "float")  # vLLM's dtype names asyncllm runs as asked (it computes in float32)


def dtype_name(dtype: Any) -> str:
    """vLLM's `dtype` argument as asyncllm runs it: "float32".

    Raises:
        ConfigError: any dtype other than "auto", "float32", "float" or torch.float32, naming it.
    """
    name = str(dtype).removeprefix("torch.") if not isinstance(dtype, str) else dtype
    if name not in FLOAT32_DTYPES:
        raise ConfigError(
            f"EngineArgs.dtype={dtype!r} is not supported: asyncllm computes in float32 on CPU; use dtype='auto' or "
            "'float32' (quantization='int8' gives smaller weights)"
        )
    return "float32"


AsyncEngineArgs = EngineArgs
"""vLLM's name for the engine arguments of its `AsyncLLM` (`vllm.engine.arg_utils.AsyncEngineArgs`): the same
class here, so vLLM code that builds `AsyncEngineArgs(...)` runs unchanged."""
