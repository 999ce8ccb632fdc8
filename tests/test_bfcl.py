"""The BFCL v4 multi-turn environment: data and split, docs, safe calls, BFCL's verdict, rollouts."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("bfcl_eval", reason="env: bfcl needs `pip install --no-deps bfcl-eval` (its data and backends)")
pytest.importorskip("mpmath", reason="env: bfcl needs the [bfcl] extra: pip install 'toolcollapse[bfcl]'")

from toolcollapse.chat import PieceEncoder, conversation_pieces
from toolcollapse.config import BFCLConfig
from toolcollapse.envs.bfcl import BFCL
from toolcollapse.envs.bfcl.backend import World, execute, load_world, serialize
from toolcollapse.envs.bfcl.calls import CallSyntaxError, LiteralCall, parse_call_string
from toolcollapse.envs.bfcl.checker import check_turns, missing_results, state_differences
from toolcollapse.envs.bfcl.data import CATEGORIES, bfcl_data_dir, load_entries
from toolcollapse.envs.bfcl.prompts import ADDED_FUNCTIONS_TEXT, INSTRUCTIONS
from toolcollapse.envs.bfcl.schema import DOC_FILES, load_class_docs, to_json_schema
from toolcollapse.envs.bfcl.tasks import new_world
from toolcollapse.evaluate import replay_references
from toolcollapse.model import build_model
from toolcollapse.records import ParsedTurn, Task, ToolCall, TurnState
from toolcollapse.rollout import RolloutEngine, SamplingParams
from toolcollapse.tokenizer import train_tokenizer
from toolcollapse.tools import validate_arguments

ROOT = Path(__file__).resolve().parents[1]


def _load_bench():
    spec = importlib.util.spec_from_file_location("bfcl_parity", ROOT / "bench" / "bfcl_parity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


parity = _load_bench()


@pytest.fixture(scope="module")
def env() -> BFCL:
    return BFCL(BFCLConfig(categories=CATEGORIES))


@pytest.fixture(scope="module")
def by_id(env) -> dict[str, Task]:
    return {t.id: t for t in env.tasks("train") + env.tasks("test")}


def call_turn(name: str, arguments: dict) -> ParsedTurn:
    return ParsedTurn(TurnState.HEALTHY_CALL, (), ToolCall(name, arguments), "", "call")


def answer_turn(text: str = "Done.") -> ParsedTurn:
    return ParsedTurn(TurnState.HEALTHY_RESPONSE, (), None, text, "answer")


# ---------------------------------------------------------------- data and split


@pytest.mark.parametrize("category", CATEGORIES)
def test_each_category_holds_200_entries_with_one_ground_truth_turn_per_user_turn(category):
    entries = load_entries(bfcl_data_dir(), category)
    assert [e.id for e in entries] == [f"multi_turn_{category}_{i}" for i in range(200)]
    assert all(len(e.user_turns) == len(e.ground_truth) >= 1 for e in entries)


def test_split_is_the_seeded_shuffle_per_category(env):
    order = list(range(200))
    random.Random(42).shuffle(order)
    assert order[:5] == [66, 187, 101, 193, 111] and order[100:105] == [174, 4, 29, 183, 99]  # hand-checked
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) == len(test) == 100 * len(CATEGORIES)
    for category in CATEGORIES:
        assert [t.id for t in train if t.meta["category"] == category] == \
            [f"multi_turn_{category}_{i}" for i in order[:100]]
        assert [t.id for t in test if t.meta["category"] == category] == \
            [f"multi_turn_{category}_{i}" for i in order[100:]]
    assert all(t.split == "train" for t in train) and all(t.split == "test" for t in test)
    assert env.tasks("test", 3) == test[:3]


def test_bad_splits_and_categories_are_clear_errors(env):
    with pytest.raises(ValueError, match="train, test"):
        env.tasks("ood_format")
    for category, reason in [("web_search", "network"), ("memory_vector", "embedding"), ("memory_kv", "memory")]:
        with pytest.raises(ValueError, match=reason):
            BFCL(BFCLConfig(categories=(category,)))
    with pytest.raises(ValueError, match="unknown BFCL multi-turn category 'simple'"):
        BFCL(BFCLConfig(categories=("simple",)))
    with pytest.raises(ValueError, match="exceeds the 200 entries"):
        BFCL(BFCLConfig(categories=("base",), n_train=150, n_test=100)).tasks("train")


# ---------------------------------------------------------------- docs


def test_bfcl_types_become_json_schema():
    assert to_json_schema({"type": "float", "description": "x"}) == {"type": "number", "description": "x"}
    assert to_json_schema({"type": "tuple", "items": {"type": "float"}}) == {"type": "array",
                                                                            "items": {"type": "number"}}
    assert to_json_schema({"type": "dict"}) == {"type": "object", "additionalProperties": True}
    assert to_json_schema({"type": "any", "default": None}) == {"default": None}
    assert to_json_schema({"type": "dict", "properties": {"a": {"type": "integer"}}, "required": ["a"]}) == \
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with pytest.raises(ValueError, match="unknown BFCL parameter type 'complex'"):
        to_json_schema({"type": "complex"})


def test_docs_validate_calls_as_bfcl_means_them():
    docs = {t.name: t for c in DOC_FILES for t in load_class_docs(bfcl_data_dir(), c)}
    assert len(docs) == 128  # 18 + 17 + 10 + 14 + 9 + 20 + 18 + 22 functions, no shared names
    assert docs["cd"].parameters == {"type": "object", "properties": {"folder": {
        "type": "string", "description": "The folder of the directory to change to. You can only change one folder "
                                        "level at a time. "}}, "required": ["folder"]}
    assert validate_arguments(docs["add"], {"a": 1, "b": 2.5}) == []  # an integer is a valid float
    assert validate_arguments(docs["add"], {"a": "1", "b": 2}) == ['arguments.a should be number, got "1"']
    assert validate_arguments(docs["cd"], {"folder": "x", "extra": 1}) == ["arguments has unknown key 'extra'"]
    assert validate_arguments(docs["close_ticket"], {"ticket_id": "ticket_001"}) == []  # BFCL's own GT does this
    for spec in docs.values():
        _assert_json_schema(spec.parameters)


def _assert_json_schema(schema: dict) -> None:
    assert schema.get("type", "string") in {"object", "array", "string", "integer", "number", "boolean"}
    for sub in schema.get("properties", {}).values():
        _assert_json_schema(sub)
    if "items" in schema:
        _assert_json_schema(schema["items"])


# ---------------------------------------------------------------- calls and results


def test_call_strings_parse_to_literals():
    assert parse_call_string("sort('final_report.pdf')") == LiteralCall("sort", ("final_report.pdf",), {})
    assert parse_call_string("mean(numbers=[1, -2.5, 3])") == LiteralCall("mean", (), {"numbers": [1, -2.5, 3]})
    assert parse_call_string(" f(a=(1, 2), b=None, c={'k': True}) ") == \
        LiteralCall("f", (), {"a": (1, 2), "b": None, "c": {"k": True}})


@pytest.mark.parametrize("text", [
    "__import__('os').system('touch /tmp/pwned')", "cd(folder=__import__('os').system('touch /tmp/pwned'))",
    "os.system('touch /tmp/pwned')", "cd(**{'folder': 'x'})", "cd(*['x'])", "cd(folder='a'); rm('b')",
    "[cd(folder='x')]", "cd(folder=lambda: 1)", "cd(folder=x)", "cd(folder='x'",
])
def test_anything_but_a_literal_call_is_refused(text):
    with pytest.raises(CallSyntaxError):
        parse_call_string(text)


def test_results_are_serialised_as_bfcl_does_with_sets_sorted():
    assert serialize("as is") == "as is"
    assert serialize({"a": [1, "é"]}) == '{"a": [1, "\\u00e9"]}'  # json.dumps, ASCII, insertion order
    assert serialize(None) == "None" and serialize(2.5) == "2.5" and serialize([1, "x"]) == "[1, 'x']"
    assert serialize({"s": {"b", "a", "c"}}) == "{'s': {'a', 'b', 'c'}}"  # not JSON: str(), sets sorted
    assert serialize(frozenset()) == "set()"


# ---------------------------------------------------------------- the checker


def test_missing_results_is_a_multiset_difference_ignoring_order():
    assert missing_results(["a", "a", "b"], ["b", "a", "c"]) == ["a"]
    assert missing_results(["b", "a"], ["a", "b"]) == []
    assert missing_results([], []) == []


def test_state_differences_ignore_private_attributes():
    truth = {"C": SimpleNamespace(x=1, _hidden=2)}
    assert state_differences({"C": SimpleNamespace(x=1, _hidden=3)}, truth) == []
    assert state_differences({"C": SimpleNamespace(x=2, _hidden=2)}, truth) == ["C.x"]
    assert state_differences({"C": SimpleNamespace(_hidden=2)}, truth) == ["C.x"]


def test_checker_error_types(env, by_id):
    task = by_id["multi_turn_base_0"]
    entry = env.entry(task)
    docs = env.docs(entry)
    gt = [[parse_call_string(s) for s in turn] for turn in entry.ground_truth]

    def verdict(turns):
        return check_turns(new_world(entry, docs), new_world(entry, docs), turns, entry.ground_truth)

    assert verdict(gt).valid
    assert verdict(gt[:-1]).error_type == "multi_turn:force_terminated"
    assert (verdict([[]] + gt[1:]).error_type, verdict([[]] + gt[1:]).turn) == \
        ("multi_turn:empty_turn_model_response", 0)
    assert verdict([gt[0][:-1]] + gt[1:]).error_type == "multi_turn:instance_state_mismatch"
    no_read = [gt[0], gt[1][:1]] + gt[2:]  # grep is read-only: the state matches, its result is missing
    assert (verdict(no_read).error_type, verdict(no_read).turn) == ("multi_turn:execution_response_mismatch", 1)


# ---------------------------------------------------------------- episodes


def test_reference_turns_one_call_each_and_closes_every_user_turn(by_id):
    ref = by_id["multi_turn_miss_param_0"].reference
    assert ref[0].tool_call == ToolCall("cd", {"folder": "document"})
    assert ref[1].role == "tool" and ref[1].content == '{"current_working_directory": "document"}'
    assert ToolCall("sort", {"file_name": "final_report.pdf"}) in [m.tool_call for m in ref]  # positional, bound
    texts = [m.content for m in ref if m.role == "assistant" and m.tool_call is None]
    assert texts == ["Done. I used cd, mkdir, mv for this request.", "Done. I used cd, grep for this request.",
                     "Done. I used sort for this request.",
                     "I need more information to do this. Could you give me the missing details?",
                     "Done. I used cd, mv, diff for this request."]
    assert sum(m.role == "user" for m in ref) == 4  # the 5 user turns less the one in the prompt


def test_system_prompt_is_bfcl_instructions_then_the_qwen_tools_block(by_id):
    system = by_id["multi_turn_base_0"].prompt[0].content
    assert system.startswith(INSTRUCTIONS + "\n\n# Tools\n\nYou are provided with function signatures")
    assert "The answer is" not in system and system.endswith("</tool_call>")


def test_miss_func_reveals_the_held_out_function_at_its_turn(env, by_id):
    task = by_id["multi_turn_miss_func_0"]
    assert env.entry(task).missed == {3: ("sort",)}
    assert '"name": "sort"' not in task.prompt[0].content
    state = env.reset(task)
    assert "sort" not in state.tools and "cd" in state.tools
    seen = [env.step(state, answer_turn()) for _ in range(3)]
    assert "sort" in state.tools
    assert seen[2][0].role == "user" and seen[2][0].content.endswith("</tools>\n" + ADDED_FUNCTIONS_TEXT)
    assert seen[2][0].content.startswith('<tools>\n{"name": "sort"')
    assert env.step(state, answer_turn()) and env.step(state, answer_turn()) == [] and state.done


def test_a_held_out_function_the_ground_truth_uses_early_is_not_held_out(env, by_id):
    assert env.entry(by_id["multi_turn_miss_func_49"]).missed == {3: ("wc", "cat")}  # BFCL: wc, tail, cat


def test_answering_every_turn_without_calls_fails_at_the_first_turn_that_needs_one(env, by_id):
    task = by_id["multi_turn_base_0"]
    state = env.reset(task)
    observations = [env.step(state, answer_turn()) for _ in range(task.meta["n_turns"])]
    assert [len(o) for o in observations] == [1] * (task.meta["n_turns"] - 1) + [0]
    assert not env.success(state)
    assert state.extra["bfcl"].verdict.error_type == "multi_turn:empty_turn_model_response"


def test_a_malformed_reply_in_the_last_user_turn_is_a_reply(env, by_id):
    """As BFCL's empty decode: the turn counts, the check judges it (no force_terminated)."""
    task = by_id["multi_turn_base_0"]
    state = env.reset(task)
    for _ in range(task.meta["n_turns"] - 1):
        assert env.step(state, answer_turn())  # the next user turn
    malformed = ParsedTurn(TurnState.FULL_COLLAPSE, (), None, "", "none", "turn ended without <|im_end|>")
    assert env.step(state, malformed) == [] and state.done
    assert not env.success(state)
    assert state.extra["bfcl"].verdict.error_type == "multi_turn:empty_turn_model_response"


