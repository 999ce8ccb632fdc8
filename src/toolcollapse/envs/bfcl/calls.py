"""BFCL call strings such as `cd(folder='document')`, parsed without ever evaluating them.

BFCL `eval()`s its ground truth (and model output) after prefixing method names with
an instance (`multi_turn_utils.py::execute_multi_turn_func_call`). Here a call string
must be a single call of a bare name whose arguments are Python literals (strings,
numbers, booleans, None, and lists/tuples/dicts/sets of them, via `ast.literal_eval`);
anything else -- attribute access, nested calls, `__import__(...)`, `*args` -- is a
`CallSyntaxError`. Positional arguments are kept positional, as BFCL passes them.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

MAX_CALL_CHARS = 100_000


class CallSyntaxError(ValueError):
    pass


@dataclass(frozen=True)
class LiteralCall:
    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def parse_call_string(text: str) -> LiteralCall:
    if len(text) > MAX_CALL_CHARS:
        raise CallSyntaxError(f"call string longer than {MAX_CALL_CHARS} characters")
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise CallSyntaxError(f"not a Python call: {text[:60]!r} ({type(err).__name__})") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise CallSyntaxError(f"not a call of a plain function name: {text[:60]!r}")
    if any(k.arg is None for k in node.keywords):
        raise CallSyntaxError(f"**kwargs are not allowed: {text[:60]!r}")
    return LiteralCall(node.func.id, tuple(_literal(a, text) for a in node.args),
                       {k.arg: _literal(k.value, text) for k in node.keywords})


def _literal(node: ast.expr, text: str) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        raise CallSyntaxError(f"argument is not a literal: {ast.unparse(node)[:60]!r} in {text[:60]!r}") from None
