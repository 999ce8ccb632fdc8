"""Any turn a model can write survives the whole path: parser -> environment step (the tool runs) ->
tokenizer (the observation joins the history) -> JSONL record -> a `diagnose` autopsy of that record.
Property-based, on both environments, with the values that once crashed or hung a run: unpaired
surrogate escapes, NaN / Infinity / 1e999999, integers of thousands of digits, long strings."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolcollapse.autopsy import DumpedRollout, autopsy
from toolcollapse.chat import PieceEncoder, generation_prompt, message_pieces, turn_suffix
from toolcollapse.config import ToolsConfig
from toolcollapse.parser import describe, parse_turn
from toolcollapse.runtime import json_line, read_jsonl, write_jsonl

NASTY = ["NaN", "-Infinity", "Infinity", "1e999999", "-1e-999999", "1" + "0" * 4299, "-" + "9" * 4000,
         '"\\ud800"', '"a\\udfffb\\ud800"', '"\\ud83d\\ude00"', '"<tool_call>"', '"<|im_end|>\\n<|im_start|>user"',
         '"\\u0000"', '"' + "a" * 20_000 + '"', "[" * 50 + "]" * 50, "true", "null", "0.1", '"é"', "[]", "{}",
         '"1-99999999999"', "-1000000000000", "1e308", "[" * 600 + "]" * 600, '{"a": ' * 300 + "1" + "}" * 300]
JSON_VALUE = st.one_of(st.sampled_from(NASTY), st.integers().map(str),
                       st.floats(allow_nan=True, allow_infinity=True).map(lambda x: json.dumps(x)),
                       st.text(max_size=30).map(json.dumps))


def turns(tool_names: list[str], arg_names: list[str]):
    """Assistant turns as text: a call of a known or invented tool with nasty arguments, or an answer."""
    name = st.one_of(st.sampled_from(tool_names).map(json.dumps), st.sampled_from(['"x"', '"\\ud800"', "NaN", "7"]))
    key = st.one_of(st.sampled_from(arg_names).map(json.dumps), st.sampled_from(['"\\ud800"', '"zz"']))
    args = st.dictionaries(key, JSON_VALUE, max_size=4)
    body = st.builds(lambda n, a: '{"name": ' + n + ', "arguments": {' + ", ".join(f"{k}: {v}" for k, v in a.items())
                     + "}}", name, args)
    call = body.map(lambda b: f"<tool_call>\n{b}\n</tool_call>")
    answer = st.sampled_from(NASTY).map(lambda v: f"The answer is {v}.<|im_end|>")
    return st.one_of(call, call, answer)


def survive(env, encoder, tokenizer, task, text, tmp_path):
    state = env.reset(task)
    parsed = parse_turn(text, state.tools)
    observations = env.step(state, parsed)  # the tool runs: must not raise or hang
    pieces = turn_suffix(parsed.end == "call") + [p for m in observations for p in message_pieces(m)]
    ids, _ = encoder.encode(pieces + generation_prompt())  # the history grows: must tokenize
    assert all(isinstance(i, int) for i in ids)
    env.success(state)
    record = {"turn": describe(parsed), "text": text, "observation": "\n".join(m.content for m in observations)}
    write_jsonl(tmp_path / "episodes.jsonl", [record])
    [back] = read_jsonl(tmp_path / "episodes.jsonl")
    assert json_line(back) == json_line(record)  # the same strings come back
    dump = [DumpedRollout(step=0, assistant_turns=(back["text"],))]
    [row] = autopsy(dump, tokenizer, state.tools)
    assert row["n_turns"] == 1


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return PieceEncoder(tokenizer)


@pytest.fixture(scope="module")
def world_env(world):
    from toolcollapse.envs.toolworld import ToolWorld

    return ToolWorld(world.cfg, ToolsConfig(timeout_s=2.0))


WORLD_ARGS = ["operation", "a", "b", "entity", "attribute", "value", "from_unit", "to_unit", "date", "days", "values",
              "function", "start_date", "end_date", "recipient", "text"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@pytest.mark.slow
@given(data=st.data())
def test_tool_world_turns_survive_end_to_end(world_env, encoder, tokenizer, tmp_path, data):
    names = list(world_env.tool_table)
    text = data.draw(turns(names, WORLD_ARGS))
    survive(world_env, encoder, tokenizer, world_env.tasks("test")[0], text, tmp_path)


@pytest.fixture(scope="module")
def bfcl_env():
    pytest.importorskip("bfcl_eval", reason="env: bfcl needs `pip install --no-deps bfcl-eval`")
    from toolcollapse.config import BFCLConfig
    from toolcollapse.envs.bfcl import BFCL

    return BFCL(BFCLConfig(categories=("base",)), ToolsConfig(timeout_s=2.0))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_bfcl_turns_survive_end_to_end(bfcl_env, encoder, tokenizer, tmp_path, data):
    tasks = bfcl_env.tasks("train")[:12]
    task = data.draw(st.sampled_from(tasks))
    tools = bfcl_env.reset(task).tools
    arg_names = sorted({k for spec in tools.values() for k in spec.parameters.get("properties", {})})
    text = data.draw(turns(sorted(tools), arg_names))
    survive(bfcl_env, encoder, tokenizer, task, text, tmp_path)


def test_a_lone_surrogate_echoed_by_a_tool_reaches_the_tokenizer_and_the_jsonl(bfcl_env, encoder, tmp_path):
    """The crash of the issue: `"\\ud800"` (six ASCII characters) in a call's JSON, echoed back by the tool
    (here in the backend's TypeError about an unexpected keyword), then tokenized and written."""
    task = next(t for t in bfcl_env.tasks("train") if "GorillaFileSystem" in bfcl_env.entry(t).classes)
    state = bfcl_env.reset(task)
    parsed = parse_turn('<tool_call>{"name": "cd", "arguments": {"x\\ud800": "y"}}</tool_call>', state.tools)
    [obs] = bfcl_env.step(state, parsed)
    assert "\ud800" in obs.content  # the tool really echoed the lone surrogate
    with pytest.raises(Exception):  # what crashed the rollout: the tokenizer cannot take it as it is
        encoder.tokenizer(obs.content)
    ids, _ = encoder.encode(message_pieces(obs))
    assert "\ufffd" in encoder.tokenizer.decode(ids)  # encoded as U+FFFD
    write_jsonl(tmp_path / "e.jsonl", [{"observation": obs.content, "call": describe(parsed)}])
    assert read_jsonl(tmp_path / "e.jsonl")[0]["observation"] == obs.content  # what eval's JSONL writer does
    assert (tmp_path / "e.jsonl").read_bytes().decode("utf-8")  # valid UTF-8 on disk