def test_an_episode_that_stops_early_is_force_terminated(env, by_id):
    task = by_id["multi_turn_base_0"]
    state = env.reset(task)
    for msg in task.reference[:3]:  # cd, then its tool reply, then mkdir
        if msg.tool_call is not None:
            env.step(state, call_turn(msg.tool_call.name, msg.tool_call.arguments))
    assert not env.success(state)
    assert state.extra["bfcl"].verdict.error_type == "multi_turn:force_terminated"


# ---------------------------------------------------------------- safety


def _fs_episode(env, by_id):
    return env.reset(by_id["multi_turn_base_0"])


@pytest.mark.parametrize("name,arguments", [
    ("__import__('os').system('touch {pwned}')", {}),
    ("__import__('os').system('touch /tmp/pwned')", {}),
    ("_load_scenario", {"scenario": {}}),  # would reset the file system if it ran
    ("__init__", {}),
    ("__class__", {}),
    ("_populate_directory", {"dir_instance": None}),
    ("get_stock_info", {"symbol": "AAPL"}),  # documented, but for a class this entry does not involve
    ("root", {}),  # a public attribute, not a documented function
    ("eval", {"source": "__import__('os').system('touch {pwned}')"}),
])
def test_undocumented_and_private_names_are_refused_and_nothing_runs(env, by_id, tmp_path, name, arguments):
    pwned = tmp_path / "pwned"
    name = name.format(pwned=pwned)
    arguments = {k: v.format(pwned=pwned) if isinstance(v, str) else v for k, v in arguments.items()}
    tmp_pwned_existed = Path("/tmp/pwned").exists()
    state = _fs_episode(env, by_id)
    env.step(state, call_turn("cd", {"folder": "document"}))
    fresh = new_world(env.entry(state.task), env.docs(env.entry(state.task)))
    execute(fresh, LiteralCall("cd", (), {"folder": "document"}))
    [obs] = env.step(state, call_turn(name, arguments))
    assert obs.role == "tool" and obs.content.startswith("Error: ") and "not one of the available" in obs.content
    assert state.extra["bfcl"].rejected == [obs.content]
    assert state.extra["bfcl"].calls[0][-1].name == name  # recorded as the model's call, as BFCL would
    instances = env.instances(state)
    assert state_differences(instances, fresh.instances) == []
    assert instances["GorillaFileSystem"]._current_dir.name == "document"
    assert not pwned.exists() and Path("/tmp/pwned").exists() == tmp_pwned_existed


