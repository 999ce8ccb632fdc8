"""Watching the skill, not only the format: content labels and statistics of the probe, validation
during RL, alarms on log-odds and on content, the skill-collapse step."""

import math

import pytest
import torch

from toolcollapse.alarms import Rule, Watcher, content_rules, skill_collapse_step
from toolcollapse.chat import CONTROL_TAGS, PieceEncoder
from toolcollapse.config import MonitorConfig
from toolcollapse.monitor import NO_CONTENT, Content, build_probe, content_labels, resolve_token_ids, run_probe, slots
from toolcollapse.records import Message, ToolCall

CONVERSATION = [
    Message("system", "You can call kb_lookup with an attribute such as capital."),
    Message("user", "Which city governs Zedland?"),
    Message("assistant", "", ToolCall("kb_lookup", {"entity": "Zedland", "attribute": "capital"})),
    Message("tool", '{"result": "Orvo"}'),
    Message("assistant", "", ToolCall("kb_lookup", {"entity": "Orvo", "attribute": "capital"})),
    Message("tool", '{"result": "none"}'),
    Message("assistant", "The answer is Orvo."),
]


def _labelled(tokenizer, messages):
    """(trained token ids, their content labels, the conversation's ids and mask)."""
    encoder = PieceEncoder(tokenizer)
    labels = content_labels(encoder, messages)
    ids, mask = encoder.encode_conversation(messages)
    return [i for i, m in zip(ids, mask) if m], labels, ids, mask


def test_content_labels_of_a_hand_made_conversation(tokenizer):
    trained, labels, ids, mask = _labelled(tokenizer, CONVERSATION)
    special = {tokenizer.convert_tokens_to_ids(t) for t in CONTROL_TAGS}
    assert len(labels) == len(trained) == len(slots(ids, mask, *(tokenizer.convert_tokens_to_ids(t) for t in
                                                                 ("<tool_call>", "</tool_call>", "<|im_end|>"))))
    text = {c: "".join(tokenizer.decode([t]) for t, x in zip(trained, labels) if x == c) for c in Content}
    assert text[Content.TOOL_NAME] == "kb_lookup" * 2
    # copied: in the question (Zedland) or a tool result (Orvo); "capital" is only in the system prompt
    # and in the model's own first call, neither of which counts
    assert text[Content.ARG_COPIED] == "Zedland" + "Orvo"
    assert text[Content.ARG_COMPUTED] == "capital" * 2
    assert text[Content.ANSWER] == "The answer is Orvo."
    structure = "".join(tokenizer.decode([t]) for t, x in zip(trained, labels) if x == NO_CONTENT)
    skeleton = '<tool_call>\n{"name": "", "arguments": {"entity": "", "attribute": ""}}\n</tool_call>'
    assert structure == skeleton * 2 + "<|im_end|>"  # tags, keys and punctuation: the format, not the skill
    assert all(x == NO_CONTENT for t, x in zip(trained, labels) if t in special)


def test_content_statistics_equal_the_probabilities_a_model_gives(tokenizer, monkeypatch):
    """A stand-in model gives the ground truth probability 0.25 at every token of the copied argument
    values and 0.9 everywhere else: the probe reports exactly log 0.25 for arg_copied and log 0.9 for
    the rest; with the truth's logit below the others (p = e^-1 / (e^-1 + V - 1)) its greedy accuracy is 0."""
    import toolcollapse.monitor.probe as monitor  # where run_probe looks its forwards up

    one_call = [*CONVERSATION[:4], Message("assistant", "It is 7.")]
    trained, labels, ids, mask = _labelled(tokenizer, one_call)
    copied_ids = {t for t, x in zip(trained, labels) if x == Content.ARG_COPIED}  # the tokens of "Zedland"
    assert not copied_ids & {t for t, x in zip(trained, labels) if x != Content.ARG_COPIED}  # no shared tokens
    vocab = len(tokenizer)

    def logit_for(p: float) -> float:  # the truth's logit with every other logit 0: p = e^a / (e^a + V - 1)
        return math.log(p * (vocab - 1) / (1 - p))

    def fake_logits(model, *args):  # logits_at or logits_after; the probe is one chunk: all its targets
        select = args[-1]
        targets = probe.targets
        assert len(targets) == int(select.sum())
        logits = torch.zeros(len(targets), vocab)
        for m, t in enumerate(targets.tolist()):
            logits[m, t] = setting(t)
        return logits

    monkeypatch.setattr(monitor, "logits_at", fake_logits)
    monkeypatch.setattr(monitor, "logits_after", fake_logits)
    monkeypatch.setattr(monitor, "PrefixCache", lambda model: lambda ids: None)  # no prefix to run: a stand-in model
    token_ids = resolve_token_ids(tokenizer, CONTROL_TAGS)
    probe = build_probe([(ids, mask)], tokenizer.pad_token_id, token_ids, [labels])
    stand_in = torch.nn.Linear(1, 1)  # run_probe reads the device and the train/eval mode off it

    setting = lambda t: logit_for(0.25) if t in copied_ids else logit_for(0.9)  # noqa: E731
    stats = run_probe(stand_in, probe, resolve_token_ids(tokenizer, ("<tool_call>",)))
    assert stats["probe/content/arg_copied/logp"] == pytest.approx(math.log(0.25), abs=1e-5)
    for name in ("tool_name", "arg_computed", "answer"):
        assert stats[f"probe/content/{name}/logp"] == pytest.approx(math.log(0.9), abs=1e-5)
        assert stats[f"probe/content/{name}/acc"] == 1.0

    setting = lambda t: -1.0 if t in copied_ids else logit_for(0.9)  # noqa: E731
    stats = run_probe(stand_in, probe, resolve_token_ids(tokenizer, ("<tool_call>",)))
    expected = -1.0 - math.log(math.exp(-1.0) + vocab - 1)
    assert stats["probe/content/arg_copied/logp"] == pytest.approx(expected, abs=1e-5)
    assert stats["probe/content/arg_copied/acc"] == 0.0


