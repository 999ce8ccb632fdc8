import math

import pytest
import torch

from toolcollapse.chat import CONTROL_TAGS, IM_END, TOOL_CALL, TOOL_CALL_END, PieceEncoder
from toolcollapse.monitor import Slot, build_probe, control_token_stats, resolve_token_ids, run_probe, slots
from toolcollapse.encoding import encode_tasks

TC, TCE, END = 1, 2, 3  # token ids of <tool_call>, </tool_call>, <|im_end|> in the hand-built sequences


def test_slots_of_a_call_turn_then_an_answer_turn():
    #      prompt   <tc> { x } </tc> tmpl tmpl  a  b  <end>
    ids = [9, 9, 9, TC, 5, 6, 7, TCE, END, 9, 4, 5, END]
    mask = [0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1]
    assert slots(ids, mask, TC, TCE, END) == [
        Slot.CALL_OPEN, Slot.CALL_BODY, Slot.CALL_BODY, Slot.CALL_BODY, Slot.CALL_CLOSE,
        Slot.ANSWER_START, Slot.ANSWER_BODY, Slot.ANSWER_END]


def test_slots_of_real_oracle_conversations(world, tokenizer):
    tasks = world.tasks("train")[:20]
    ids = resolve_token_ids(tokenizer, CONTROL_TAGS)
    for task, (x, m) in zip(tasks, encode_tasks(PieceEncoder(tokenizer), tasks)):
        s = slots(x, m, ids[TOOL_CALL], ids[TOOL_CALL_END], ids[IM_END])
        assert len(s) == sum(m)
        n_calls = sum(msg.tool_call is not None for msg in task.reference)
        assert s.count(Slot.CALL_OPEN) == s.count(Slot.CALL_CLOSE) == n_calls
        assert s.count(Slot.ANSWER_START) == s.count(Slot.ANSWER_END) == 1
        assert s[-1] == Slot.ANSWER_END


def _logp(rows: list[dict[int, float]], vocab: int = 6) -> torch.Tensor:
    """Log-probs [M, V]: the given probabilities, the rest of the mass spread over token 0."""
    p = torch.zeros(len(rows), vocab)
    for i, row in enumerate(rows):
        for tok, prob in row.items():
            p[i, tok] = prob
        p[i, 0] += 1.0 - p[i].sum()
    return p.log()


def test_known_probability_at_a_forbidden_position_is_reported_exactly():
    slot_of = torch.tensor([Slot.CALL_OPEN, Slot.CALL_BODY, Slot.CALL_BODY, Slot.ANSWER_END])
    logp = _logp([{TC: 0.9}, {END: 0.3}, {END: 0.1}, {END: 0.8}])
    stats = control_token_stats(logp, slot_of, {IM_END: END, TOOL_CALL: TC})
    assert stats["probe/im_end/p_forbidden_max"] == pytest.approx(0.3, abs=1e-6)
    assert stats["probe/im_end/p_forbidden_mean"] == pytest.approx((0.0 + 0.3 + 0.1) / 3, abs=1e-6)  # call_open too
    assert stats["probe/im_end/p@call_body"] == pytest.approx(0.2, abs=1e-6)
    assert stats["probe/im_end/miss_required"] == pytest.approx(0.2, abs=1e-6)
    assert stats["probe/tool_call/miss_required"] == pytest.approx(0.1, abs=1e-6)
    assert stats["probe/tool_call/p_forbidden_max"] == pytest.approx(0.0, abs=1e-6)
    assert "probe/tool_call/p@answer_start" not in stats  # no such position: no series, not NaN
    assert all(math.isfinite(v) for v in stats.values())


def test_tool_call_where_the_answer_belongs_is_its_own_series_not_forbidden():
    slot_of = torch.tensor([Slot.ANSWER_START, Slot.ANSWER_BODY])
    stats = control_token_stats(_logp([{TC: 0.7}, {TC: 0.05}]), slot_of, {TOOL_CALL: TC})
    assert stats["probe/tool_call/p@answer_start"] == pytest.approx(0.7, abs=1e-6)
    assert stats["probe/tool_call/p_forbidden_max"] == pytest.approx(0.05, abs=1e-6)