@pytest.mark.parametrize("where", ["tmp_path", "/tmp"])
def test_code_in_an_argument_is_only_ever_a_string(env, by_id, tmp_path, where):
    pwned = (tmp_path if where == "tmp_path" else Path("/tmp")) / "pwned"
    existed = pwned.exists()
    state = _fs_episode(env, by_id)
    fresh = new_world(env.entry(state.task), env.docs(env.entry(state.task)))
    [obs] = env.step(state, call_turn("cd", {"folder": f"__import__('os').system('touch {pwned}')"}))
    assert json.loads(obs.content) == {"error": f"cd: __import__('os').system('touch {pwned}'): "
                                                "Unsupported path. Only one folder level at a time is supported."}
    instances = env.instances(state)
    fs = instances["GorillaFileSystem"]
    assert state_differences(instances, fresh.instances) == [] and fs._current_dir is fs.root
    assert pwned.exists() == existed


def test_a_backend_exception_is_an_error_observation(env, by_id):
    state = _fs_episode(env, by_id)
    [obs] = env.step(state, call_turn("cd", {"directory": "document"}))
    assert obs.content == "Error during execution: GorillaFileSystem.cd() got an unexpected keyword argument " \
                          "'directory'"
    assert state.extra["bfcl"].rejected == []  # the method was reached: BFCL records the same error


