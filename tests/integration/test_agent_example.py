"""examples/agent_tools.py end to end on the real model (engine core in a thread, short max_tokens)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from examples.agent_tools import TOOLS, calculator, run_agent

from tests.integration.conftest import EngineFactory


def test_calculator_evaluates_arithmetic_only() -> None:
    assert calculator("(3 + 4) * 2 / 7") == "2.0"
    assert calculator("2 ** 10") == "1024"
    assert calculator("__import__('os')").startswith("error:")
    assert calculator("1 / 0").startswith("error:")


@pytest.mark.slow
@pytest.mark.timeout(900)  # three chat turns; minutes on a loaded 2-core machine
@pytest.mark.asyncio
async def test_agent_calls_both_tools_with_valid_arguments_and_answers(make_llm: EngineFactory) -> None:
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    llm = make_llm(engine_process=False, num_kv_blocks=256)
    run = await run_agent(llm, "What is 12 * 7, and what time is it in Paris?", max_tokens=32)
    assert sorted(call.name for call, _ in run.calls) == ["calculator", "clock"]
    for call, result in run.calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        assert result
        assert {"role": "tool", "tool_call_id": call.id, "content": result} in run.messages
    assert run.answer.strip()
    assert run.messages[-1] == {"role": "assistant", "content": run.answer}
