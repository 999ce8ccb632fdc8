import json

import pytest

from toolcollapse.config import SPLITS, WorldConfig
from toolcollapse.envs.toolworld import ToolWorld, answer_matches
from toolcollapse.envs.toolworld.functions import SOLVING_TOOLS
from toolcollapse.envs.toolworld.tasks import OOD_TEMPLATES, TRAIN_TEMPLATES
from toolcollapse.chat import CONTROL_TAGS, PieceEncoder, assistant_body
from toolcollapse.evaluate import replay_references
from toolcollapse.parser import parse_turn, parse_turn_ids
from toolcollapse.records import ToolCall, TurnState


def calls(task):
    return [m.tool_call for m in task.reference if m.role == "assistant" and m.tool_call is not None]


def results(task):
    return [json.loads(m.content)["result"] for m in task.reference if m.role == "tool"]


def test_generation_is_deterministic(world):
    again = ToolWorld(world.cfg)
    for split in SPLITS:
        assert [(t.prompt, t.reference, t.answer) for t in again.tasks(split)] == \
               [(t.prompt, t.reference, t.answer) for t in world.tasks(split)]
    other = ToolWorld(WorldConfig(seed=1, n_train=50, n_test=50, n_ood=50))
    assert [t.prompt for t in other.tasks("test")] != [t.prompt for t in world.tasks("test")][:50]


def test_tools_are_documented_with_json_schema(world):
    tools = world.functions.tools
    assert len(SOLVING_TOOLS) >= 6 and len(tools) > len(SOLVING_TOOLS)  # distractors too
    system = world.tasks("test")[0].prompt[0].content
    for spec in tools:
        assert json.dumps(spec.to_doc()) in system
        assert spec.parameters["type"] == "object" and spec.required


@pytest.mark.parametrize("split, lo, hi", [("train", 2, 5), ("test", 2, 5), ("ood_content", 2, 6),
                                           ("ood_format", 2, 5)])
def test_chains_are_dependent(world, split, lo, hi):
    for task in world.tasks(split):
        cs, rs = calls(task), results(task)
        assert lo <= len(cs) <= hi
        last = json.dumps(cs[-1].arguments)
        # the last call consumes an earlier result: the model must read tool responses
        assert any(json.dumps(r) in last for r in rs[:-1]), task.id


def test_splits(world):
    train_keys = {t.meta["key"] for t in world.tasks("train")}
    assert not train_keys & {t.meta["key"] for t in world.tasks("test")}
    assert not train_keys & {t.meta["key"] for t in world.tasks("ood_format")}
    # content OOD: unseen entities, and some unseen compositions with longer chains
    ood_names = {e.name for e in world.kb.entities.values() if e.pool == "ood"}
    train_text = " ".join(t.prompt[1].content + str(t.reference) for t in world.tasks("train"))
    assert not any(name in train_text for name in ood_names)
    templates = {t.meta["template"] for t in world.tasks("ood_content")}
    assert templates & set(OOD_TEMPLATES) and not set(OOD_TEMPLATES) & set(TRAIN_TEMPLATES)
    assert max(t.meta["n_calls"] for t in world.tasks("ood_content")) == 6
    # format OOD: other wording and tool order, same tools
    train_system = world.tasks("train")[0].prompt[0].content
    fmt = world.tasks("ood_format")
    assert all(t.prompt[0].content != train_system for t in fmt)
    assert len({t.meta["style"] for t in fmt}) == 3
    assert len({t.prompt[0].content for t in fmt}) > 10  # shuffled orders


@pytest.mark.parametrize("call, error", [
    (ToolCall("kb_lookup", {"entity": "Atlantis", "attribute": "population"}), "unknown entity"),
    (ToolCall("kb_lookup", {"entity": "X"}), "missing required 'attribute'"),
    (ToolCall("calculator", {"operation": "divide", "a": 1, "b": 0}), "division by zero"),
    (ToolCall("calculator", {"operation": "pow", "a": 1, "b": 2}), "must be one of"),
    (ToolCall("convert_units", {"value": 1, "from_unit": "kg", "to_unit": "ft"}), "cannot convert"),
    (ToolCall("date_add", {"date": "yesterday", "days": 3}), "not a date"),
    (ToolCall("date_add", {"date": "9999-12-31", "days": 3}), "out of range"),
    (ToolCall("aggregate", {"values": [], "function": "max"}), "at least 1"),
    (ToolCall("teleport", {}), "unknown tool"),
])
def test_tool_failures_are_observations(world, call, error):
    value, observation = world.functions.execute(call)
    assert value is None and error in json.loads(observation)["error"]


def test_env_turns_malformed_calls_into_error_observations(world):
    task = world.tasks("test")[0]
    state = world.reset(task)
    parsed = parse_turn('<tool_call>\n{"name": "kb_lookup", "arguments": {"entity": 1}\n</tool_call>',
                        world.tool_table)
    assert parsed.end == "call"
    (obs,) = world.step(state, parsed)
    assert obs.role == "tool" and "error" in json.loads(obs.content)
    assert world.step(state, parse_turn("The answer is nothing.<|im_end|>")) == [] and state.done
    assert not world.success(state)


