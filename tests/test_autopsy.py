import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from toolcollapse.autopsy import (DumpError, DumpedRollout, autopsy, control_tag_ids, format_autopsy,
                                  load_dump, load_tools, run_autopsy, split_turns)
from toolcollapse.chat import ENDOFTEXT, IM_END, IM_START
from toolcollapse.records import ErrorType, TurnState
from toolcollapse.tokenizer import train_tokenizer

CALL_JSON = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
CALL = f"<tool_call>\n{CALL_JSON}\n</tool_call>"
OBSERVATION = "<tool_response>\n3\n</tool_response>"
CORPUS = ["The answer is 3. Let me check.", CALL_JSON, OBSERVATION]
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=300)


@pytest.fixture(scope="module")
def plain_tok():
    """Byte-level BPE whose only special tokens are the ChatML turn tags: <tool_call> is plain text."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token=IM_END, pad_token=ENDOFTEXT)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def states(row):
    return {s: row[f"state/{s.value}"] for s in TurnState if row[f"state/{s.value}"]}


S = TurnState
CONVERSATIONS = [
    {"step": 0, "messages": [  # structured call, then the answer
        {"role": "system", "content": "You can call add."}, {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "content": "3"}, {"role": "assistant", "content": "The answer is 3."}]},
    {"step": 1, "messages": [  # text around the call; a call never closed
        {"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "Let me check. " + CALL},
        {"role": "tool", "content": "3"}, {"role": "assistant", "content": "<tool_call>\n" + CALL_JSON}]},
    {"step": 1, "messages": [{"role": "user", "content": "no answer"}]},  # nothing to parse: skipped
]


def test_conversations_jsonl_exact_states_per_step(tmp_path, tok):
    dump = load_dump(write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS))
    assert [r.step for r in dump.rollouts] == [0, 1]
    assert dump.rollouts[0].assistant_turns[0] == CALL + IM_END  # re-rendered as Qwen2.5's template writes it
    assert dump.rollouts[0].rerendered == 1 and dump.rollouts[0].end_appended == 2
    rows = autopsy(dump.rollouts, tok)
    assert [(r["step"], r["n_rollouts"], r["n_turns"]) for r in rows] == [(0, 1, 2), (1, 1, 2)]
    assert states(rows[0]) == {S.HEALTHY_CALL: 0.5, S.HEALTHY_RESPONSE: 0.5}
    assert states(rows[1]) == {S.TEXT_POLLUTION: 0.5, S.FULL_COLLAPSE: 0.5}
    assert [r["healthy_rate"] for r in rows] == [1.0, 0.0]
    errors = {k: v for k, v in rows[1].items() if k.startswith("error/") and v}
    assert errors == {"error/text_outside_call": 0.5, "error/unclosed_call": 0.5}
    assert rows[0]["turns_per_episode"] == 2.0
    n_tokens = len(tok(CALL + "The answer is 3." + IM_END, add_special_tokens=False)["input_ids"])
    assert rows[0]["response_tokens"] == n_tokens  # the <|im_end|> closing a call is a template token
    assert len(dump.notes) == 3
    assert dump.notes[0].startswith("4 of 4 assistant turns carry no end token")
    assert dump.notes[1].startswith("1 assistant turns were re-rendered")
    assert dump.notes[2] == "1 rows skipped: no assistant turn"


def test_same_keys_as_rollout_stats(tok):
    row = autopsy([DumpedRollout(0, ("The answer is 3.<|im_end|>",))], tok)[0]
    assert {f"state/{s.value}" for s in TurnState} | {f"error/{e.value}" for e in ErrorType} <= set(row)
    assert {"healthy_rate", "turns_per_episode", "response_tokens"} <= set(row)
    assert "reward_mean" not in row  # the dump gave no reward


def test_step_from_batch_size(tmp_path):
    rows = [{"messages": [{"role": "assistant", "content": "ok"}]}] * 5
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    assert [r.step for r in load_dump(path, batch_size=2).rollouts] == [0, 0, 1, 1, 2]
    assert [r.step for r in load_dump(path).rollouts] == [0] * 5


TRL_ROWS = [  # GRPOTrainer's table: step, prompt, completion, one column per reward function, advantage
    [10, "1+2?", CALL, 1.0, 0.5],
    [10, "1+2?", "The answer is 3.", 1.0, 0.5],
    [20, "1+2?", CALL_JSON, 0.0, -0.5],  # a call without its tags
    [20, "1+2?", "", 0.0, -0.5],  # nothing generated
]
TRL_COLUMNS = ["step", "prompt", "completion", "accuracy_reward", "advantage"]


def check_trl_rows(rows):
    assert [(r["step"], r["n_rollouts"], r["n_turns"]) for r in rows] == [(10, 2, 2), (20, 2, 2)]
    assert states(rows[0]) == {S.HEALTHY_CALL: 0.5, S.HEALTHY_RESPONSE: 0.5}
    assert states(rows[1]) == {S.TEXT_POLLUTION: 0.5, S.FULL_COLLAPSE: 0.5}
    assert rows[1]["error/untagged_call"] == 0.5 and rows[1]["error/empty_turn"] == 0.5
    assert rows[1]["error/missing_end_of_turn"] == 0.0  # TRL strips <|im_end|>: assumed, never seen


def test_trl_wandb_table_export(tmp_path, tok):
    path = tmp_path / "completions.table.json"
    path.write_text(json.dumps({"_type": "table", "columns": TRL_COLUMNS, "data": TRL_ROWS}))
    dump = load_dump(path)
    assert sum(r.end_appended for r in dump.rollouts) == 4
    check_trl_rows(autopsy(dump.rollouts, tok))


def test_trl_jsonl_and_parquet(tmp_path, tok):
    pd = _pandas()
    records = [dict(zip(TRL_COLUMNS, r)) for r in TRL_ROWS]
    check_trl_rows(autopsy(load_dump(write_jsonl(tmp_path / "t.jsonl", records), fmt="trl").rollouts, tok))
    out = tmp_path / "completions"
    out.mkdir()
    pd.DataFrame(records[:2]).to_parquet(out / "completions_00010.parquet")  # as TRL writes it, a file a step
    pd.DataFrame(records[2:]).to_parquet(out / "completions_00020.parquet")
    check_trl_rows(autopsy(load_dump(out).rollouts, tok))


def test_trl_conversational_completion_from_parquet(tmp_path, tok):
    pd = _pandas()
    completion = [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "assistant", "content": "The answer is 3."},
    ]
    other = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "neg", "arguments": {"x": 1}}}]}]
    df = pd.DataFrame({"step": [5, 5], "prompt": [[{"role": "user", "content": "1+2?"}]] * 2,
                       "completion": [completion, other], "advantage": [0.0, 0.0]})
    df.to_parquet(tmp_path / "c.parquet")
    dump = load_dump(tmp_path / "c.parquet")
    call, answer = dump.rollouts[0].assistant_turns
    body = call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>" + IM_END)
    assert json.loads(body) == json.loads(CALL_JSON)  # parquet's null fill ("x") dropped again
    assert answer == "The answer is 3." + IM_END
    assert states(autopsy(dump.rollouts, tok)[0]) == {S.HEALTHY_CALL: 2 / 3, S.HEALTHY_RESPONSE: 1 / 3}


def test_verl_rollout_data_dir(tmp_path, tok):
    """verl writes <rollout_data_dir>/<step>.jsonl, `output` decoded with skip_special_tokens=True."""
    outputs = [CALL + "\nuser\n" + OBSERVATION + "\nassistant\nThe answer is 3.",
               "Let me check. " + CALL + "\nuser\n" + OBSERVATION]  # ends on a tool response: one turn
    prompt = "system\n...\nuser\n1+2?\nassistant\n"
    write_jsonl(tmp_path / "3.jsonl", [{"input": prompt, "output": o, "gts": "3", "score": s, "step": 3}
                                       for o, s in zip(outputs, [1.0, 0.0])])
    dump = load_dump(tmp_path)
    assert [len(r.assistant_turns) for r in dump.rollouts] == [2, 1]
    (row,) = autopsy(dump.rollouts, tok)
    assert (row["step"], row["n_rollouts"], row["n_turns"], row["reward_mean"]) == (3, 2, 3, 0.5)
    assert states(row) == {S.HEALTHY_CALL: 1 / 3, S.HEALTHY_RESPONSE: 1 / 3, S.TEXT_POLLUTION: 1 / 3}


def test_split_turns_with_tags_kept():
    text = (CALL + "<|im_end|>\n<|im_start|>user\n" + OBSERVATION + "<|im_end|>\n<|im_start|>assistant\n"
            + "The answer is 3.<|im_end|>\n")
    assert split_turns(text) == [CALL + "<|im_end|>", "The answer is 3.<|im_end|>"]
    assert split_turns("The answer is") == ["The answer is"]  # cut by the budget: no end token, none assumed
    assert split_turns("") == [""]


def test_tags_kept_in_dump_means_no_end_assumed(tmp_path, tok):
    rows = [{"step": 0, "completion": "The answer is 3.<|im_end|>"},
            {"step": 0, "completion": "The answer is"}]
    dump = load_dump(write_jsonl(tmp_path / "t.jsonl", rows))
    assert dump.notes == [] and sum(r.end_appended for r in dump.rollouts) == 0
    assert states(autopsy(dump.rollouts, tok)[0]) == {S.HEALTHY_RESPONSE: 0.5, S.FULL_COLLAPSE: 0.5}


def test_tokenizer_without_tool_tags_parses_by_text_and_warns(tmp_path, tok, plain_tok):
    assert control_tag_ids(tok)[1] == []
    id_to_tag, missing = control_tag_ids(plain_tok)
    assert missing == TOOL_TAGS and sorted(id_to_tag.values()) == sorted([ENDOFTEXT, IM_START, IM_END])
    dump = load_dump(write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS))
    assert ([states(r) for r in autopsy(dump.rollouts, plain_tok)]
            == [states(r) for r in autopsy(dump.rollouts, tok)])
    plain_tok.save_pretrained(tmp_path / "tok")
    rows, notes = run_autopsy(tmp_path / "c.jsonl", tmp_path / "tok")
    assert len(rows) == 2
    warning = "control tags that are not single tokens of this tokenizer, matched as text: "
    assert warning + ", ".join(TOOL_TAGS) in notes
    assert "no tool specs: unknown_tool and bad_arguments are not checked" in notes
    table = format_autopsy(rows, notes)
    assert table.splitlines()[0].split()[:4] == ["step", "rollouts", "turns", "healthy"]
    assert "text_outside_call 0.50, unclosed_call 0.50" in table and "note: no tool specs" in table


def test_tool_specs_enable_schema_checks(tmp_path, tok):
    params = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
    spec = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": params}}
    (tmp_path / "tools.json").write_text(json.dumps([spec]))
    tools = load_tools(tmp_path / "tools.json")
    turns = (CALL + IM_END, '<tool_call>\n{"name": "sub", "arguments": {}}\n</tool_call>' + IM_END)
    row = autopsy([DumpedRollout(0, turns)], tok, tools)[0]
    assert row["error/unknown_tool"] == 0.5 and row["state/healthy_call"] == 0.5
    assert autopsy([DumpedRollout(0, turns)], tok)[0]["state/healthy_call"] == 1.0  # unchecked without specs


@pytest.mark.parametrize("line, problem", [
    ("{not json", "c.jsonl:2: not JSON"),
    ('{"step": 1, "input": "x"}',
     "c.jsonl:2: no 'messages' or 'conversation' or 'completion' or 'output' field"),
    ('{"step": "one", "completion": "x"}', "c.jsonl:2: step should be an integer"),
    ('{"messages": [{"content": "x"}]}',
     "c.jsonl:2: messages[0]: a message should be an object with a 'role'"),
    ('[1, 2]', "c.jsonl:2: expected a JSON object"),
])
def test_malformed_row_names_file_and_line(tmp_path, line, problem):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(CONVERSATIONS[0]) + "\n" + line + "\n")
    with pytest.raises(DumpError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        load_dump(path)


def test_forced_format_and_missing_path(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:1])
    with pytest.raises(DumpError, match="c.jsonl:1: no 'output' field"):
        load_dump(path, fmt="verl")
    with pytest.raises(DumpError, match="no such file"):
        load_dump(tmp_path / "missing.jsonl")


def _pandas():
    pytest.importorskip("pyarrow", reason="TRL's parquet dumps need the [parquet] extra: pip install 'toolcollapse[parquet]'")
    return pytest.importorskip("pandas", reason="TRL's parquet dumps need the [parquet] extra")
