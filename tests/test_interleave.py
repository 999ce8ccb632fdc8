"""SFT phases inside RL: ETS's data rule, PRS's judge and examples, the adaptive schedule, sft_only."""

import copy
import dataclasses
import json
import shutil

import pytest
import torch

from toolcollapse.chat import PieceEncoder, generation_prompt
from toolcollapse.config import PhaseConfig, load_config
from toolcollapse.evaluate import SamplingParams
from toolcollapse.interleave import (Failure, PhaseRunner, collect_failures, correction_example, judged,
                                     latest_per_task, reflection_example, sft_phase, trained_tokens)
from toolcollapse.judge import ChatJudge, Verdict, deterministic_judge, load_judge
from toolcollapse.records import (Episode, ErrorType, Message, ParsedTurn, Task, ToolCall, TurnRecord, TurnState)
from toolcollapse.rollout import RolloutEngine

LOOKUP = "kb_lookup"
TASK = Task("t1", "train", (Message("system", "tools ..."), Message("user", 'Which is heavier, "Aba" or "Bob"?')),
            (Message("assistant", tool_call=ToolCall(LOOKUP, {"entity": "Aba", "attribute": "weight_kg"})),
             Message("tool", '{"result": 85.6}'),
             Message("assistant", tool_call=ToolCall(LOOKUP, {"entity": "Bob", "attribute": "weight_kg"})),
             Message("tool", '{"result": 63.8}'),
             Message("assistant", tool_call=ToolCall("aggregate", {"values": [85.6, 63.8], "function": "argmax"})),
             Message("tool", '{"result": 0}'),
             Message("assistant", "The answer is Aba.")),
            "Aba")


def _call(name, **arguments):
    return ParsedTurn(TurnState.HEALTHY_CALL, (), ToolCall(name, arguments), "", "call")


def _episode(*turns, finish="answered"):
    records = [TurnRecord(0, 0, p, obs) for p, obs in turns]
    return Episode("t1", [], [], [], 0, turns=records, finish=finish)


GOOD_1 = (_call(LOOKUP, entity="Aba", attribute="weight_kg"), '{"result": 85.6}')


@pytest.mark.parametrize("turns, finish, want", [
    ([GOOD_1, (_call(LOOKUP, entity="Bobb", attribute="weight_kg"), "{}")], "answered",
     (1, "miscopied_argument", ("Turn 2: argument 'entity' of kb_lookup was miscopied: Bobb instead of Bob, which "
                                "the context states. The correct turn 2 is:\n<tool_call>\n"
                                '{"name": "kb_lookup", "arguments": {"entity": "Bob", "attribute": "weight_kg"}}\n'
                                "</tool_call>"))),
    ([(ParsedTurn(TurnState.TEXT_POLLUTION, (ErrorType.INVALID_JSON,), None, "", "call", "line 1 column 9"), None)],
     "malformed", (0, "malformed", ("Turn 1: the turn is malformed (invalid_json: line 1 column 9). The correct "
                                    "turn 1 is:\n<tool_call>\n"
                                    '{"name": "kb_lookup", "arguments": {"entity": "Aba", "attribute": "weight_kg"}}\n'
                                    "</tool_call>"))),
    ([GOOD_1, (ParsedTurn(TurnState.HEALTHY_RESPONSE, (), None, "The answer is Aba.", "answer"), None)], "answered",
     (1, "stopped_early", None)),
    ([GOOD_1, (_call("aggregate", values=[1], function="max"), None)], "answered", (1, "wrong_tool", None)),
    ([GOOD_1, (_call(LOOKUP, entity="Bob", attribute="weight_kg"), '{"result": 63.8}'),
      (_call("aggregate", values=[85.6, 63.8], function="argmin"), None)], "answered",
     (2, "wrong_argument", None)),  # "argmin" is nowhere in the context: computed, not copied
    ([GOOD_1], "max_turns", (1, "stopped_early", None)),
    ([GOOD_1, (_call(LOOKUP, entity="Bob", attribute="weight_kg"), '{"result": 63.8}'),
      (_call("aggregate", values=[85.6, 63.8], function="argmax"), '{"result": 0}'),
      (ParsedTurn(TurnState.HEALTHY_RESPONSE, (), None, "The answer is Bob.", "answer"), None)], "answered",
     (3, "wrong_answer", None)),
])
def test_the_deterministic_judge_names_the_first_mistake(turns, finish, want):
    verdict = deterministic_judge(TASK, _episode(*turns, finish=finish))
    turn, mistake, text = want
    assert (verdict.turn, verdict.mistake) == (turn, mistake)
    if text is not None:
        assert verdict.reflection == text
    assert verdict.reflection.startswith(f"Turn {turn + 1}: ")


