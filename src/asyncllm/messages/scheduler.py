"""What the scheduler hands the executor each step, and what the model runner hands back.

msgspec Structs, so the `mp` executor can broadcast them to workers without pickle.
Shape follows vLLM v1's `SchedulerOutput` / `ModelRunnerOutput`: new requests carry everything once,
requests already known to the workers carry only what changed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from asyncllm.lora.request import LoRARequest
from asyncllm.messages.engine import LogprobsLists
from asyncllm.pooling_params import PoolingParams
from asyncllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np
    import torch


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the workers have not seen (or that resumes after preemption: its state was dropped).

    Fields:
        req_id: request id.
        prompt_token_ids: [num_prompt_tokens].
        output_token_ids: tokens generated before a preemption (recomputed like prompt tokens).
        sampling_params: the request's sampling parameters.
        block_ids: KV cache blocks allocated to it so far, in order.
        num_computed_tokens: tokens whose K/V are already in the cache (prefix-cache hits).
        eos_token_id: the model's EOS id (the sampler masks it before `min_tokens`), or None.
        pooling_params: set for an embedding request (the runner pools instead of sampling), else None.
        prompt_embeds: an embeddings prompt's [num_prompt_tokens, hidden_size] float32 rows as little-endian
            bytes (plain msgpack, so the `mp` executor's RPC carries it too), else None.
        lora_request: its LoRA adapter, or None (base model).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    eos_token_id: int | None = None
    pooling_params: PoolingParams | None = None
    prompt_embeds: bytes | None = None
    lora_request: LoRARequest | None = None


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the workers already hold, scheduled again.

    Fields:
        req_id: request id.
        new_block_ids: blocks appended to its block table this step.
        num_computed_tokens: tokens whose K/V are in the cache before this step.
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


class GrammarBitmask(msgspec.Struct, array_like=True, gc=False):
    """The packed allowed-token masks of the constrained requests sampled in one step.

    Fields:
        req_ids: the constrained requests, one mask row each, in this order.
        bitmask: [len(req_ids), num_words] int32 words as little-endian bytes.
        num_words: int32 words per row (`ceil(vocab_size / 32)`).
    """

    req_ids: list[str]
    bitmask: bytes
    num_words: int

    @classmethod
    def from_array(cls, req_ids: list[str], bitmask: np.ndarray) -> GrammarBitmask:
        """Pack `bitmask` ([len(req_ids), num_words] int32) for the wire."""
        import numpy as np

        return cls(req_ids, np.ascontiguousarray(bitmask, dtype="<i4").tobytes(), int(bitmask.shape[1]))

    def to_tensor(self) -> torch.Tensor:
        """[len(req_ids), num_words] int32 (imports torch: call it in the worker only)."""
        import numpy as np
        import torch

        array = np.frombuffer(self.bitmask, dtype="<i4").reshape(len(self.req_ids), self.num_words)
        return torch.from_numpy(array.copy())


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's schedule.

    Fields:
        scheduled_new_reqs: requests to add to the workers' batch.
        scheduled_cached_reqs: requests already in the workers' batch.
        num_scheduled_tokens: req_id -> tokens to compute this step (1 for a decode, a chunk for prefill).
        total_num_scheduled_tokens: sum of `num_scheduled_tokens`.
        finished_req_ids: requests that finished or were aborted since the last step; workers drop them.
        grammar_bitmask: allowed-token masks of the structured-output requests that sample this step, or None.
        scheduled_spec_decode_tokens: req_id -> draft tokens to verify after its last token (speculative
            decoding); they are the last `len(drafts)` of its `num_scheduled_tokens`.
    """

    scheduled_new_reqs: list[NewRequestData] = msgspec.field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = msgspec.field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = msgspec.field(default_factory=list)
    grammar_bitmask: GrammarBitmask | None = None
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Tokens sampled in one step.

    Fields:
        sampled_token_ids: req_id -> tokens sampled this step (with draft tokens: the accepted drafts plus one
            bonus or corrected token); a request whose prefill is still partial after this step is absent.
        logprobs: req_id -> logprobs of its sampled tokens (requests that asked for `logprobs`).
        prompt_logprobs: req_id -> logprobs of its prompt tokens 1.. (requests that asked for
            `prompt_logprobs`, in the step that samples their first token).
        pooler_output: req_id -> pooled vector of an embedding request, in the step that finishes its prefill.
        failed_requests: req_id -> error, for requests the worker could not sample (a per-request logits
            processor raised); the scheduler fails each alone.
    """

    sampled_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    logprobs: dict[str, LogprobsLists] = msgspec.field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = msgspec.field(default_factory=dict)
    pooler_output: dict[str, list[float]] = msgspec.field(default_factory=dict)
    failed_requests: dict[str, str] = msgspec.field(default_factory=dict)
