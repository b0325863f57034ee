"""Structured outputs: constrain generation to a JSON schema, a regex, a choice list or an EBNF grammar.

Modules: `params` (the request-side `StructuredOutputsParams`), `backend` (xgrammar: grammar-level checks,
compilation, matchers) and `bitmask` (the worker-side mask applied to logits; needs only torch). The engine-side
compilation pool, grammar cache, per-request matchers and bitmask filling live beside the scheduler
(`sched/grammar.py`).
"""

from asyncllm.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