def test_a_rollout_that_matches_the_reference_has_no_turn_level_mistake():
    turns = [(_call(m.tool_call.name, **m.tool_call.arguments), None) if m.tool_call else
             (ParsedTurn(TurnState.HEALTHY_RESPONSE, (), None, m.content, "answer"), None)
             for m in TASK.reference if m.role == "assistant"]
    assert deterministic_judge(TASK, _episode(*turns)).turn is None


def test_a_task_judged_on_state_has_no_wrong_answer():
    """BFCL's tasks have no answer text (success is the tools' state): a closing reply other than the
    reference's is not a mistake, so the judge looks on for one in the calls."""
    state_task = dataclasses.replace(TASK, answer="")
    turns = [GOOD_1, (_call(LOOKUP, entity="Bob", attribute="weight_kg"), None),
             (_call("aggregate", values=[85.6, 63.8], function="argmax"), None),
             (ParsedTurn(TurnState.HEALTHY_RESPONSE, (), None, "Done.", "answer"), None)]
    assert deterministic_judge(state_task, _episode(*turns)).turn is None
    assert deterministic_judge(TASK, _episode(*turns)).mistake == "wrong_answer"


def test_an_adaptive_rollback_needs_two_checkpoints_kept():
    from toolcollapse.config import rl_problems

    problems = rl_problems(load_config(None, ["supervision.adaptive.enabled=true", "grpo.keep_checkpoints=1"]))
    assert problems and "keep_checkpoints >= 2" in problems[0]
    assert not rl_problems(load_config(None, ["supervision.adaptive.enabled=true",
                                              "supervision.adaptive.rollback=false", "grpo.keep_checkpoints=1"]))


def test_a_chat_judge_writes_the_reflection_and_the_deterministic_one_locates_it():
    seen = []
    judge = ChatJudge(lambda messages: seen.append(messages) or "The entity was misspelt.")
    episode = _episode(GOOD_1, (_call(LOOKUP, entity="Bobb", attribute="weight_kg"), None))
    verdict = judge(TASK, episode, lambda ids: "<attempt>")
    assert verdict == Verdict(1, "miscopied_argument", "The entity was misspelt.")
    assert "<attempt>" in seen[0][1]["content"] and '"entity": "Bob"' in seen[0][1]["content"]
    assert load_judge("deterministic") is deterministic_judge
    with pytest.raises(ValueError, match="module:factory"):
        load_judge("not a spec")


# ----------------------------------------------------------------------------- ETS's rule


def test_ets_collects_the_tasks_with_a_failed_on_policy_rollout_in_the_window():
    """collect_failures: a task once per step, from its on-policy rows only (a failed expert row or a
    solved row does not count); the window: only failures of the round's last W steps, newest per task."""
    def ep(task_id, success):
        return Episode(task_id, [], [], [], 0, success=success)

    episodes = [ep("a", True), ep("a", False), ep("a", False), ep("b", True), ep("b", True), ep("c", False),
                ep("d", True), ep("d", False)]
    kinds = ["policy", "policy", "policy", "policy", "policy", "expert", "policy", "policy"]
    failed = collect_failures(5, episodes, kinds, {}, None, str)
    assert [(f.step, f.task_id) for f in failed] == [(5, "a"), (5, "d")]

    log = [Failure(step, task) for step, task in [(0, "x"), (1, "y"), (2, "z"), (2, "x"), (3, "w"), (3, "z")]]
    cfg = load_config(None, ["supervision.ets.enabled=true", "supervision.ets.every=4", "supervision.ets.window=2"])
    runner = PhaseRunner(None, None, None, {}, cfg, log)
    assert [(f.task_id, f.step) for f in runner.ets_failures(3)] == [("z", 3), ("x", 2), ("w", 3)]
    assert [runner.ets_round_ends(s) for s in range(8)] == [False, False, False, True] * 2
    assert [f.task_id for f in latest_per_task(log)] == ["x", "y", "z", "w"]


