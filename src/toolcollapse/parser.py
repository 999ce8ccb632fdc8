"""The one strict parser: labels an assistant turn with the paper's four states.

Grammar of an assistant turn (what follows `<|im_start|>assistant\\n`):

    call     := WS <tool_call> WS JSON WS </tool_call> [WS <|im_end|>]
    response := TEXT <|im_end|>          (TEXT non-empty, no control token)

With `call_end="sampled"` (the policy writes the <|im_end|> closing a call turn, and the
turn stops only there) that <|im_end|> is required: a call turn cut off after
</tool_call> is missing_end_of_turn, and a turn holding a closed call and ending on
<|im_end|> is a call turn, whatever text surrounds the call (text_outside_call).

JSON must be {"name": <known tool>, "arguments": <object valid for its schema>}.

States (arXiv 2606.26027 names them; the boundaries are ours):
  healthy_call / healthy_response   the turn matches the grammar;
  text_pollution                    it ends properly (on </tool_call> or <|im_end|>)
                                    but its content is corrupted: text around the call,
                                    bad JSON, unknown tool, bad arguments, a stray
                                    control token, a call written without tags;
  full_collapse                     the structure itself is lost: the call is never
                                    closed, the turn never ends, it is empty, or it
                                    degenerates into repetition.

The parser never raises, and its cost is linear in the input, which is capped at
`MAX_CHARS` (head and tail kept, so the terminator is still seen). The cap cuts text
runs *between* control tags, never the tags, and never joins the pieces it keeps into
a new tag: `<tool_` ... `call>` stays text.

Arguments are held to strict JSON (RFC 8259, and I-JSON's RFC 7493 on strings):
`NaN`, `Infinity`, a number that overflows to infinity (`1e999999`) and an unpaired
surrogate escape (`"\\ud800"`, which is no character) make a call `bad_arguments`
(tools.validate_arguments), although Python's `json` module reads them.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping, Sequence

from toolcollapse.chat import CONTROL_TAGS, ENDOFTEXT, IM_END, TOOL_CALL, TOOL_CALL_END
from toolcollapse.records import CallEnd, ErrorType, ParsedTurn, ToolCall, TurnState
from toolcollapse.tools import ToolSpec, validate_arguments

E = ErrorType
COLLAPSE_ERRORS = frozenset({E.UNCLOSED_CALL, E.MISSING_END_OF_TURN, E.EMPTY_TURN, E.DEGENERATE_REPETITION})
MAX_CHARS = 65_536
MAX_DEPTH = 64  # JSON nesting of a call: deeper is bad_arguments, and the call is not kept (nothing
# downstream -- validation, the tool process's pickles, JSONL records -- has to walk 900 levels)
REPEAT_MIN_UNITS = 4  # a unit of 1-64 chars repeated at least this often ...
REPEAT_MIN_SPAN = 32  # ... over at least this many chars is degenerate
_REPEAT = re.compile(r"(.{1,64}?)\1{%d,}" % (REPEAT_MIN_UNITS - 1), re.S)
_TAG_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in CONTROL_TAGS) + ")")

Segment = tuple[bool, str]  # (is a control tag, text)


def parse_turn(text: str, tools: Mapping[str, ToolSpec] | None = None, call_end: CallEnd = "template") -> ParsedTurn:
    """Parse an assistant turn given as text (control tags written out)."""
    try:
        return parse_segments(text_segments(text), tools, call_end)
    except Exception as err:  # pragma: no cover - fuzzed unguarded in the tests; never take a run down
        return _internal_error(err)


def text_segments(text: str) -> list[Segment]:
    """Control tags and the text between them, capped (the cut never creates a tag)."""
    return _cap_segments([(s in CONTROL_TAGS, s) for s in _TAG_SPLIT.split(text) if s])


def parse_turn_ids(ids: Sequence[int], id_to_tag: Mapping[int, str], decode: Callable[[list[int]], str],
                   tools: Mapping[str, ToolSpec] | None = None, call_end: CallEnd = "template") -> ParsedTurn:
    """Parse a turn given as token ids: only real control tokens count as tags."""
    try:
        return parse_segments(id_segments(ids, id_to_tag, decode), tools, call_end)
    except Exception as err:  # pragma: no cover - fuzzed unguarded in the tests
        return _internal_error(err)


def id_segments(ids: Sequence[int], id_to_tag: Mapping[int, str],
                decode: Callable[[list[int]], str]) -> list[Segment]:
    segments: list[Segment] = []
    run: list[int] = []
    for i in ids:
        if i in id_to_tag:
            if run:
                segments.append((False, decode(run)))
                run = []
            segments.append((True, id_to_tag[i]))
        else:
            run.append(i)
    if run:
        segments.append((False, decode(run)))
    return _cap_segments(segments)


def parse_segments(segments: Sequence[Segment], tools: Mapping[str, ToolSpec] | None,
                   call_end: CallEnd = "template") -> ParsedTurn:
    errors: list[ErrorType] = []
    notes: list[str] = []

    def flag(error: ErrorType, note: str) -> None:
        if error not in errors:
            errors.append(error)
            notes.append(note)

    segs = list(segments)
    ended_on_im_end = bool(segs) and segs[-1] == (True, IM_END)
    if ended_on_im_end:
        segs.pop()
    elif segs and segs[-1] == (True, ENDOFTEXT):
        segs.pop()
        flag(E.MISSING_END_OF_TURN, "turn ended with <|endoftext|> instead of <|im_end|>")
    elif not segs or segs[-1] != (True, TOOL_CALL_END):
        flag(E.MISSING_END_OF_TURN, "turn ended without <|im_end|> or </tool_call> (token budget or end of text)")

    bodies, outside, open_body = _split_calls(segs, flag)
    if call_end == "sampled":  # a call turn ends on the policy's own <|im_end|>
        closed_at_end = bool(bodies) and ended_on_im_end
        if bodies and not ended_on_im_end and _last_structure_is_call_end(segs):
            flag(E.MISSING_END_OF_TURN, "the call turn ended without its <|im_end|> (rollout.call_end: sampled)")
    else:
        closed_at_end = bool(bodies) and _last_structure_is_call_end(segs)
    if open_body is not None:
        flag(E.UNCLOSED_CALL, "<tool_call> was never closed")
    outside_text = "".join(outside)

    call = None
    if bodies:
        if outside_text.strip():
            flag(E.TEXT_OUTSIDE_CALL, f"text outside the call: {outside_text.strip()[:40]!r}")
        if len(bodies) > 1:
            flag(E.MULTIPLE_CALLS, f"{len(bodies)} calls in one turn")
        call = _parse_call(bodies[0], tools, flag)
    elif open_body is None:
        if not outside_text.strip():
            flag(E.EMPTY_TURN, "the turn has no content")
        elif _looks_like_call(outside_text):
            flag(E.UNTAGGED_CALL, "a tool call written without <tool_call> tags")
    if not ended_on_im_end and not closed_at_end and segs and segs[-1] == (True, TOOL_CALL_END):
        flag(E.MISSING_END_OF_TURN, "turn ended on a stray </tool_call>")

    flat = "".join(s for _, s in segments)
    if _degenerate(flat):
        flag(E.DEGENERATE_REPETITION, "a short unit repeats over and over")

    end = "call" if closed_at_end else ("answer" if ended_on_im_end else "none")
    if any(e in COLLAPSE_ERRORS for e in errors):
        state = TurnState.FULL_COLLAPSE
    elif errors:
        state = TurnState.TEXT_POLLUTION
    else:
        state = TurnState.HEALTHY_CALL if call is not None else TurnState.HEALTHY_RESPONSE
    return ParsedTurn(state=state, errors=tuple(errors), call=call, text=outside_text.strip(), end=end,
                      detail=notes[0] if notes else "")


def _split_calls(segs: Sequence[Segment], flag: Callable[[ErrorType, str], None]):
    """Walk the segments: bodies of closed calls, text outside calls, body of an unclosed call."""
    bodies: list[str] = []
    outside: list[str] = []
    body: list[str] | None = None
    for is_tag, s in segs:
        if not is_tag:
            (outside if body is None else body).append(s)
        elif s == TOOL_CALL:
            if body is not None:
                flag(E.FORBIDDEN_CONTROL_TOKEN, "<tool_call> inside a call")
            else:
                body = []
        elif s == TOOL_CALL_END:
            if body is None:
                flag(E.FORBIDDEN_CONTROL_TOKEN, "</tool_call> without an open call")
            else:
                bodies.append("".join(body))
                body = None
        else:
            where = "inside a call" if body is not None else "in an assistant turn"
            flag(E.FORBIDDEN_CONTROL_TOKEN, f"{s} {where}")
    return bodies, outside, (None if body is None else "".join(body))


def _last_structure_is_call_end(segs: Sequence[Segment]) -> bool:
    """True when the turn's last non-whitespace segment is a </tool_call>."""
    for is_tag, s in reversed(segs):
        if not is_tag and not s.strip():
            continue
        return is_tag and s == TOOL_CALL_END
    return False


