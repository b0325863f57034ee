"""Structured outputs on the real SmolLM2-135M-Instruct: every constrained output is valid for its constraint.

JSON outputs are parsed and checked with `jsonschema`; regex outputs with `re.fullmatch`; choices by membership;
the grammar by a Python regex of the same language. Greedy decoding, modest max_tokens; the schemas bound
string lengths and array sizes so a complete value fits.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from asyncllm import AsyncLLM, RequestOutputKind, SamplingParams
from asyncllm.errors import InvalidRequestError
from asyncllm.processing.tool_calling import MAX_PARALLEL_TOOL_CALLS
from asyncllm.structured_outputs import StructuredOutputsParams
from tests.integration.conftest import EngineFactory
from tests.reference import clear_prefix_len, greedy_margins

pytestmark = pytest.mark.asyncio(loop_scope="module")

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
PERSON = {
    "type": "object",
    "properties": {
        "name": NAME,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["student", "teacher", "engineer", "artist"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
RECIPE = {
    "type": "object",
    "properties": {
        "title": NAME,
        "ingredients": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
        "vegetarian": {"type": "boolean"},
    },
    "required": ["title", "ingredients", "vegetarian"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {
        "city": NAME,
        "country": {"type": "object", "properties": {"name": NAME, "code": {"type": "string", "pattern": "^[A-Z]{2}$"}},
                    "required": ["name", "code"], "additionalProperties": False},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 50},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}  # fmt: skip
REVIEW = {
    "type": "object",
    "properties": {
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "tags": {"type": "array", "items": {"enum": ["price", "quality", "service", "speed"]}, "maxItems": 2},
    },
    "required": ["rating", "sentiment", "tags"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "event": NAME,
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "attendees": {"type": "array", "items": {"$ref": "#/$defs/person"}, "maxItems": 2},
    },
    "required": ["event", "date", "attendees"],
    "additionalProperties": False,
    "$defs": {"person": {"type": "object", "properties": {"name": NAME}, "required": ["name"],
                         "additionalProperties": False}},
}  # fmt: skip

JSON_PROMPTS: list[tuple[str, dict[str, Any]]] = [
    ("Describe a young student as JSON.", PERSON),
    ("Describe a famous painter as JSON.", PERSON),
    ("Tell me about an engineer named Ada.", PERSON),
    ("Invent a teacher.", PERSON),
    ("Give me a pancake recipe.", RECIPE),
    ("A vegetarian salad recipe, please.", RECIPE),
    ("What goes in a tomato soup?", RECIPE),
    ("Recipe for grilled chicken.", RECIPE),
    ("Tell me about Paris.", CITY),
    ("Tell me about Tokyo.", CITY),
    ("Describe the city of Berlin.", CITY),
    ("Which city is the capital of Spain?", CITY),
    ("Review: the food was great but slow.", REVIEW),
    ("Review: terrible service, never again.", REVIEW),
    ("Review: it was fine, nothing special.", REVIEW),
    ("Review: cheap and fast, loved it!", REVIEW),
    ("Plan a birthday party.", EVENT),
    ("Describe a science conference in 2025.", EVENT),
    ("A wedding on June 5th.", EVENT),
    ("Schedule a team meeting.", EVENT),
]
DATE_REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
EMAIL_REGEX = r"[a-z0-9._]{1,16}@[a-z0-9]{1,12}\.(com|org|net)"
GRAMMAR = 'root ::= "The answer is " ("yes" | "no") "."'
GRAMMAR_LANGUAGE = r"The answer is (yes|no)\."
MARGIN = 0.05  # logits; below this a greedy choice can flip with batch shape (fp32 summation order)


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def constrained(max_tokens: int = 96, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, **so: Any):
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, output_kind=kind, structured_outputs=StructuredOutputsParams(**so)
    )


def assert_valid_json(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def mode() -> str:
    """The shared `llm` runs its engine core in a thread."""
    return "thread"


@pytest.fixture(scope="module")
def llm_overrides() -> dict[str, Any]:
    """The shared `llm` with 1024 KV blocks (20 constrained prompts at once)."""
    return {"num_kv_blocks": 1024}


class Engines:
    """The module's engines by mode: the shared `llm` for "thread"; "process" built on first use by `factory`
    (with the same 1024 KV blocks), so a run without `mp` tests starts no engine process."""

    def __init__(self, thread: AsyncLLM, factory: EngineFactory) -> None:
        self.thread, self.factory = thread, factory
        self.process: AsyncLLM | None = None

    def get(self, mode: str) -> AsyncLLM:
        if mode == "thread":
            return self.thread
        if self.process is None:
            self.process = self.factory(engine_process=True, num_kv_blocks=1024)
        return self.process


@pytest.fixture(scope="module")
def engines(llm: AsyncLLM, model_path: str) -> Iterator[Engines]:
    factory = EngineFactory(model_path)
    yield Engines(llm, factory)
    factory.close()


@pytest.mark.slow
@pytest.mark.timeout(900)  # minutes on a loaded 2-core machine
async def test_json_schema_20_prompts_all_valid(llm: AsyncLLM) -> None:
    streams = [llm.generate(chat(p), constrained(json=schema)) for p, schema in JSON_PROMPTS]
    outputs = await asyncio.gather(*(s.collect() for s in streams))
    for (prompt, schema), out in zip(JSON_PROMPTS, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", f"{prompt!r}: {completion.text!r} did not finish"
        assert_valid_json(completion.text, schema)


KIND_CASES = [
    ("Is water wet? Answer yes or no.", {"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ("Pick a color.", {"choice": ["red", "green", "light blue"]}, lambda t: t in ("red", "green", "light blue")),
    ("When did the first moon landing happen?", {"regex": DATE_REGEX}, lambda t: re.fullmatch(DATE_REGEX, t)),
    ("What is your e-mail address?", {"regex": EMAIL_REGEX}, lambda t: re.fullmatch(EMAIL_REGEX, t)),
    ("Is the sun hot?", {"grammar": GRAMMAR}, lambda t: re.fullmatch(GRAMMAR_LANGUAGE, t)),
    ("Describe a cat as a JSON object.", {"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
]


@pytest.mark.parametrize("engine_mode", ["thread", pytest.param("process", marks=pytest.mark.mp)])
async def test_choice_regex_grammar_json_object(engine_mode: str, engines: Engines) -> None:
    engine = engines.get(engine_mode)
    # json_object has no size bound: a cut-off object is the model's, so give it room and check only finished ones
    streams = [engine.generate(chat(p), constrained(160, **so)) for p, so, _ in KIND_CASES]
    outputs = await asyncio.gather(*(s.collect() for s in streams))
    for (prompt, so, check), out in zip(KIND_CASES, outputs, strict=True):
        completion = out.outputs[0]
        if "json_object" in so and completion.finish_reason == "length":
            assert completion.text.startswith("{")
            continue
        assert completion.finish_reason == "stop", f"{prompt!r} {so}: {completion.text!r}"
        assert check(completion.text), f"{prompt!r} {so}: {completion.text!r}"


async def test_streaming_delta_concatenates_to_the_valid_output(llm: AsyncLLM) -> None:
    prompt, schema = JSON_PROMPTS[12]
    deltas = [o async for o in llm.generate(chat(prompt), constrained(json=schema, kind=RequestOutputKind.DELTA))]
    final = await llm.generate(chat(prompt), constrained(json=schema)).collect()
    text = "".join(o.outputs[0].text for o in deltas)
    assert len(deltas) > 3, "DELTA should stream"
    assert text == final.outputs[0].text
    assert_valid_json(text, schema)


async def test_bad_constraints_fail_at_submission_naming_the_problem(llm: AsyncLLM) -> None:
    cases = [
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": {"type": "objekt"}}, "not a valid JSON schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ]
    for so, words in cases:
        with pytest.raises(InvalidRequestError, match=words):
            llm.generate("hi", constrained(**so))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    out = await llm.generate("hi", constrained(8, choice=["ok"])).collect()  # the engine keeps serving
    assert out.outputs[0].text == "ok"


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_constrained_and_free_batch_together_free_equal_solo(llm: AsyncLLM, reference_model: Any) -> None:
    free_prompts = [f"Write a sentence about the number {i}." for i in range(8)]
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    solo = [(await llm.generate(chat(p), free).collect()).outputs[0].token_ids for p in free_prompts]
    json_cases = JSON_PROMPTS[:8]
    streams = [llm.generate(chat(p), constrained(json=s)) for p, s in json_cases]
    streams += [llm.generate(chat(p), free) for p in free_prompts]
    outputs = await asyncio.gather(*(s.collect() for s in streams))
    for (_, schema), out in zip(json_cases, outputs[:8], strict=True):
        assert_valid_json(out.outputs[0].text, schema)
    reference = reference_model
    tokenizer = llm.get_tokenizer()
    compared = 0
    for prompt, ref, out in zip(free_prompts, solo, outputs[8:], strict=True):
        got = out.outputs[0].token_ids
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(chat(prompt)), add_special_tokens=False)
        k = clear_prefix_len(greedy_margins(reference, prompt_ids, ref), MARGIN)
        assert got[:k] == ref[:k], f"free output diverged next to constrained rows within {k} clear tokens"
        compared += k
    assert compared >= 0.5 * 8 * 24, "too few clear-margin tokens to mean anything"


async def test_preemption_during_constrained_generation_keeps_outputs_valid(make_llm: EngineFactory) -> None:
    engine = make_llm(engine_process=False, num_kv_blocks=10, max_model_len=160)
    cases = [JSON_PROMPTS[i] for i in (0, 4, 8, 12, 1, 5)]
    streams = [engine.generate(chat(p), constrained(80, json=s)) for p, s in cases]
    outputs = await asyncio.gather(*(s.collect() for s in streams))
    stats = await engine.get_scheduler_stats()
    assert stats.num_preemptions > 0, "the 10-block cache should have forced preemptions"
    for (_, schema), out in zip(cases, outputs, strict=True):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert_valid_json(out.outputs[0].text, schema)


CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "pattern": "^[0-9+*/() .-]{1,24}$"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"enum": ["UTC", "Europe/Paris", "Asia/Tokyo"]}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOL_QUESTIONS = ["What is 12 times 7?", "What time is it in Paris?", "How much is 3 plus 4, divided by 2?"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine_mode", ["thread", pytest.param("process", marks=pytest.mark.mp)])
async def test_forced_tool_calls_have_arguments_valid_for_the_tool_schema(engine_mode: str, engines: Engines) -> None:
    engine = engines.get(engine_mode)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (CALCULATOR, CLOCK)}
    named = {"type": "function", "function": {"name": "clock"}}
    runs = [(q, choice) for q in TOOL_QUESTIONS for choice in ("required", named)]
    outputs = await asyncio.gather(
        *(engine.chat(chat(q), params, tools=[CALCULATOR, CLOCK], tool_choice=c, parallel_tool_calls=False)
          for q, c in runs)
    )  # fmt: skip
    for (question, choice), out in zip(runs, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", f"{question!r} {choice}: {completion.text!r}"
        (call,) = completion.tool_calls or [None]
        assert call is not None
        assert call.id.startswith("call_")
        assert completion.text == ""
        if choice == named:
            assert call.name == "clock"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_required_parallel_calls_end_even_when_the_model_repeats_itself(llm: AsyncLLM) -> None:
    """Regression: this prompt made the model repeat calculator calls until max_tokens (400) before the array
    of forced calls had `maxItems`; now the grammar closes the array after `MAX_PARALLEL_TOOL_CALLS` calls."""
    question = "What is the weather in Paris, London, Berlin, Rome and Madrid?"
    params = SamplingParams(max_tokens=400, temperature=0.0)
    tools = [SEARCH, WEATHER, CALCULATOR]
    out = await llm.chat(chat(question), params, tools=tools, tool_choice="required")
    completion = out.outputs[0]
    assert completion.finish_reason == "stop", completion.text
    assert completion.tool_calls is not None
    assert 1 <= len(completion.tool_calls) <= MAX_PARALLEL_TOOL_CALLS
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in completion.tool_calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