# ----------------------------------------------------------------------------- PRS's examples


@pytest.fixture
def miscopied(tokenizer, world):
    """A real episode: the ground truth of a two-lookup task replayed through the environment with its
    second lookup's entity miscopied; and the task."""
    task = next(t for t in world.tasks("train") if [m.tool_call.name for m in t.reference if m.tool_call][:2]
                == [LOOKUP, LOOKUP])
    second = [i for i, m in enumerate(task.reference) if m.role == "assistant"][1]
    call = task.reference[second].tool_call
    wrong = dataclasses.replace(call, arguments={**call.arguments, "entity": call.arguments["entity"] + "x"})
    reference = list(task.reference[:second]) + [Message("assistant", tool_call=wrong)]
    engine = RolloutEngine(torch.nn.Linear(1, 1), tokenizer, world)  # replay runs no model
    episode = engine.replay([dataclasses.replace(task, reference=tuple(reference))],
                            SamplingParams(max_turns=2, max_new_tokens=96))[0]
    return task, episode, engine


def test_the_correction_example_trains_the_reference_from_the_mistaken_turn_only(tokenizer, miscopied):
    task, episode, engine = miscopied
    failure = judged(Failure(0, task.id), task, episode, deterministic_judge, engine.decode)
    assert (failure.turn, failure.mistake) == (1, "miscopied_argument")
    encoder = PieceEncoder(tokenizer)
    ids, mask = correction_example(encoder, task, failure)
    assert ids[:len(episode.tokens)] == episode.tokens  # the failed prefix as sampled ...
    assert not any(mask[:len(episode.tokens)])  # ... and not trained
    text = tokenizer.decode(ids)
    assert "Review of your attempt: Turn 2: argument 'entity'" in text
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    rest = [m for m in task.reference[[i for i, m in enumerate(task.reference) if m.role == "assistant"][1]:]]
    want_ids, want_mask = encoder.encode_conversation(rest)
    assert trained == tokenizer.decode([i for i, m in zip(want_ids, want_mask) if m])
    assert trained.startswith("<tool_call>") and json.dumps(task.reference[2].tool_call.arguments["entity"]) in trained


def test_a_correction_mid_episode_keeps_the_observation_the_policy_saw(tokenizer, world):
    """The miscopied turn is not the last: the prefix runs on through the environment's reply to the wrong
    call, exactly as sampled (template end, tool message), and stops before the next turn's prompt."""
    task = next(t for t in world.tasks("train") if [m.tool_call.name for m in t.reference if m.tool_call][:2]
                == [LOOKUP, LOOKUP])
    second = [i for i, m in enumerate(task.reference) if m.role == "assistant"][1]
    call = task.reference[second].tool_call
    wrong = dataclasses.replace(call, arguments={**call.arguments, "entity": call.arguments["entity"] + "x"})
    reference = list(task.reference)
    reference[second] = Message("assistant", tool_call=wrong)
    engine = RolloutEngine(torch.nn.Linear(1, 1), tokenizer, world)
    episode = engine.replay([dataclasses.replace(task, reference=tuple(reference))],
                            SamplingParams(max_turns=8, max_new_tokens=96))[0]
    assert len(episode.turns) > 2
    encoder = PieceEncoder(tokenizer)
    failure = judged(Failure(0, task.id), task, episode, deterministic_judge, engine.decode,
                     len(encoder.encode(generation_prompt())[0]))
    assert failure.turn == 1 and failure.closed
    reply = tokenizer.decode(failure.prefix[episode.turns[1].end:])
    assert reply.startswith("<|im_end|>") and episode.turns[1].observation in reply and reply.endswith("<|im_end|>\n")
    ids, mask = correction_example(encoder, task, failure)
    assert ids[:len(failure.prefix)] == failure.prefix and not any(mask[:len(failure.prefix)])
    assert tokenizer.decode(ids[len(failure.prefix):]).startswith("<|im_start|>user\nReview of your attempt: Turn 2")


