"""`ModelRunner`: turns a `SchedulerOutput` into one forward pass and one sampled token per finished prefill
or decode.

The runner keeps each request's token ids, block table, computed-token count and generator, updated from each
`SchedulerOutput` (new requests carry everything, cached ones only their new blocks; finished ids are dropped),
so the scheduler never resends what the worker already has. After vLLM v1's `GPUModelRunner`
(vllm/v1/worker/gpu_model_runner.py), without the persistent-batch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from asyncllm.lora.manager import LoRAManager
from asyncllm.lora.request import LoRARequest
from asyncllm.lora.weights import LoRABatch
from asyncllm.messages.engine import LogprobsLists
from asyncllm.messages.scheduler import ModelRunnerOutput, NewRequestData, SchedulerOutput
from asyncllm.model.arch import ModelArchConfig
from asyncllm.model.layers.attention_metadata import AttentionMetadata, build_attention_metadata
from asyncllm.model.layers.kv_mirror import DecodeKVMirror
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured_outputs.bitmask import unpack_bitmask
from asyncllm.worker.logits_processing import RowTokens
from asyncllm.worker.logprobs import compute_logprobs
from asyncllm.worker.pooler import PromptPooler, pool_step
from asyncllm.worker.prompt_embeds import embeds_from_bytes, embeds_override
from asyncllm.worker.rejection_sampler import RejectionSampler, VerificationResult
from asyncllm.worker.sampler import Sampler, SamplingMetadata, seed_generator
from asyncllm.worker.verification import build_verification_metadata

PROMPT_LOGPROBS_ROWS = 256  # prompt positions scored per logits matrix (bounds the memory of prompt_logprobs)


class CausalLM(Protocol):
    """What the runner needs of a model (`asyncllm.model.llama.LlamaForCausalLM` is one)."""

    arch: ModelArchConfig
    decode_reads_cache: bool  # decode attention reads the paged KV cache directly: no dense K/V mirror needed

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
        embeds_override: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden_size] hidden states; writes K/V to the cache;
        adds the LoRA deltas of `lora`'s rows. `embeds_override` = (rows [n] int64, values [n, hidden_size]):
        those rows take the given vectors instead of their embedding lookup (prompt embeddings). The runner
        passes each only when there are any."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] float32 logits."""
        ...


