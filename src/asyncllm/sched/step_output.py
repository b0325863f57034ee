"""The messages a scheduler step produces about one request: what the workers get for a newly scheduled request
(`NewRequestData`) and what the frontend gets for a request that sampled tokens or finished pooling
(`EngineCoreOutput`). Built from the engine-side `Request` alone; the `Scheduler` decides when.
"""

from __future__ import annotations

from asyncllm.messages.engine import EngineCoreOutput
from asyncllm.messages.scheduler import ModelRunnerOutput, NewRequestData
from asyncllm.sched.request import Request


def new_request_data(req: Request, block_ids: list[int]) -> NewRequestData:
    """What the workers need to start running `req` (after a first admission or a preemption).

    Args:
        block_ids: the request's KV cache block table (block ids, in order).
    """
    return NewRequestData(
        req_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling_params=req.sampling_params,
        block_ids=block_ids,
        num_computed_tokens=req.num_computed_tokens,
        output_token_ids=list(req.output_token_ids),
        eos_token_id=req.eos_token_id,
        pooling_params=req.pooling_params,
        prompt_embeds=None if req.prompt_embeds is None else req.prompt_embeds.astype("<f4", copy=False).tobytes(),
        lora_request=req.lora_request,
    )


def sampled_output(req: Request, token_ids: list[int], model_runner_output: ModelRunnerOutput) -> EngineCoreOutput:
    """The frontend's output for a request that appended `token_ids` this step (its finish reason if it finished);
    its logprobs are cut to the appended tokens when a stop ended an accepted run of drafts early."""
    new_logprobs = model_runner_output.logprobs.get(req.request_id)
    if new_logprobs is not None and len(new_logprobs) > len(token_ids):  # a stop inside an accepted run
        new_logprobs = new_logprobs.head(len(token_ids))
    return EngineCoreOutput(
        req.request_id,
        token_ids,
        req.finish_reason,
        req.stop_reason,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        events=req.take_events(),
        new_logprobs=new_logprobs,
        new_prompt_logprobs=model_runner_output.prompt_logprobs.get(req.request_id),
        spec_decode_metrics=req.spec_decode_metrics if req.is_finished else None,
    )


def pooling_output(req: Request, vector: list[float]) -> EngineCoreOutput:
    """The frontend's output for an embedding request that finished: no tokens, its pooled vector ([hidden_size]
    or [dimensions] floats)."""
    return EngineCoreOutput(
        req.request_id,
        [],
        req.finish_reason,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        events=req.take_events(),
        pooling_output=vector,
    )
