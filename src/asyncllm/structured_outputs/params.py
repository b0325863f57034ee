"""`StructuredOutputsParams`: what a request's output must match (one constraint kind per request).

Same names and meanings as vLLM's `StructuredOutputsParams` (vllm/sampling_params.py): `json` (a JSON schema,
as a dict or its JSON text), `json_object` (any JSON object), `regex`, `choice` (one of these strings, verbatim)
and `grammar` (an EBNF grammar in xgrammar's GBNF dialect, `root ::= ...`). A msgspec Struct, so it crosses the
engine-process boundary without pickle.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from asyncllm.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """The constraint on one request's output. Exactly one field is set.

    Fields:
        json: a JSON schema (dict, or its JSON text); the output is one JSON value valid for it.
        json_object: True: the output is one JSON object (any keys).
        regex: the output matches this regular expression (whole output).
        choice: the output is exactly one of these non-empty strings.
        grammar: the output is a sentence of this EBNF/GBNF grammar (start symbol `root`).
    Raises:
        InvalidRequestError: none or several kinds set, or a field of the wrong type. Whether the schema,
            regex or grammar itself is valid is checked at submission (`asyncllm.structured_outputs.backend`).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check that exactly one kind is set and that it has the right type.

        Raises:
            InvalidRequestError: naming the offending field.
        """
        kinds = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(kinds) != 1:
            found = ", ".join(kinds) or "none"
            raise InvalidRequestError(f"StructuredOutputsParams needs exactly one of {', '.join(KINDS)}; found {found}")
        if self.json is not None and not isinstance(self.json, dict | str):
            _bad("json", self.json, "a JSON schema (dict or JSON text)")
        if self.json_object is not None and self.json_object is not True:
            _bad("json_object", self.json_object, "True or None")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _bad(name, value, "a non-empty str")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            _bad("choice", self.choice, "a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        """The name of the set field ("json", "json_object", "regex", "choice" or "grammar")."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """The grammar cache key: (kind, canonical text of the spec)."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json" and isinstance(value, dict):
            value = json.dumps(value)  # property order matters: xgrammar generates properties in schema order
        elif kind == "choice":
            value = json.dumps(value)
        elif kind == "json_object":
            value = ""
        return kind, str(value)


def _bad(field: str, value: object, allowed: str) -> None:
    raise InvalidRequestError(f"StructuredOutputsParams.{field}={value!r} is invalid: must be {allowed}")