def _parse_call(body: str, tools: Mapping[str, ToolSpec] | None,
                flag: Callable[[ErrorType, str], None]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        flag(E.INVALID_JSON, f"call body is not JSON: {body.strip()[:40]!r}")
        return None
    if _nests_deeper(obj, MAX_DEPTH):
        flag(E.BAD_ARGUMENTS, f"the call's JSON nests deeper than {MAX_DEPTH} levels")
        return None
    if not (isinstance(obj, dict) and set(obj) == {"name", "arguments"}
            and isinstance(obj["name"], str) and isinstance(obj["arguments"], dict)):
        flag(E.BAD_CALL_SCHEMA, 'call must be {"name": string, "arguments": object}')
        return None
    call = ToolCall(obj["name"], obj["arguments"])
    if tools is not None:
        spec = tools.get(call.name)
        if spec is None:
            flag(E.UNKNOWN_TOOL, f"unknown tool {call.name!r}")
        else:
            problems = validate_arguments(spec, call.arguments)
            if problems:
                flag(E.BAD_ARGUMENTS, "; ".join(problems))
    return call


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether lists and objects nest more than `limit` levels (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


def _looks_like_call(text: str) -> bool:
    text = text.strip()
    if not (text.startswith("{") and '"name"' in text):
        return False
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return '"arguments"' in text
    return isinstance(obj, dict) and "name" in obj


def _degenerate(text: str) -> bool:
    return any(m.end() - m.start() >= REPEAT_MIN_SPAN for m in _REPEAT.finditer(text))


def _cap_segments(segments: list[Segment]) -> list[Segment]:
    """About MAX_CHARS of segments: a head and a tail of disjoint segments, cut inside text runs
    only. The kept pieces stay separate segments, so nothing downstream reads a tag across the cut,
    and no segment is kept twice."""
    if sum(len(s) for _, s in segments) <= MAX_CHARS:
        return segments
    half = MAX_CHARS // 2
    head: list[Segment] = []
    used, i = 0, 0
    while i < len(segments) and used < half:
        is_tag, s = segments[i]
        head.append((is_tag, s if is_tag else s[:half - used]))
        used, i = used + len(s), i + 1
    tail: list[Segment] = []
    used, j = 0, len(segments)
    while j > i and used < half:
        j -= 1
        is_tag, s = segments[j]
        tail.append((is_tag, s if is_tag else s[max(0, len(s) - (half - used)):]))
        used += len(s)
    return head + tail[::-1]


def _internal_error(err: Exception) -> ParsedTurn:
    return ParsedTurn(TurnState.FULL_COLLAPSE, (E.MISSING_END_OF_TURN,), None, "", "none",
                      f"parser error {type(err).__name__}: {err}")


def tool_table(tools: Sequence[ToolSpec]) -> dict[str, ToolSpec]:
    return {t.name: t for t in tools}


def describe(parsed: ParsedTurn) -> dict[str, Any]:
    """JSON-ready summary of a parsed turn for result files."""
    return {"state": parsed.state.value, "errors": [e.value for e in parsed.errors], "end": parsed.end,
            "detail": parsed.detail, "call": None if parsed.call is None else
            {"name": parsed.call.name, "arguments": parsed.call.arguments}}


def first_rejected_control(ids: Sequence[int], id_to_tag: Mapping[int, str],
                           call_end: CallEnd = "template") -> int | None:
    """Index in a sampled turn's ids of the first control token its grammar does not allow there
    (the token an unlikelihood term pushes down), or None. The grammar is `parse_segments`':
    [text] <tool_call> body </tool_call> (then <|im_end|> with call_end `sampled`), or text <|im_end|>.
    Rejected: <tool_call> inside a call or after one closed, </tool_call> with no call open,
    <|im_end|> inside a call (the unclosed call of full collapse), <|endoftext|> as the turn's end,
    and every other tag (<|im_start|>, <tool_response>, ...) anywhere in the turn."""
    in_call = closed = False
    for i, tok in enumerate(ids):
        tag = id_to_tag.get(tok)
        if tag is None:
            continue
        if tag == TOOL_CALL and not in_call and not closed:
            in_call = True
        elif tag == TOOL_CALL_END and in_call:
            in_call, closed = False, True
        elif tag == IM_END and not in_call:
            return None  # the turn's end, where it belongs
        else:
            return i
    return None