def test_log_odds_alarm_fires_on_the_early_relative_move_and_not_below_its_floor():
    """The series the issue quotes (lr 1e-3, seed 1: 0.0002 -> 0.0005 -> 0.0045 -> 0.064): on the
    probabilities the alarm waits for the absolute move of 0.04 (step 3); on log-odds it fires at step 2.
    A rise from 1e-6 to 1e-4 (x100) stays below the 1e-3 floor: no alarm."""
    series = [0.0002, 0.0002, 0.0005, 0.0045, 0.064]
    absolute = Rule("s", warmup=1, min_scale=0.005)
    logodds = Rule("s", warmup=1, min_scale=0.25, scale="logodds", floor=1e-3)

    def first(rule, values):
        w = Watcher([rule])
        for step, v in enumerate(values):
            w.update(step, {"s": v})
        return w.alarms[0].step if w.alarms else None

    assert first(absolute, series) == 4 and first(logodds, series) == 3
    assert first(logodds, [1e-6, 1e-6, 1e-5, 1e-4, 1e-4]) is None
    assert first(logodds, [1e-6, 1e-6, 1e-5, 1e-4, 2e-3]) == 4  # it crosses the floor


def _first_alarm(rules, series, values):
    w = Watcher(rules)
    for step, v in enumerate(values):
        w.update(step, {series: v})
    return (w.alarms[0].step, w.alarms[0].rule.direction) if w.alarms else None


def test_content_rules_fire_on_a_falling_log_prob_and_cusum_on_a_slow_drift():
    """A steady fall of 0.02 nats a step: CUSUM (the content default: a fixed reference) sums it up; a
    rolling robust z follows it with its median and never fires. A sudden fall: both fire at once.
    Wobbles of 0.01 nats around the start: neither."""
    key = "probe/content/arg_copied/logp"
    m = MonitorConfig(alarm_warmup=1, content_min_scale=0.01)
    cusum, robust = content_rules(m), content_rules(m, "robust_z")
    assert {r.detector for r in cusum} == {"cusum"} and len(cusum) == 4
    drift = [-0.40 - 0.02 * t for t in range(12)]
    assert _first_alarm(cusum, key, drift) == (4, -1)  # S: 0.5, 3, 7.5, 14 > 10 after 4 steps
    assert _first_alarm(robust, key, drift) is None
    jump = [-0.40, -0.40, -0.41, -0.60, -0.62]
    assert _first_alarm(cusum, key, jump) == (3, -1) and _first_alarm(robust, key, jump) == (3, -1)
    wobble = [-0.40, -0.41, -0.40, -0.39, -0.41, -0.40, -0.41, -0.40]
    assert _first_alarm(cusum, key, wobble) is None and _first_alarm(robust, key, wobble) is None
    assert _first_alarm(cusum, key, [-0.40 + 0.05 * t for t in range(8)]) is None  # a rising log-prob is no alarm


def test_skill_collapse_step():
    rows = [{"step": s, **({"val/success": v} if v is not None else {})}
            for s, v in enumerate([0.40, None, 0.35, None, 0.22, None, 0.20, None, 0.10])]
    assert skill_collapse_step(rows) == 6  # 0.20 <= half of 0.40
    assert skill_collapse_step(rows, fraction=0.6) == 4
    assert skill_collapse_step([{"step": 0}, {"step": 1}]) is None  # no validation
    assert skill_collapse_step([{"step": 0, "val/success": 0.0}]) is None


@pytest.mark.slow
def test_validation_measures_the_policy_without_changing_the_run(tmp_path, tiny_checkpoint):
    """Validation runs greedy episodes between steps: the training metrics are the same with it and
    without it, and its step-0 figures are `toolcollapse eval`'s on the same tasks and limits."""
    from test_rl import TIMING_KEYS, _metrics, _rl_config

    from toolcollapse.config import load_config
    from toolcollapse.evaluate import run_eval
    from toolcollapse.rl import run_rl

    config = _rl_config(tmp_path, tiny_checkpoint)
    runs = {}
    for every in (0, 1):
        cfg = load_config(config, ["grpo.steps=2", f"grpo.eval_every={every}", "grpo.eval_n=3",
                                   "monitor.probe_every=1"])
        runs[every] = _metrics(run_rl(cfg, tmp_path / f"val{every}"))
    val_keys = {"val/success", "val/healthy_rate"}
    assert all(val_keys <= set(r) for r in runs[1]) and not any(val_keys & set(r) for r in runs[0])
    assert [{k: v for k, v in r.items() if k not in val_keys} for r in runs[1]] == runs[0]
    assert {"probe/content/arg_copied/logp", "probe/content/tool_name/acc"} <= set(runs[1][0])
    summary = run_eval(tiny_checkpoint, load_config(config, ["eval.n_tasks=3"]), tmp_path / "eval.jsonl")
    assert runs[1][0]["val/success"] == summary.success_rate
    assert runs[1][0]["val/healthy_rate"] == pytest.approx(
        sum(v for k, v in summary.state_rates.items() if k.startswith("healthy")))
    assert TIMING_KEYS >= {"seconds_val"}
