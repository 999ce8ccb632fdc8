"""System prompts of the tool world.

`qwen` is the training format: Qwen2.5's own tool prompt (JSON schemas inside
<tools></tools>). The `ood_format` split renders the same tools in other ways --
other instructions, Python-like signatures, a Markdown list, indented JSON -- and in
a shuffled order, while the call protocol the model must produce stays the same.
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

from toolcollapse.tools import ToolSpec

ANSWER_PREFIX = "The answer is"

_QWEN_HEAD = (
    "Answer by calling tools, one call per turn, copying values exactly. Then reply: "
    f"{ANSWER_PREFIX} <value>.\n\n# Tools\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_QWEN_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _qwen(tools: Sequence[ToolSpec]) -> str:
    return _QWEN_HEAD + "\n".join(json.dumps(t.to_doc(), ensure_ascii=False) for t in tools) + _QWEN_TAIL


def _signatures(tools: Sequence[ToolSpec]) -> str:
    lines = []
    for t in tools:
        params = ", ".join(f"{k}: {_type(v)}" for k, v in t.parameters["properties"].items())
        lines.append(f"- {t.name}({params}) -- {t.description}")
    return ("You solve questions with the help of functions. Use exactly one function per message and wait for "
            f"its output. Finish with '{ANSWER_PREFIX} <value>.'\n\nFunctions:\n" + "\n".join(lines) +
            "\n\nTo use a function, write its name and arguments as JSON between <tool_call> and </tool_call>.")


def _markdown(tools: Sequence[ToolSpec]) -> str:
    parts = ["## Assistant rules\nCall the tools below one at a time; never guess a value. "
             f"End with: {ANSWER_PREFIX} <value>.\n\n## Tools"]
    for t in tools:
        params = "\n".join(f"  - `{k}` ({_type(v)}{', required' if k in t.required else ''})"
                           for k, v in t.parameters["properties"].items())
        parts.append(f"### {t.name}\n{t.description}\nParameters:\n{params}")
    parts.append('Call format: <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
    return "\n\n".join(parts)


def _json_indented(tools: Sequence[ToolSpec]) -> str:
    return ("Available functions (JSON):\n" + json.dumps([t.to_doc() for t in tools], indent=1) +
            f"\n\nReply with one tool call per turn in <tool_call></tool_call> tags. Final reply: "
            f"{ANSWER_PREFIX} <value>.")


def _type(schema: dict) -> str:
    if "enum" in schema:
        return "|".join(map(str, schema["enum"]))
    if schema.get("type") == "array":
        return f"list[{schema['items']['type']}]"
    return schema.get("type", "any")


STYLES: dict[str, Callable[[Sequence[ToolSpec]], str]] = {
    "qwen": _qwen, "signatures": _signatures, "markdown": _markdown, "json_indented": _json_indented,
}
OOD_STYLES = ("signatures", "markdown", "json_indented")


def system_prompt(tools: Sequence[ToolSpec], style: str = "qwen") -> str:
    return STYLES[style](tools)