def test_the_reflection_example_trains_the_reflection_only(tokenizer, miscopied):
    task, episode, engine = miscopied
    failure = judged(Failure(0, task.id), task, episode, deterministic_judge, engine.decode)
    ids, mask = reflection_example(PieceEncoder(tokenizer), failure)
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert trained == failure.reflection + "<|im_end|>"
    assert "Reference turns:" in tokenizer.decode(ids)


def test_an_sft_phase_trains_every_example_each_epoch_and_counts_its_tokens(tiny_model, tokenizer, world):
    model = copy.deepcopy(tiny_model)
    encoder = PieceEncoder(tokenizer)
    examples = [encoder.encode_conversation([*t.prompt[-1:], *t.reference]) for t in world.tasks("train")[:3]]
    before = [p.detach().clone() for p in model.parameters()]
    stats = sft_phase(model, examples, PhaseConfig(epochs=3, lr=1e-3, batch_size=2), 1, tokenizer.pad_token_id, 0)
    assert stats["phase/tokens"] == 3 * trained_tokens(examples)
    assert stats["phase/steps"] == 3 * 2  # batches of 2, 1 per epoch
    assert stats["phase/loss_last"] < stats["phase/loss_first"]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ----------------------------------------------------------------------------- in a run


QUIET = ["grpo.eval_every=0", "monitor.probe_every=0"]  # no validation, no probe: faster, and beside the point


def _metrics(run):
    from test_rl import _metrics as metrics

    return metrics(run)


@pytest.mark.slow
def test_ets_and_prs_rounds_in_a_run_collect_train_and_resume(tmp_path, tiny_checkpoint):
    """The untrained model fails every task: each round's phase trains on exactly the tasks of its last
    window (here the round's last step), with one correction example each; its tokens add to the run's
    SFT total; a run resumed mid-round rebuilds the same phase from failures.jsonl."""
    from test_rl import _rl_config

    from toolcollapse.rl import run_rl, task_order, tasks_for_step

    from toolcollapse.rundir import resume_config
    from toolcollapse.runtime import read_jsonl

    config = _rl_config(tmp_path, tiny_checkpoint)
    cfg = load_config(config, ["grpo.steps=4", "grpo.checkpoint_every=1", "grpo.keep_checkpoints=5", *QUIET,
                               "supervision.ets.enabled=true", "supervision.ets.every=2", "supervision.ets.window=1",
                               "supervision.prs.enabled=true", "supervision.prs.target=correction",
                               "supervision.phase.batch_size=2", "supervision.phase.epochs=1"])
    run = run_rl(cfg, tmp_path / "ets")
    phases = read_jsonl(run / "phases.jsonl")
    assert [p["step"] for p in phases] == [1, 3]
    failures = read_jsonl(run / "failures.jsonl")
    order = task_order(__import__("toolcollapse.envs", fromlist=["make_env"]).make_env(cfg).tasks("train"), cfg.seed)
    for p in phases:  # the window is the round's last step: its prompts, all failed
        assert {f["task_id"] for f in failures if f["step"] == p["step"]} == {t.id for t in tasks_for_step(
            order, p["step"], cfg.grpo.prompts_per_step)}
        assert p["phase/tasks"] == p["phase/prs_examples"] == cfg.grpo.prompts_per_step
    rows = _metrics(run)
    assert [r.get("ets/tokens", 0) for r in rows] == [0, phases[0]["phase/tokens"], 0, phases[1]["phase/tokens"]]
    assert rows[-1]["sup/sft_tokens_total"] == phases[0]["phase/tokens"] + phases[1]["phase/tokens"]
    for name in ("step_000004", "step_000003"):
        shutil.rmtree(run / "checkpoints" / name)
    run_rl(resume_config(run), run, resume=True)  # from step_000002: step 2, then step 3 and its phase again
    assert _metrics(run) == rows
    untimed = lambda rows: [{k: v for k, v in r.items() if k != "phase/seconds"} for r in rows]  # noqa: E731
    assert untimed(read_jsonl(run / "phases.jsonl")) == untimed(phases)

    only = run_rl(load_config(config, ["grpo.steps=4", *QUIET, f"supervision.sft_only.match={run}"]),
                  tmp_path / "sft_only")
    spent = read_jsonl(only / "phases.jsonl")[0]
    assert spent["target_tokens"] == rows[-1]["sup/sft_tokens_total"]
    assert spent["target_tokens"] <= spent["phase/tokens"] < spent["target_tokens"] + 2 * 1000  # one task over
    assert (only / "checkpoints" / "step_000004" / "COMPLETE").is_file()


