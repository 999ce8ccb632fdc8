"""Tool descriptions (JSON schema) and argument validation, shared by every environment.

The validator covers the JSON-schema subset that function-calling docs use (object
with typed properties, `required`, `enum`, arrays of a typed item, no extra keys) and
returns the problems as strings instead of raising, so a malformed model call is a
recorded outcome, never a crash. It holds values to strict JSON, which Python's
`json.loads` is not: no NaN or infinities (`NaN`, `Infinity`, `1e999999`; RFC 8259
has no such numbers) and no unpaired surrogate escapes in strings (`"\\ud800"` is
no character; RFC 7493, I-JSON, forbids it).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object

    def to_doc(self) -> dict[str, Any]:
        """Compact function description: name, description, JSON-schema parameters."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def to_schema(self) -> dict[str, Any]:
        """OpenAI-style function description, as Qwen2.5 puts it in its system prompt."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(self.parameters.get("required", ()))


def validate_arguments(spec: ToolSpec, arguments: Any) -> list[str]:
    """Problems with `arguments` against `spec.parameters` and strict JSON; empty when valid."""
    return non_json_values(arguments, "arguments") or _validate(arguments, spec.parameters, "arguments")


_SURROGATE = re.compile("[\ud800-\udfff]")


def non_json_values(value: Any, where: str = "value") -> list[str]:
    """Values strict JSON has no way to write: non-finite numbers, strings with unpaired surrogates."""
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{where} is {value}, which is not a JSON number (no NaN or Infinity; 1e999 overflows)"]
    if isinstance(value, str) and _SURROGATE.search(value):
        code = ord(_SURROGATE.search(value).group())
        return [f"{where} holds an unpaired surrogate (\\u{code:04x}), which is not a character"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in non_json_values(k, f"{where} key") + non_json_values(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in non_json_values(v, f"{where}[{i}]")]
    return []


def _validate(value: Any, schema: dict[str, Any], where: str) -> list[str]:
    expected = schema.get("type")
    if expected is not None and not _is_type(value, expected):
        return [f"{where} should be {expected}, got {json.dumps(value)[:40]}"]
    problems: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where} must be one of {schema['enum']}, got {json.dumps(value)[:40]}")
    if expected == "object":
        props = schema.get("properties", {})
        for name in schema.get("required", ()):
            if name not in value:
                problems.append(f"{where} is missing required {name!r}")
        if not schema.get("additionalProperties", False):
            problems += [f"{where} has unknown key {k!r}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                problems += _validate(v, props[k], f"{where}.{k}")
    if expected == "array" and "items" in schema:
        for i, item in enumerate(value):
            problems += _validate(item, schema["items"], f"{where}[{i}]")
    if expected == "array":
        if len(value) < schema.get("minItems", 0):
            problems.append(f"{where} needs at least {schema['minItems']} items")
    return problems


def _is_type(value: Any, expected: str) -> bool:
    if isinstance(value, bool) and expected in ("integer", "number"):
        return False
    if expected == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(expected, (object,)))
