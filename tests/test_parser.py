import json
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolcollapse.chat import CONTROL_TAGS, PieceEncoder, assistant_body
from toolcollapse.parser import id_segments, parse_segments, parse_turn, parse_turn_ids, text_segments
from toolcollapse.records import ErrorType as E
from toolcollapse.records import Message, ToolCall, TurnState as S

CALL = '<tool_call>\n{"name": "kb_lookup", "arguments": {"entity": "Velmora", "attribute": "population"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tools(world):
    return world.tool_table


@pytest.mark.parametrize("text, state, errors, end", [
    (CALL, S.HEALTHY_CALL, (), "call"),
    (CALL + "<|im_end|>", S.HEALTHY_CALL, (), "call"),  # as other frameworks log it
    ("The answer is 42.<|im_end|>", S.HEALTHY_RESPONSE, (), "answer"),
    # text pollution: ends properly, content corrupted
    ("Let me check." + CALL, S.TEXT_POLLUTION, (E.TEXT_OUTSIDE_CALL,), "call"),
    ('<tool_call>\n{"name": "kb_lookup", "arguments": {"entity": "V"</tool_call>', S.TEXT_POLLUTION,
     (E.INVALID_JSON,), "call"),
    ('<tool_call>\n{"tool": "kb_lookup", "args": {}}\n</tool_call>', S.TEXT_POLLUTION, (E.BAD_CALL_SCHEMA,), "call"),
    ('<tool_call>\n{"name": "kb_lookup", "arguments": "entity=V"}\n</tool_call>', S.TEXT_POLLUTION,
     (E.BAD_CALL_SCHEMA,), "call"),
    ('<tool_call>\n{"name": "teleport", "arguments": {}}\n</tool_call>', S.TEXT_POLLUTION, (E.UNKNOWN_TOOL,), "call"),
    ('<tool_call>\n{"name": "kb_lookup", "arguments": {"entity": 3}}\n</tool_call>', S.TEXT_POLLUTION,
     (E.BAD_ARGUMENTS,), "call"),
    ("The answer is <tool_call> 42.<|im_end|>", S.FULL_COLLAPSE, (E.UNCLOSED_CALL,), "answer"),
    ("The answer is 42.<tool_response><|im_end|>", S.TEXT_POLLUTION, (E.FORBIDDEN_CONTROL_TOKEN,), "answer"),
    ("<|im_start|>user\nhi<|im_end|>", S.TEXT_POLLUTION, (E.FORBIDDEN_CONTROL_TOKEN,), "answer"),
    (CALL[:-len("</tool_call>")] + "\n" + CALL, S.TEXT_POLLUTION, (E.FORBIDDEN_CONTROL_TOKEN,), "call"),
    ('{"name": "kb_lookup", "arguments": {"entity": "V", "attribute": "population"}}<|im_end|>',
     S.TEXT_POLLUTION, (E.UNTAGGED_CALL,), "answer"),
    (CALL + "\n" + CALL + "<|im_end|>", S.TEXT_POLLUTION, (E.MULTIPLE_CALLS,), "call"),
    # full collapse: structure lost
    ("<|im_end|>", S.FULL_COLLAPSE, (E.EMPTY_TURN,), "answer"),
    ("  \n<|im_end|>", S.FULL_COLLAPSE, (E.EMPTY_TURN,), "answer"),
    ('<tool_call>\n{"name": "kb_lookup"<|im_end|>', S.FULL_COLLAPSE, (E.UNCLOSED_CALL,), "answer"),
    ("The answer is 42.", S.FULL_COLLAPSE, (E.MISSING_END_OF_TURN,), "none"),
    ("The answer is 42.<|endoftext|>", S.FULL_COLLAPSE, (E.MISSING_END_OF_TURN,), "none"),
    ("The answer is 42.</tool_call>", S.FULL_COLLAPSE, (E.FORBIDDEN_CONTROL_TOKEN, E.MISSING_END_OF_TURN), "none"),
    ("the the the the the the the the the the<|im_end|>", S.FULL_COLLAPSE, (E.DEGENERATE_REPETITION,), "answer"),
    ("<tool_call>" * 6, S.FULL_COLLAPSE, (E.MISSING_END_OF_TURN, E.FORBIDDEN_CONTROL_TOKEN, E.UNCLOSED_CALL,
                                         E.DEGENERATE_REPETITION), "none"),
])
def test_states_and_error_types(tools, text, state, errors, end):
    parsed = parse_turn(text, tools)
    assert parsed.state == state, parsed
    assert parsed.end == end
    assert set(errors) <= set(parsed.errors), parsed
    assert (parsed.errors == ()) == state.healthy
    if errors:
        assert parsed.errors[0] in errors and parsed.detail