def test_answer_matching():
    assert answer_matches("The answer is 258.16", "258.16")
    assert answer_matches("The answer is 1200.0.", "1200")
    assert answer_matches("the answer is Velmora.", "Velmora")
    assert answer_matches("The answer is 1921-03-04.", "1921-03-04")
    assert not answer_matches("The answer is 258.17.", "258.16")
    assert not answer_matches("The answer is", "5")


@pytest.mark.parametrize("split", SPLITS)
def test_oracle_replay_is_perfect(world, split):
    """Each reference turn parses healthy, executing it reproduces the reference tool reply,
    and every episode succeeds."""
    result = replay_references(world, world.tasks(split), split)
    assert result.failures == () and result.success_rate == 1.0 and result.healthy_rate == 1.0


def test_oracle_turns_parse_healthy_from_their_tokens(world, tokenizer):
    encoder = PieceEncoder(tokenizer)
    id_to_tag = {encoder.special_ids[t]: t for t in CONTROL_TAGS}
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    for task in world.tasks("test")[:100] + world.tasks("ood_content")[:50]:
        for msg in task.reference:
            if msg.role == "assistant":
                ids, _ = encoder.encode(assistant_body(msg))
                parsed = parse_turn_ids(ids, id_to_tag, decode, world.tool_table)
                assert parsed.errors == ()
                assert parsed.state == (TurnState.HEALTHY_CALL if msg.tool_call else TurnState.HEALTHY_RESPONSE)
                assert parsed.call == msg.tool_call


def test_the_content_shift_one_axis_at_a_time(world):
    """ood_entities: unseen names in trained templates; ood_compositions: trained names in unseen
    templates of at most 5 calls; ood_chains: trained names in the 6-call unseen templates."""
    ood_names = {e.name for e in world.kb.entities.values() if e.pool == "ood"}
    main_names = {e.name for e in world.kb.entities.values() if e.pool == "main"}
    entities, compositions, chains = (world.tasks(s) for s in ("ood_entities", "ood_compositions", "ood_chains"))
    assert all(t.meta["pool"] == "ood" and t.meta["template"] in TRAIN_TEMPLATES for t in entities)
    assert any(name in entities[0].prompt[1].content for name in ood_names)
    for tasks, calls_range in ((compositions, range(2, 6)), (chains, range(6, 7))):
        assert all(t.meta["pool"] == "main" and t.meta["template"] in OOD_TEMPLATES for t in tasks)
        assert all(t.meta["n_calls"] in calls_range for t in tasks)
        assert any(name in tasks[0].prompt[1].content for name in main_names)
    assert len({t.meta["template"] for t in compositions}) == 3 and len({t.meta["template"] for t in chains}) == 2



def test_ood_facts_asks_about_trained_entities_in_a_counterfactual_world(world):
    """ood_facts: main-pool names, programs disjoint from train, every fact drawn again; its
    reference conversations are the counterfactual world's (the episode's tools answer from it),
    and the same calls in the real world give other results."""
    facts = world.tasks("ood_facts")
    train_keys = {t.meta["key"] for t in world.tasks("train")}
    main_names = {e.name for e in world.kb.entities.values() if e.pool == "main"}
    assert all(t.meta["facts"] == "counterfactual" and t.meta["pool"] == "main" for t in facts)
    assert all(t.meta["template"] in TRAIN_TEMPLATES and t.meta["key"] not in train_keys for t in facts)
    assert all(any(f'"{n}"' in t.prompt[1].content for n in main_names) for t in facts)
    assert all(t.meta["facts"] == "real" for t in world.tasks("test"))
    assert replay_references(world, facts, "ood_facts").failures == ()

    def real_results(task):
        return [world.functions.execute(call)[0] for call in calls(task)]
    differ = sum(real_results(t) != results(t) for t in facts)
    assert differ >= 0.9 * len(facts)
    assert all(real_results(t) == results(t) for t in world.tasks("test")[:50])


def test_val_and_rl_are_carved_past_the_sft_pool_and_share_no_program(world):
    train, val, rl = world.tasks("train"), world.tasks("val"), world.tasks("rl")
    val_keys = [t.meta["key"] for t in val]
    assert len(val) == world.cfg.n_val and len(set(val_keys)) == len(val_keys)  # distinct programs
    assert not {t.meta["key"] for t in rl} & set(val_keys)
    past = {t.id for t in train[world.cfg.sft_pool:]}
    assert {t.id for t in val} <= past and {t.id for t in rl} <= past  # no task the SFT reads
    assert not {t.id for t in val} & {t.id for t in rl}
    assert len(rl) > 0.5 * (len(train) - world.cfg.sft_pool - len(val))  # most of the rest is RL's
    assert not {t.meta["key"] for t in world.tasks("test")} & {t.meta["key"] for t in val + rl}


def test_a_train_split_too_short_for_val_and_rl_is_a_config_error():
    from toolcollapse.config import ConfigError

    small = ToolWorld(WorldConfig(seed=0, n_train=60, n_test=10, n_ood=10, sft_pool=50, n_val=20))
    with pytest.raises(ConfigError, match="world.n_train"):
        small.tasks("val")
    assert len(small.tasks("train")) == 60  # the other splits are untouched