def test_probe_on_a_real_model(world, tokenizer, tiny_model):
    examples = encode_tasks(PieceEncoder(tokenizer), world.tasks("train")[:4])
    probe = build_probe(examples, tokenizer.pad_token_id, resolve_token_ids(tokenizer, CONTROL_TAGS))
    assert probe.slot_of.numel() == int(probe.select.sum()) == sum(sum(m) for _, m in examples)
    stats = run_probe(tiny_model, probe, resolve_token_ids(tokenizer, [TOOL_CALL, IM_END]))
    assert 0.0 <= stats["probe/tool_call/miss_required"] <= 1.0
    assert 0.0 <= stats["probe/im_end/p_forbidden_p99"] <= stats["probe/im_end/p_forbidden_max"] <= 1.0


def test_the_probe_measures_the_sampling_distribution(world, tokenizer, tiny_model):
    """At temperature T the probe reads softmax(logits / T), the distribution rollouts sample from."""
    from toolcollapse.model import logits_at

    examples = encode_tasks(PieceEncoder(tokenizer), world.tasks("train")[:2])
    probe = build_probe(examples, tokenizer.pad_token_id, resolve_token_ids(tokenizer, CONTROL_TAGS))
    ids = resolve_token_ids(tokenizer, [IM_END])
    with torch.no_grad():
        logits = logits_at(tiny_model, probe.input_ids, probe.select, probe.prefix_len).float()
    for t in (0.5, 1.0):
        expected = control_token_stats(torch.log_softmax(logits / t, dim=-1), probe.slot_of, ids)
        got = run_probe(tiny_model, probe, ids, temperature=t)
        assert got.keys() == expected.keys()
        assert all(got[k] == pytest.approx(expected[k], abs=1e-6) for k in got)
    assert run_probe(tiny_model, probe, ids, 0.5) != run_probe(tiny_model, probe, ids, 1.0)


def test_the_probe_prefix_run_once_equals_a_plain_forward_of_every_row(world, tokenizer, tiny_model):
    """run_probe runs the shared system prompt once and every chunk attends to that one copy: over
    two chunks its statistics -- control tokens and content slots -- equal those of a plain forward of
    each whole row, nothing shared, and a full log_softmax. Queries and keys are scaled up: a fresh
    model's attention is near uniform, blind to positions."""
    import copy

    from toolcollapse.model import logits_at
    from toolcollapse.monitor import PROBE_CHUNK, content_labels, content_stats

    model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8.0)

    tasks = world.tasks("train")[:PROBE_CHUNK + 3]
    encoder = PieceEncoder(tokenizer)
    content = [content_labels(encoder, [*t.prompt, *t.reference]) for t in tasks]
    probe = build_probe(encode_tasks(encoder, tasks), tokenizer.pad_token_id, resolve_token_ids(tokenizer, CONTROL_TAGS),
                        content)
    assert probe.prefix_len > 100  # the system prompt
    ids = resolve_token_ids(tokenizer, [TOOL_CALL, IM_END])
    with torch.no_grad():
        logp = torch.log_softmax(logits_at(model, probe.input_ids, probe.select).float(), dim=-1)
    truth, greedy = logp.gather(1, probe.targets[:, None]).squeeze(1), logp.argmax(dim=-1) == probe.targets
    expected = {**control_token_stats(logp, probe.slot_of, ids), **content_stats(truth, greedy, probe.content_of)}
    got = run_probe(model, probe, ids)
    assert got.keys() == expected.keys()
    assert {"probe/content/tool_name/logp", "probe/content/arg_copied/acc", "probe/content/answer/logp"} <= got.keys()
    assert all(got[k] == pytest.approx(expected[k], abs=1e-5) for k in got)


def test_a_trained_call_end_has_its_own_slot_and_series(world, tokenizer):
    """rollout.call_end: sampled trains the <|im_end|> after </tool_call>: slot call_turn_end,
    series probe/im_end/miss_after_call; with the template default there is no such position."""
    ids = resolve_token_ids(tokenizer, CONTROL_TAGS)
    task = world.tasks("train")[0]
    n_calls = sum(m.tool_call is not None for m in task.reference)
    for call_end, expected in (("template", 0), ("sampled", n_calls)):
        [example] = encode_tasks(PieceEncoder(tokenizer, call_end), [task])
        probe = build_probe([example], tokenizer.pad_token_id, ids)
        assert int((probe.slot_of == Slot.CALL_TURN_END).sum()) == expected
    logp = _logp([{END: 0.9}, {END: 0.4}])
    stats = control_token_stats(logp, torch.tensor([Slot.CALL_TURN_END, Slot.CALL_TURN_END]), {IM_END: END})
    assert stats["probe/im_end/miss_after_call"] == pytest.approx(1 - 0.65, abs=1e-6)