@pytest.mark.slow
def test_the_adaptive_schedule_rolls_back_to_the_checkpoint_before_an_injected_alarm(tmp_path, answering_checkpoint,
                                                                                     monkeypatch):
    """An alarm injected at step 3 (raised by the weights after 3 updates, step_000003): the weights come
    back from step_000002, the newest checkpoint before them -- step_000003 and step_000000 differ from
    it, so a rollback to either would fail the test --, step_000003 is deleted, the LR halves from then
    on, and each action is logged."""
    from safetensors.torch import load_file
    from test_rl import _rl_config

    from toolcollapse import rl
    from toolcollapse.alarms import Alarm, Rule
    from toolcollapse.monitor import Monitor
    from toolcollapse.rundir import resume_config
    from toolcollapse.runtime import read_jsonl

    observe = Monitor.observe

    def inject(self, step, metrics):
        return observe(self, step, metrics) + ([Alarm(step, Rule("probe/injected"), 1.0)] if step == 3 else [])

    monkeypatch.setattr(Monitor, "observe", inject)
    alarming = {}  # step_000003's weights, read before the rollback deletes it (it is off the path from then on)
    rollback = rl._rollback

    def keep_alarming(run_dir, step, model, optimizer):
        alarming.update(load_file(run_dir / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))
        return rollback(run_dir, step, model, optimizer)

    monkeypatch.setattr(rl, "_rollback", keep_alarming)
    config = _rl_config(tmp_path, answering_checkpoint, format_reward=1.0, group_size=4, schedule="constant")
    base = ["grpo.steps=5", "grpo.checkpoint_every=1", "grpo.keep_checkpoints=6", "supervision.adaptive.enabled=true",
            "grpo.weight_decay=0.1", *QUIET]  # decay: every update moves the weights, informative groups or not
    run = rl.run_rl(load_config(config, base + ["supervision.adaptive.sft=false"]), tmp_path / "rollback")
    rows = _metrics(run)
    assert {k: rows[3][k] for k in rows[3] if k.startswith("adaptive/")} == {
        "adaptive/recovery": 1, "adaptive/rollback_to": 2, "adaptive/lr_scale": 0.5}
    assert rows[4]["lr"] == pytest.approx(0.5 * rows[2]["lr"])
    ckpt = run / "checkpoints"
    restored, target = (load_file(ckpt / s / "model.safetensors") for s in ("step_000004", "step_000002"))
    assert all(torch.equal(restored[k], target[k]) for k in target)  # the step-3 update is undone
    first = load_file(ckpt / "step_000000" / "model.safetensors")
    for other in (first, alarming):
        assert any(not torch.equal(other[k], target[k]) for k in target)
    assert not (ckpt / "step_000003").exists()  # the alarming weights: never a later rollback's target
    events = [a for a in read_jsonl(run / "alarms.jsonl") if a.get("event") == "recovery"]
    assert events == [{"step": 3, "event": "recovery", "adaptive/recovery": 1, "adaptive/rollback_to": 2,
                       "adaptive/lr_scale": 0.5}]
    # resumed after the recovery, the run keeps its LR cut (Adaptive.start takes it up from the steps taken)
    shutil.rmtree(ckpt / "step_000005")
    rl.run_rl(resume_config(run), run, resume=True)
    assert _metrics(run)[4]["lr"] == pytest.approx(0.5 * rows[2]["lr"])

    run = rl.run_rl(load_config(config, base + ["grpo.steps=4"]), tmp_path / "with_sft")
    rows = _metrics(run)
    assert rows[3]["adaptive/tokens"] > 0 and rows[3]["adaptive/tasks"] >= 1
    assert rows[3]["sup/sft_tokens_total"] == rows[3]["adaptive/tokens"]
    assert read_jsonl(run / "phases.jsonl")[0]["phase"] == "adaptive"