def test_an_unparseable_call_is_an_error_observation_and_not_a_call(env, by_id):
    state = _fs_episode(env, by_id)
    bad = ParsedTurn(TurnState.TEXT_POLLUTION, (), None, "", "call", "call body is not JSON")
    [obs] = env.step(state, bad)
    assert json.loads(obs.content) == {"error": "could not parse the tool call: call body is not JSON"}
    assert state.extra["bfcl"].calls == [[]] and state.n_calls == 1


def test_backend_precision_settings_do_not_leak():
    import decimal

    import mpmath

    world = load_world(("MathAPI",), {}, False, {"MathAPI": ["logarithm", "square_root"]})
    before = (mpmath.mp.prec, decimal.getcontext().prec)
    assert execute(world, LiteralCall("square_root", (), {"number": 2, "precision": 5}))[0] == \
        str({"result": decimal.Decimal("1.4142")})
    execute(world, LiteralCall("logarithm", (), {"value": 8, "base": 2, "precision": 3}))
    assert (mpmath.mp.prec, decimal.getcontext().prec) == before


# ---------------------------------------------------------------- parity with BFCL


@pytest.mark.slow
def test_every_ground_truth_trajectory_replays_healthy_and_succeeds(env):
    tasks = env.tasks("train") + env.tasks("test")
    result = replay_references(env, tasks, "all")
    assert result.n_tasks == 800 and result.failures == ()
    assert result.success_rate == 1.0 and result.healthy_rate == 1.0


