"""Structured outputs: constrain generation to a JSON schema, a regex, a choice list or an EBNF grammar.

Modules: `params` (the request-side `StructuredOutputsParams`), `backend` (xgrammar: grammar-level checks,
compilation, matchers), `manager` (engine-side compilation pool, grammar cache, per-request matchers, bitmask
filling) and `bitmask` (the worker-side mask applied to logits; needs only torch).
"""

from asyncllm.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
