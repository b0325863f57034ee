"""`EngineArgs` fields as command-line flags, generated from the dataclass (names, types, defaults, help).

Each field `max_num_seqs: int = 64` becomes `--max-num-seqs INT`; `bool` fields become `--flag/--no-flag`;
`Literal[...]` fields get `choices`; `X | None` fields accept a value or default to None. Help texts are taken
from the `Fields:` section of the `EngineArgs` docstring, so flags and docs cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Any, Literal

from asyncllm.config import EngineArgs

_SKIP = {"model"}  # positional in the CLI


def add_engine_args(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """Add one `--flag` per `EngineArgs` field (except `model` and `skip`) to `parser` (dest = the field name)."""
    group = parser.add_argument_group("engine arguments (EngineArgs)")
    hints = typing.get_type_hints(EngineArgs)
    docs = field_docs()
    for f in dataclasses.fields(EngineArgs):
        if f.name in _SKIP or f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kwargs = _argparse_kwargs(hints[f.name])
        default = f.default
        help_text = docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        group.add_argument(flag, dest=f.name, default=default, help=f"{help_text} (default: {default!r})", **kwargs)


def engine_args_from(namespace: argparse.Namespace, model: str) -> EngineArgs:
    """The `EngineArgs` the parsed flags describe (fields without a flag keep their defaults)."""
    fields = dataclasses.fields(EngineArgs)
    values = {f.name: getattr(namespace, f.name) for f in fields if f.name not in _SKIP and hasattr(namespace, f.name)}
    return EngineArgs(model=model, **values)


def _argparse_kwargs(hint: Any) -> dict[str, Any]:
    """type/choices/action for one field type."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _argparse_kwargs(inner[0])
        return {"type": str}
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        return {"type": type(args[0]), "choices": list(args)}
    if hint in (int, float, str):
        return {"type": hint, "metavar": hint.__name__.upper()}
    return {"type": str}


def field_docs() -> dict[str, str]:
    """field name -> its description in the `Fields:` section of the `EngineArgs` docstring (one line)."""
    doc = EngineArgs.__doc__ or ""
    section = doc.split("Fields:", 1)[-1].split("Raises:", 1)[0]
    docs: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        match = re.match(r"^\s{8}(\w+(?:, \w+)*): (.*)$", line)
        if match:
            name = match.group(1)
            docs[name] = match.group(2).strip()
        elif name is not None and line.strip():
            docs[name] += " " + line.strip()
    return docs