@dataclass
class CachedRequestState:
    """What the worker keeps for one request between steps.

    Fields:
        req_id: request id.
        token_ids: prompt + output tokens known so far (the runner appends what it samples).
        num_prompt_tokens: prompt length.
        block_ids: the request's KV cache block table.
        num_computed_tokens: tokens whose K/V are in the cache.
        sampling_params: its parameters.
        generator: its own generator when seeded, else None (the shared one is used).
        eos_token_id: the model's EOS id, or None.
        prompt_logprobs_parts: prompt logprobs computed chunk by chunk, until the first token is sampled.
        needs_prompt_logprobs: prompt logprobs are still to be sent (False after a resume from preemption).
        pooler: an embedding request's pooled-vector accumulator (it never samples), else None.
        prompt_embeds: an embeddings prompt's [num_prompt_tokens, hidden_size] float32 rows, else None.
        lora_request: its LoRA adapter, or None (base model).
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_id: int | None = None
    prompt_logprobs_parts: list[LogprobsLists] = field(default_factory=list)
    needs_prompt_logprobs: bool = False
    pooler: PromptPooler | None = None
    prompt_embeds: torch.Tensor | None = None
    lora_request: LoRARequest | None = None

    @classmethod
    def from_new_request(cls, new: NewRequestData) -> CachedRequestState:
        seeded = new.sampling_params.seed is not None
        return cls(
            req_id=new.req_id,
            token_ids=[*new.prompt_token_ids, *new.output_token_ids],
            num_prompt_tokens=len(new.prompt_token_ids),
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            sampling_params=new.sampling_params,
            generator=torch.Generator() if seeded else None,
            eos_token_id=new.eos_token_id,
            needs_prompt_logprobs=new.sampling_params.prompt_logprobs is not None and not new.output_token_ids,
            pooler=PromptPooler(new.pooling_params, len(new.prompt_token_ids)) if new.pooling_params else None,
            prompt_embeds=embeds_from_bytes(new.prompt_embeds, len(new.prompt_token_ids)),
            lora_request=new.lora_request,
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def flush_prompt_logprobs(self, output: ModelRunnerOutput) -> None:
        """Put the prompt logprobs computed so far into `output`, once: call when the request samples (its
        prompt is then complete); nothing when it wants none or has sent them."""
        if self.needs_prompt_logprobs:
            output.prompt_logprobs[self.req_id] = LogprobsLists.concat(self.prompt_logprobs_parts)
            self.prompt_logprobs_parts, self.needs_prompt_logprobs = [], False


class ModelRunner:
    """Runs the model for a flat batch of scheduled tokens and samples.

    Args:
        model: the model (see `CausalLM`).
        block_size: tokens per KV cache block.
        vocab_size: logits width.
        seed: seed of the generator shared by unseeded requests.
        lora_manager: loads the requests' LoRA adapters (None = LoRA off).
    """

    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        vocab_size: int,
        seed: int = 0,
        lora_manager: LoRAManager | None = None,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        self.model = model
        self.logprobs_as_logits = logprobs_mode.endswith("_logits")  # vLLM's logprobs_mode
        self.processed_logprobs = logprobs_mode.startswith("processed_")
        self.lora_manager = lora_manager
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.sampler = Sampler(seed)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_mirror: DecodeKVMirror | None = None  # decode K/V kept between decode-only steps

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Update request state, run one forward over every scheduled token, sample where prefills end.

        Returns:
            Sampled token ids for each request whose computed tokens reach the end of its known tokens, with
            logprobs for requests that asked for them.
        Raises:
            KeyError: if a scheduled request was never sent as new (a scheduler/worker protocol bug).
        """
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        states = [self.requests[req_id] for req_id in scheduler_output.num_scheduled_tokens]
        query_lens = np.fromiter(scheduler_output.num_scheduled_tokens.values(), dtype=np.int64, count=len(states))
        spec = scheduler_output.scheduled_spec_decode_tokens
        input_ids, positions, meta = self._prepare_inputs(states, query_lens, spec)
        lora = self._prepare_lora(states, query_lens)
        override = embeds_override(
            ((s.prompt_embeds, s.num_computed_tokens, s.num_prompt_tokens) for s in states), query_lens
        )
        extra: dict[str, Any] = {}  # models without LoRA or prompt-embeds support keep the four-argument call
        if lora is not None:
            extra["lora"] = lora
        if override is not None:
            extra["embeds_override"] = override
        try:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, **extra)
        except BaseException:
            self.kv_mirror = None  # a forward cut short may have updated only some layers' mirror
            raise
        pooled = pool_step(((s.req_id, s.pooler, s.num_computed_tokens) for s in states), query_lens, hidden)
        self._compute_prompt_logprobs(states, query_lens, hidden)
        self._advance(states, query_lens)
        rows, sampled_states = self._select_sampling_rows(states, query_lens)
        if not sampled_states:
            return ModelRunnerOutput(pooler_output=pooled)
        if spec:
            output = self._verify_drafts(hidden, rows, sampled_states, scheduler_output)
        else:
            output = self._sample(hidden, rows, sampled_states, scheduler_output)
        output.pooler_output = pooled
        return output

    def _sample(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        sampled_states: list[CachedRequestState],
        scheduler_output: SchedulerOutput,
    ) -> ModelRunnerOutput:
        """One token per sampling request from the logits of its last scheduled row."""
        logits = self.model.compute_logits(hidden[rows])
        sampling_meta = self._make_sampling_metadata(sampled_states)
        sampling_meta.keep_processed = self.processed_logprobs and any(
            s.sampling_params.logprobs is not None for s in sampled_states
        )
        if scheduler_output.grammar_bitmask is not None:
            self._add_grammar_bitmask(sampling_meta, sampled_states, scheduler_output)
        sampled = self.sampler(logits, sampling_meta)
        token_ids = sampled.tolist()
        for state, token_id in zip(sampled_states, token_ids, strict=True):
            state.token_ids.append(token_id)
        output = ModelRunnerOutput({state.req_id: [t] for state, t in zip(sampled_states, token_ids, strict=True)})
        for row, error in sampling_meta.failed_rows.items():
            output.failed_requests[sampled_states[row].req_id] = error
        scored = sampling_meta.processed_logits if sampling_meta.processed_logits is not None else logits
        self._add_logprobs(output, sampled_states, scored, sampled)
        return output

    def _compute_prompt_logprobs(
        self, states: list[CachedRequestState], query_lens: np.ndarray, hidden: torch.Tensor
    ) -> None:
        """For requests that asked for prompt logprobs, score the prompt tokens this chunk predicts.

        The hidden state at prompt position p predicts prompt token p + 1, so a chunk over positions
        [start, end) scores prompt tokens start + 1 .. min(end, num_prompt_tokens - 1). Logits are computed
        `PROMPT_LOGPROBS_ROWS` rows at a time ([rows, vocab_size] float32 each; ~50 MB for a 49k vocabulary).
        """
        row_starts = (np.cumsum(query_lens) - query_lens).tolist()
        for state, row_start, num_tokens in zip(states, row_starts, query_lens.tolist(), strict=True):
            k = state.sampling_params.prompt_logprobs
            start = state.num_computed_tokens
            end = min(start + num_tokens, state.num_prompt_tokens - 1)
            if k is None or not state.needs_prompt_logprobs or end <= start:
                continue
            for piece in range(start, end, PROMPT_LOGPROBS_ROWS):
                piece_end = min(piece + PROMPT_LOGPROBS_ROWS, end)
                rows = hidden[row_start + piece - start : row_start + piece_end - start]
                targets = torch.tensor(state.token_ids[piece + 1 : piece_end + 1], dtype=torch.int64)
                num_top = [self._num_top(k)] * (piece_end - piece)
                lists = compute_logprobs(self.model.compute_logits(rows), targets, num_top, self.logprobs_as_logits)
                state.prompt_logprobs_parts.append(lists)

    def _num_top(self, k: int) -> int:
        """Top logprobs to list for a request's `logprobs` / `prompt_logprobs` k (-1: the whole vocabulary)."""
        return self.vocab_size if k == -1 else k

    def _add_logprobs(
        self, output: ModelRunnerOutput, states: list[CachedRequestState], logits: torch.Tensor, sampled: torch.Tensor
    ) -> None:
        """Put sample logprobs (of the sampled rows' raw logits, or the sampler's processed ones) and finished
        prompt logprobs into `output`."""
        rows = [i for i, s in enumerate(states) if s.sampling_params.logprobs is not None]
        if rows:
            num_top = [self._num_top(states[i].sampling_params.logprobs or 0) for i in rows]
            index = torch.tensor(rows, dtype=torch.int64)
            lists = compute_logprobs(logits[index], sampled[index], num_top, self.logprobs_as_logits)
            for j, i in enumerate(rows):
                output.logprobs[states[i].req_id] = LogprobsLists(
                    [lists.token_ids[j]], [lists.logprobs[j]], [lists.ranks[j]]
                )
        for state in states:
            state.flush_prompt_logprobs(output)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        if not self.requests:
            self.kv_mirror = None  # nothing decodes: free the mirror's memory
        for new in scheduler_output.scheduled_new_reqs:  # also a preempted request resuming: replace its state
            self.requests[new.req_id] = CachedRequestState.from_new_request(new)
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(
        self, states: list[CachedRequestState], query_lens: np.ndarray, spec: dict[str, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat input ids and positions ([num_tokens] int64 each) and the attention metadata. A request with
        draft tokens (`spec`) gets them after its known tokens."""
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        seq_lens = starts + query_lens
        chunks = zip(states, starts.tolist(), seq_lens.tolist(), strict=True)
        input_ids = np.concatenate(
            [np.asarray([*s.token_ids[start:end], *spec.get(s.req_id, ())], dtype=np.int64) for s, start, end in chunks]
        )
        offsets = np.repeat(starts - np.cumsum(query_lens) + query_lens, query_lens)
        positions = offsets + np.arange(int(query_lens.sum()), dtype=np.int64)
        meta = build_attention_metadata(
            query_lens.tolist(), seq_lens.tolist(), [s.block_ids for s in states], self.block_size
        )
        self._plan_kv_mirror(meta, [s.req_id for s in states], seq_lens)
        return torch.from_numpy(input_ids), torch.from_numpy(positions), meta

    def _plan_kv_mirror(self, meta: AttentionMetadata, req_ids: list[str], seq_lens: np.ndarray) -> None:
        """Decode-only steps read K/V from the mirror kept since the last step (`model/layers/kv_mirror.py`); any other
        step forgets it. The mirror may take as much memory as the KV cache itself. None when the model's decode
        attention reads the paged cache directly (`model/layers/attention.decode_reads_cache`)."""
        decode_only = len(meta.groups) == 1 and meta.groups[0].max_query_len == 1
        if not (decode_only and self.kv_caches) or self.model.decode_reads_cache:
            self.kv_mirror = None
            return
        if self.kv_mirror is None:
            total = sum(cache.nbytes for cache in self.kv_caches)
            per_token = total // (self.kv_caches[0].shape[0] * self.block_size)
            self.kv_mirror = DecodeKVMirror(self.block_size, per_token, max_bytes=total)
        meta.mirror = self.kv_mirror.plan(req_ids, seq_lens, meta.groups[0].block_tables.numpy())

    def _prepare_lora(self, states: list[CachedRequestState], query_lens: np.ndarray) -> LoRABatch | None:
        """The step's adapters by rows (loading any that is not loaded), or None when no request has one.

        Raises:
            RuntimeError: a request has an adapter but LoRA is off (the engine core refuses such requests).
        """
        lora_requests = [s.lora_request for s in states]
        if self.lora_manager is None:
            if any(r is not None for r in lora_requests):
                raise RuntimeError("a request has a LoRA adapter but this worker runs without LoRA")
            return None
        return self.lora_manager.make_batch(lora_requests, query_lens)

    def _verify_drafts(
        self,
        hidden: torch.Tensor,
        last_rows: torch.Tensor,
        states: list[CachedRequestState],
        scheduler_output: SchedulerOutput,
    ) -> ModelRunnerOutput:
        """Speculative step: logits at every draft position of every sampling request in one matrix, then
        rejection sampling (`worker/rejection_sampler.py`); each request gets 1..k+1 tokens."""
        drafts = [scheduler_output.scheduled_spec_decode_tokens.get(s.req_id, []) for s in states]
        last = last_rows.tolist()
        rows = torch.cat([torch.arange(end - len(d), end + 1) for end, d in zip(last, drafts, strict=True)])
        logits = self.model.compute_logits(hidden[rows])
        sampling_meta = build_verification_metadata(states, drafts, self.vocab_size)
        if scheduler_output.grammar_bitmask is not None:  # constrained requests have no drafts: one row each
            first_rows = np.cumsum([0] + [len(d) + 1 for d in drafts[:-1]]).tolist()
            self._add_grammar_bitmask(sampling_meta, states, scheduler_output, first_rows)
        result = self.rejection_sampler(logits, sampling_meta, drafts)
        output = ModelRunnerOutput()
        for state, token_ids in zip(states, result.token_ids, strict=True):
            state.token_ids.extend(token_ids)
            output.sampled_token_ids[state.req_id] = token_ids
        self._add_verified_logprobs(output, states, logits, result)
        return output

    def _add_verified_logprobs(
        self,
        output: ModelRunnerOutput,
        states: list[CachedRequestState],
        logits: torch.Tensor,
        result: VerificationResult,
    ) -> None:
        """Sample logprobs of each emitted token, from the raw logits of the row that emitted it."""
        for state, token_ids, rows in zip(states, result.token_ids, result.rows, strict=True):
            k = state.sampling_params.logprobs
            if k is not None:
                index = torch.tensor(rows, dtype=torch.int64)
                targets = torch.tensor(token_ids, dtype=torch.int64)
                lists = compute_logprobs(
                    logits[index], targets, [self._num_top(k)] * len(rows), self.logprobs_as_logits
                )
                output.logprobs[state.req_id] = lists
            state.flush_prompt_logprobs(output)

    @staticmethod
    def _select_sampling_rows(
        states: list[CachedRequestState], query_lens: np.ndarray
    ) -> tuple[torch.Tensor, list[CachedRequestState]]:
        """Flat rows of the last scheduled token of each request that samples (its computed tokens reach the
        end of its known tokens; a partial prefill chunk does not), and those requests."""
        last_rows = np.cumsum(query_lens) - 1
        chosen = [
            i
            for i, state in enumerate(states)
            if state.num_computed_tokens >= len(state.token_ids) and state.pooler is None
        ]
        return torch.from_numpy(last_rows[chosen]), [states[i] for i in chosen]

    def _make_sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        generators = {}
        for row, state in enumerate(states):
            seed = state.sampling_params.seed
            if state.generator is not None and seed is not None:
                generators[row] = seed_generator(state.generator, seed, state.num_output_tokens)
        params = [s.sampling_params for s in states]
        rows = None
        if any(p.has_penalties or p.min_tokens > 0 or p.bad_words_token_ids or p.logits_processors_key for p in params):
            rows = [
                RowTokens(s.token_ids[: s.num_prompt_tokens], s.token_ids[s.num_prompt_tokens :], s.eos_token_id)
                for s in states
            ]
        return SamplingMetadata.from_params(params, self.vocab_size, generators, rows)

    def _add_grammar_bitmask(
        self,
        meta: SamplingMetadata,
        states: list[CachedRequestState],
        scheduler_output: SchedulerOutput,
        first_rows: list[int] | None = None,
    ) -> None:
        """Map the scheduler's per-request grammar masks onto this step's sampled rows.

        Args:
            first_rows: each state's first logits row (speculative steps); None = row i is state i.
        Raises:
            KeyError: a masked request does not sample this step (a scheduler/worker protocol bug).
        """
        grammar = scheduler_output.grammar_bitmask
        assert grammar is not None
        first_rows = first_rows if first_rows is not None else list(range(len(states)))
        row_of = {state.req_id: row for row, state in zip(first_rows, states, strict=True)}
        meta.grammar_rows = torch.tensor([row_of[req_id] for req_id in grammar.req_ids], dtype=torch.int64)
        meta.grammar_allowed = unpack_bitmask(grammar.to_tensor(), self.vocab_size)

    @staticmethod
    def _advance(states: list[CachedRequestState], query_lens: np.ndarray) -> None:
        for state, num_tokens in zip(states, query_lens.tolist(), strict=True):
            state.num_computed_tokens += num_tokens
