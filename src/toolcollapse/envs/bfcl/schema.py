"""BFCL function docs (`multi_turn_func_doc/*.json`) as `ToolSpec`s with valid JSON schema.

BFCL writes parameter types in its own vocabulary ("dict", "float", "tuple", "any").
They become JSON-schema types the way BFCL's own OpenAI conversion does
(`model_handler/utils.py::_cast_to_openai_type`, `constants/type_mappings.py::GORILLA_TO_OPENAPI`):
dict -> object, float -> number (so an integer is a valid float, as Python and BFCL's
ground truth treat it), tuple -> array; where we depart: "any" puts no type constraint
(BFCL says "string"), a dict without listed properties accepts any keys, and one
parameter the ground truth passes with another type is left untyped. The
`response` schema of each doc is dropped: the Qwen tool prompt shows parameters only,
and the prompts are long enough already.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolcollapse.tools import ToolSpec

DOC_FILES: dict[str, str] = {  # backend class -> its docs (BFCL's MULTI_TURN_FUNC_DOC_FILE_MAPPING, offline ones)
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
}
_TYPES: dict[str, str | None] = {
    "dict": "object", "object": "object", "float": "number", "number": "number", "integer": "integer",
    "string": "string", "boolean": "boolean", "array": "array", "tuple": "array", "any": None,
}
_KEPT = ("description", "enum", "default")
# Parameters whose documented type BFCL's own ground truth contradicts: multi_turn_*_173 closes
# ticket 'ticket_001' (its scenario's ids are strings) while the doc says integer. No type
# constraint there (the validator has no type unions), so the reference call is valid.
UNTYPED_PARAMETERS: frozenset[tuple[str, str]] = frozenset({("close_ticket", "ticket_id")})


def load_class_docs(data_dir: Path, class_name: str) -> list[ToolSpec]:
    """The class's functions, in the doc file's order."""
    if class_name not in DOC_FILES:
        raise ValueError(f"BFCL backend class {class_name!r} is not supported offline; "
                         f"supported: {', '.join(DOC_FILES)}")
    with open(data_dir / "multi_turn_func_doc" / DOC_FILES[class_name], encoding="utf-8") as f:
        return [to_tool_spec(json.loads(line)) for line in f if line.strip()]


def to_tool_spec(doc: dict[str, Any]) -> ToolSpec:
    params = to_json_schema(doc["parameters"])
    params["type"] = "object"
    params.setdefault("properties", {})
    for name, schema in params["properties"].items():
        if (doc["name"], name) in UNTYPED_PARAMETERS:
            schema.pop("type", None)
    return ToolSpec(doc["name"], doc["description"], params)


def to_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """One BFCL parameter schema as JSON schema (recursively through properties and items)."""
    kind = node.get("type", "any")
    if kind not in _TYPES:
        raise ValueError(f"unknown BFCL parameter type {kind!r} in {json.dumps(node)[:80]}")
    out: dict[str, Any] = {} if _TYPES[kind] is None else {"type": _TYPES[kind]}
    out.update((k, node[k]) for k in _KEPT if k in node)
    if "properties" in node:
        out["properties"] = {name: to_json_schema(sub) for name, sub in node["properties"].items()}
        if "required" in node:
            out["required"] = list(node["required"])
    elif out.get("type") == "object":
        out["additionalProperties"] = True
    if "items" in node:
        out["items"] = to_json_schema(node["items"])
    return out