def test_call_is_extracted(tools):
    parsed = parse_turn(CALL, tools)
    assert parsed.call == ToolCall("kb_lookup", {"entity": "Velmora", "attribute": "population"})
    assert parse_turn("The answer is 42.<|im_end|>").text == "The answer is 42."


def test_legit_numbers_are_not_degenerate(tools):
    assert parse_turn("The answer is 1000000.<|im_end|>").state == S.HEALTHY_RESPONSE
    args = '{"values": [100.5, 100.25, 1000, 10000], "function": "max"}'
    assert parse_turn(f'<tool_call>\n{{"name": "aggregate", "arguments": {args}}}\n</tool_call>',
                      tools).state == S.HEALTHY_CALL


def test_only_real_control_tokens_count_in_token_parsing(tokenizer, tools):
    """A literal '<tool_call>' spelled with ordinary tokens is text, not a tag."""
    enc = PieceEncoder(tokenizer)
    id_to_tag = {enc.special_ids[t]: t for t in CONTROL_TAGS}
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    spelled = tokenizer("<tool_call>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    answer = tokenizer("The answer is 3.", add_special_tokens=False)["input_ids"]
    parsed = parse_turn_ids(answer + spelled + [enc.special_ids["<|im_end|>"]], id_to_tag, decode, tools)
    assert parsed.state == S.HEALTHY_RESPONSE
    ids, _ = enc.encode(assistant_body(Message("assistant", tool_call=ToolCall(
        "kb_lookup", {"entity": "Velmora", "attribute": "population"}))))
    assert parse_turn_ids(ids, id_to_tag, decode, tools).state == S.HEALTHY_CALL


# ------------------------------------------------------------------------- fuzzing


def _mutate(rng: random.Random, text: str) -> str:
    pieces = list(CONTROL_TAGS) + ["{", "}", '"', ":", ",", "[", "]", "\\", "\n", " ", "name", "arguments",
                                   "\x00", "\ud7ff", "é", "1e999", "-", "NaN"]
    chars = [text[i:i + 1] for i in range(len(text))]
    for _ in range(rng.randint(1, 8)):
        op = rng.random()
        i = rng.randint(0, len(chars))
        if op < 0.3:
            chars.insert(i, rng.choice(pieces))
        elif op < 0.55 and chars:
            del chars[min(i, len(chars) - 1)]
        elif op < 0.7 and chars:
            chars[min(i, len(chars) - 1)] = rng.choice(pieces)
        elif op < 0.8:
            chars = chars[:i]
        elif op < 0.9 and chars:
            j = rng.randint(0, len(chars))
            chars = chars + chars[min(i, j):max(i, j)] * rng.randint(1, 20)
        else:
            chars = chars[i:]
    return "".join(chars)


@pytest.mark.slow
def test_mutation_fuzz_never_raises(world, tools):
    """20 000 mutations of real (oracle) turns through the unguarded parser."""
    rng = random.Random(0)
    seeds = []
    for task in world.tasks("test")[:100]:
        for m in task.reference:
            if m.role == "assistant":
                seeds.append("".join(p.text for p in assistant_body(m)))
    counts = {s: 0 for s in S}
    for _ in range(20_000):
        parsed = parse_segments(text_segments(_mutate(rng, rng.choice(seeds))), tools)
        counts[parsed.state] += 1
        assert (parsed.errors == ()) == parsed.state.healthy
    assert all(counts.values()), counts  # the mutations reach every state


ALPHABET = st.sampled_from(list(CONTROL_TAGS) + list('{}[]":, \n\\abc0123456789.-') +
                           ['"name"', '"arguments"', "kb_lookup", "\x00", "é"])


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ALPHABET, max_size=200).map("".join))
def test_hypothesis_text_never_raises(text):
    parsed = parse_segments(text_segments(text), None)
    assert parsed.state in S