def test_perturbed_trajectories_get_bfcl_own_verdict(env, by_id):
    tasks = [by_id[f"multi_turn_{c}_{i}"] for c in CATEGORIES for i in range(30)]
    cases = parity.make_cases(tasks, per_entry=2, seed=0)
    outcomes = parity.judge(env, by_id, cases)
    disagreements = [(o.case.task_id, o.case.kind, o.ours, o.bfcl) for o in outcomes if not o.agree]
    assert len(outcomes) == 240 and disagreements == []
    n_pass = sum(o.bfcl[0] for o in outcomes)
    assert n_pass >= 60 and len(outcomes) - n_pass >= 100  # both verdicts well represented
    assert {o.case.kind for o in outcomes} == set(parity.PERTURBATIONS)


# ---------------------------------------------------------------- rollouts


@pytest.fixture(scope="module")
def tokenizer(env):
    return train_tokenizer(env.tokenizer_corpus(30), 2048)


def _short_tasks(env, tokenizer, limit: int = 3000) -> list[Task]:
    """A base and a miss_func test task of 2-3 user turns whose prompt is under `limit` tokens."""
    enc = PieceEncoder(tokenizer)
    fits = [t for t in env.tasks("test") if 2 <= t.meta["n_turns"] <= 3
            and len(enc.encode(conversation_pieces(t.prompt, True))[0]) < limit]
    return [next(t for t in fits if t.meta["category"] == c) for c in ("base", "miss_func")]