def test_unknown_control_token_is_named(tokenizer):
    with pytest.raises(ValueError, match="<not_a_tag>"):
        resolve_token_ids(tokenizer, ["<not_a_tag>"])


# ----------------------------------------------------------------------------- detectors

def test_sampled_control_stats_hand_computed():
    from toolcollapse.monitor import sampled_control_stats

    targets = torch.tensor([TC, 7, 8, TC, END])
    old = torch.tensor([0.5, 0.9, 0.8, 0.25, 0.6]).log()
    new = old + torch.tensor([math.log(2.0), 0.0, 0.0, 0.0, math.log(0.5)])  # ratios 2, 1, 1, 1, 0.5
    entropy = torch.tensor([1.0, 0.1, 0.3, 2.0, 3.0])
    s = sampled_control_stats(targets, new, old, entropy, {TOOL_CALL: TC, IM_END: END, TOOL_CALL_END: TCE})
    assert s["ctrl/tool_call/p_sampled_mean"] == pytest.approx(0.375) and s["ctrl/tool_call/p_sampled_max"] == 0.5
    assert s["ctrl/tool_call/n_sampled"] == 2 and s["ctrl/im_end/p_sampled_max"] == pytest.approx(0.6)
    assert "ctrl/tool_call_end/p_sampled_mean" not in s  # never sampled: no series
    assert s["ctrl/ratio_mean_ctrl"] == pytest.approx((2 + 1 + 0.5) / 3)
    assert s["ctrl/ratio_max_ctrl"] == pytest.approx(2.0) and s["ctrl/ratio_max_other"] == pytest.approx(1.0)
    assert s["ctrl/entropy_mean_ctrl"] == pytest.approx(2.0) and s["ctrl/entropy_mean_other"] == pytest.approx(0.2)


def test_the_forward_accumulators_reduce_alike_in_one_process_and_over_ranks():
    """`SampledTokens` and `TurnCounts`, which our update and TRL's trainer feed: the statistics of tokens
    added over several micro-batches are those of the whole batch at once, and with `gather` (TRL's ranks;
    here two ranks holding the same rows) the means and maxima are the same and the counts double."""
    from toolcollapse.monitor import SampledTokens, TurnCounts, sampled_control_stats
    from toolcollapse.parser import parse_turn
    from toolcollapse.turn_stats import count_turns, turn_rates

    torch.manual_seed(0)
    ids = {TOOL_CALL: 3, IM_END: 5}
    twice = lambda rows: torch.cat([rows, rows])  # noqa: E731
    one, ranks = SampledTokens(ids), SampledTokens(ids, gather=twice)
    parts = [(torch.randint(0, 8, (20,)), -torch.rand(20), -torch.rand(20), torch.rand(20)) for _ in range(3)]
    for part in parts:
        one.add(*part)
        ranks.add(*part)
    whole = sampled_control_stats(*(torch.cat(c) for c in zip(*parts)), ids)
    a, b = one.reduce(), ranks.reduce()
    assert a == whole and a.keys() == b.keys() and "ctrl/tool_call/p_sampled_max" in a
    for key, value in a.items():
        assert b[key] == pytest.approx(2 * value if key.endswith("n_sampled") else value, rel=1e-6), key
    assert one.reduce() == {} and ranks.reduce() == {}  # a reduce starts the next window empty

    rollouts = [[parse_turn('<tool_call>{"name": "f", "arguments": {}}</tool_call>'), parse_turn("the answer<|im_end|>")],
                [parse_turn("<tool_call>{oops</tool_call>")]]
    other = [[parse_turn("plain text, no end")]]  # a second rank's rollout: one more turn, unhealthy
    theirs = TurnCounts()
    theirs.add(other)
    alone, over_ranks = TurnCounts(), TurnCounts(gather=lambda rows: torch.cat([rows, theirs.counts[None]]))
    alone.add(rollouts)
    over_ranks.add(rollouts)
    assert alone.reduce() == turn_rates(count_turns(rollouts))
    assert alone.reduce() == {}  # (emptied)
    assert over_ranks.reduce() == turn_rates(count_turns(rollouts + other))
    assert turn_rates(count_turns(rollouts + other))["healthy_rate"] == pytest.approx(2 / 4)