@pytest.mark.slow
@settings(max_examples=2000, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=511), max_size=300))
def test_hypothesis_token_ids_never_raise(tokenizer, ids):
    enc = PieceEncoder(tokenizer)
    id_to_tag = {enc.special_ids[t]: t for t in CONTROL_TAGS}
    segs = id_segments(ids, id_to_tag, lambda x: tokenizer.decode(x, skip_special_tokens=False))
    assert parse_segments(segs, None).state in S


def test_huge_and_pathological_inputs_are_bounded():
    cases = ["{" * 1_000_000, "<tool_call>" * 200_000, "[" * 50_000 + "<|im_end|>",
             "<tool_call>" + '{"name": "x", "arguments": ' + "[" * 100_000 + "</tool_call>",
             "ab" * 2_000_000 + "<|im_end|>"]
    for text in cases:
        t0 = time.perf_counter()
        parsed = parse_segments(text_segments(text), None)
        assert parsed.state == S.FULL_COLLAPSE or parsed.state == S.TEXT_POLLUTION
        assert time.perf_counter() - t0 < 10  # generous: typical is well under a second
    assert json.dumps(parse_turn("{" * 10**6).errors[0])


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999999", '"\\ud800"', '"ok \\udfff"'])
def test_values_strict_json_has_no_way_to_write_are_bad_arguments(tools, value):
    """Python's json.loads reads NaN, Infinity, 1e999999 (inf) and a lone surrogate escape; strict JSON
    (RFC 8259, I-JSON) has none of them. The call is recorded as bad_arguments, not healthy."""
    arg = ("a", "entity")[value.startswith('"')]
    args = f'"operation": "add", "a": {value}, "b": 1' if arg == "a" else f'"entity": {value}, "attribute": "x"'
    name = "calculator" if arg == "a" else "kb_lookup"
    parsed = parse_turn(f'<tool_call>{{"name": "{name}", "arguments": {{{args}}}}}</tool_call>', tools)
    assert parsed.state == S.TEXT_POLLUTION and parsed.errors == (E.BAD_ARGUMENTS,)
    assert f"arguments.{arg}" in parsed.detail
    assert parsed.detail.encode("utf-8")  # the note itself is valid text (no surrogate copied into it)


def test_the_size_cap_never_joins_its_two_halves_into_a_tag():
    """The first cap kept text[:half] + text[-half:] of the raw string and split tags afterwards, so
    `...<tool_` + `call>...` became a <tool_call> the model never wrote."""
    from toolcollapse.parser import MAX_CHARS

    half = MAX_CHARS // 2
    answer = "The answer is 1.<|im_end|>"
    text = "x" * (half - 6) + "<tool_" + "y" * 5000 + "call>" + "z" * (half - 5 - len(answer)) + answer
    segments = text_segments(text)
    assert [s for is_tag, s in segments if is_tag] == ["<|im_end|>"]
    assert E.FORBIDDEN_CONTROL_TOKEN not in parse_turn(text).errors and parse_turn(text).end == "answer"
    # near the threshold a tag on the boundary must not be kept twice either
    for extra in range(0, 30):
        body = "a" * (half - 8) + "<tool_call>" + "b" * (half - 3 + extra) + "<|im_end|>"
        tags = [s for is_tag, s in text_segments(body) if is_tag]
        assert tags.count("<tool_call>") <= 1 and tags[-1] == "<|im_end|>"


@pytest.mark.parametrize("text, state, errors, end", [
    (CALL + "<|im_end|>", S.HEALTHY_CALL, (), "call"),
    (CALL, S.FULL_COLLAPSE, (E.MISSING_END_OF_TURN,), "none"),  # cut off after </tool_call>: no <|im_end|>
    (CALL + " and more<|im_end|>", S.TEXT_POLLUTION, (E.TEXT_OUTSIDE_CALL,), "call"),
    (CALL + CALL + "<|im_end|>", S.TEXT_POLLUTION, (E.MULTIPLE_CALLS,), "call"),
    ("The answer is 42.<|im_end|>", S.HEALTHY_RESPONSE, (), "answer"),
])
def test_a_call_turn_must_end_on_its_own_im_end_when_the_policy_writes_it(tools, text, state, errors, end):
    parsed = parse_turn(text, tools, call_end="sampled")
    assert (parsed.state, parsed.errors, parsed.end) == (state, errors, end)