def test_random_tiny_model_runs_bfcl_episodes(env, tokenizer):
    tasks = _short_tasks(env, tokenizer)
    model = build_model("tiny", len(tokenizer), 4096, tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
    params = SamplingParams(max_turns=3, max_new_tokens=12, max_seq_len=4096, batch_size=4)
    episodes = RolloutEngine(model, tokenizer, env).generate(tasks, params, seed=0)
    assert [e.task_id for e in episodes] == [t.id for t in tasks]
    for ep in episodes:
        assert 1 <= len(ep.turns) <= 3 and ep.finish in ("answered", "max_turns", "context_limit", "malformed")
        assert ep.success is False and len(ep.tokens) == len(ep.loss_mask) == len(ep.logprobs)


class AnswerAtOnce(torch.nn.Module):
    """A policy that replies `word` then <|im_end|> to every user turn: logits forced on top of a
    real tiny model (its KV cache and shapes stay the engine's), decided by the last input token."""

    def __init__(self, inner, word_id: int, end_id: int):
        super().__init__()
        self.inner, self.config, self.word_id, self.end_id = inner, inner.config, word_id, end_id

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                logits_to_keep=0):
        from toolcollapse.model import forward

        out = forward(self.inner, input_ids, attention_mask, position_ids, past_key_values, logits_to_keep)
        forced = torch.full_like(out.logits, -1e9)
        nxt = torch.where(input_ids[:, -1] == self.word_id, self.end_id, self.word_id)  # [B]
        forced[torch.arange(len(nxt)), -1, nxt] = 0.0
        out.logits = forced
        return out


def test_the_engine_walks_every_user_turn_and_stops_after_the_last(env, tokenizer):
    tasks = _short_tasks(env, tokenizer)
    inner = build_model("tiny", len(tokenizer), 4096, tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
    word_id = tokenizer.convert_tokens_to_ids("D")
    model = AnswerAtOnce(inner, word_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    params = SamplingParams(max_turns=10, max_new_tokens=4, max_seq_len=4096, greedy=True, batch_size=4)
    episodes = RolloutEngine(model, tokenizer, env).generate(tasks, params, seed=0)
    for task, ep in zip(tasks, episodes):
        users = [m.content for m in task.reference if m.role == "user"]
        assert len(ep.turns) == task.meta["n_turns"] and ep.finish == "answered" and ep.final_text == "D"
        assert all(t.parsed.state == TurnState.HEALTHY_RESPONSE for t in ep.turns)
        assert [t.observation for t in ep.turns] == users + [None]
        assert ep.success is False  # no calls where the ground truth needs some


@pytest.mark.parametrize("name,arguments", [("power", {"base": 9, "exponent": 99999999999}),
                                            ("square_root", {"number": 2, "precision": 10 ** 9}),
                                            ("logarithm", {"value": 2, "base": 10, "precision": float("inf")})])
def test_arguments_that_would_stall_the_run_are_refused(name, arguments):
    world = World({}, {name: lambda **kw: pytest.fail("ran")})
    text, ran = execute(world, LiteralCall(name, (), arguments))
    assert not ran and "exceeds 1000" in text


def test_an_answer_on_the_last_allowed_turn_ends_the_episode_at_max_turns(env, tokenizer):
    """Before: the next user message was appended after the turn budget ran out, and the episode was
    labelled `answered`. Now: `max_turns`, nothing appended, and BFCL's verdict on the turns the model saw."""
    tasks = _short_tasks(env, tokenizer)
    inner = build_model("tiny", len(tokenizer), 4096, tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
    model = AnswerAtOnce(inner, tokenizer.convert_tokens_to_ids("D"), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engine = RolloutEngine(model, tokenizer, env)
    for max_turns in (1, 2):
        params = SamplingParams(max_turns=max_turns, max_new_tokens=4, max_seq_len=4096, greedy=True, batch_size=4)
        for task, ep in zip(tasks, engine.generate(tasks, params, seed=0)):
            assert len(ep.turns) == max_turns < task.meta["n_turns"]
            assert ep.finish == "max_turns" and ep.turns[-1].observation is None
            assert ep.tokens[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # the answer is the last token
            assert engine.decode(ep.tokens[ep.prompt_len:]).count("<|im_start|>user") == max_turns - 1
            assert ep.success is False
