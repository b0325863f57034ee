"""An agent loop with two Python tools (a calculator and a clock), called through forced tool calls.

Each round asks the model for a call with `tool_choice="required"` among the tools not used yet (structured
outputs make the call valid for the tool's parameter schema, even with a 135M model), runs the tool, and feeds
the result back as a `tool` message. When every tool has been used, a last turn with `tool_choice="none"`
writes the final answer.

    python examples/agent_tools.py
    python examples/agent_tools.py --question "What is 7 * 6, and what time is it in Tokyo?" --max-tokens 64
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from asyncllm import AsyncLLM, EngineArgs, SamplingParams, ToolCall

TIMEZONES = ["UTC", "Europe/Paris", "America/New_York", "Asia/Tokyo"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / ** and parentheses",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "pattern": "^[0-9(][0-9+*/() .-]{0,31}$"}},
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "clock",
            "description": "The current date and time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"enum": TIMEZONES}},
                "required": ["timezone"],
                "additionalProperties": False,
            },
        },
    },
]
_OPERATORS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / **, parentheses), or an error text."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / ** and parentheses are allowed")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"


def clock(timezone: str) -> str:
    """The current date and time in `timezone` (ISO 8601, seconds)."""
    return datetime.now(ZoneInfo(timezone)).isoformat(timespec="seconds")


PYTHON_TOOLS = {"calculator": calculator, "clock": clock}


def run_tool(call: ToolCall) -> str:
    """Run the Python function a tool call names, with its JSON arguments."""
    return PYTHON_TOOLS[call.name](**json.loads(call.arguments))


@dataclass
class AgentRun:
    """What the agent did: the calls with their results, the final answer and the whole conversation."""

    calls: list[tuple[ToolCall, str]] = field(default_factory=list)
    answer: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)


async def run_agent(llm: AsyncLLM, question: str, max_tokens: int = 64, max_rounds: int = 4) -> AgentRun:
    """Let the model call each tool once (forced calls), then answer the question with the results."""
    run = AgentRun(messages=[{"role": "user", "content": question}])
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    unused = dict.fromkeys(PYTHON_TOOLS)
    for _ in range(max_rounds):
        tools = [tool for tool in TOOLS if tool["function"]["name"] in unused]
        if not tools:
            break
        out = await llm.chat(run.messages, params, tools=tools, tool_choice="required", parallel_tool_calls=False)
        calls = out.outputs[0].tool_calls
        if not calls:  # the call was cut off by max_tokens
            break
        result = run_tool(calls[0])
        run.calls.append((calls[0], result))
        unused.pop(calls[0].name, None)
        run.messages.append({"role": "assistant", "content": None, "tool_calls": [calls[0].to_message_dict()]})
        run.messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": result})
    final = await llm.chat(run.messages, params, tools=TOOLS, tool_choice="none")
    run.answer = final.outputs[0].text
    run.messages.append({"role": "assistant", "content": run.answer})
    return run


async def main(args: argparse.Namespace) -> None:
    async with AsyncLLM.from_engine_args(EngineArgs(model=args.model)) as llm:
        run = await run_agent(llm, args.question, args.max_tokens)
    print(f"user: {args.question}")
    for call, result in run.calls:
        print(f"tool call: {call.name}({call.arguments}) -> {result}")
    print(f"assistant: {run.answer}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name, .gguf path or HF directory")
    parser.add_argument("--question", default="What is 12 * 7, and what time is it in Paris?")
    parser.add_argument("--max-tokens", type=int, default=96)
    asyncio.run(main(parser.parse_args()))
