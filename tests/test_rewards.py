"""Rewards: binary by default; partial credit for the ground-truth calls a failed episode made in order."""

import pytest

from toolcollapse.records import Episode, Message, ParsedTurn, Task, ToolCall, TurnRecord, TurnState
from toolcollapse.rewards import calls_in_order, episode_reward, rewards_tensor

A = ToolCall("kb_lookup", {"entity": "Varkstan", "attribute": "capital"})
B = ToolCall("kb_lookup", {"entity": "Orlo", "attribute": "elevation_m"})
C = ToolCall("convert_units", {"value": 1200, "from_unit": "m", "to_unit": "ft"})
TASK = Task("t", "train", (Message("user", "q"),), (Message("assistant", tool_call=A), Message("tool", "Orlo"),
                                                   Message("assistant", tool_call=B), Message("tool", "1200"),
                                                   Message("assistant", tool_call=C), Message("tool", "3937"),
                                                   Message("assistant", "The answer is 3937.")), "3937")


def _episode(calls, success=False, healthy=True):
    state = TurnState.HEALTHY_CALL if healthy else TurnState.TEXT_POLLUTION
    turns = [TurnRecord(0, 1, ParsedTurn(state, (), call, "", "call")) for call in calls]
    return Episode("t", [0], [1], [0.0], 0, turns, success=success)


@pytest.mark.parametrize("calls, share", [([A, B, C], 1.0), ([A, B], 2 / 3), ([A, C, B], 1 / 3), ([B, A], 0.0),
                                          ([], 0.0), ([A, ToolCall("kb_lookup", {"entity": "Orlo"})], 1 / 3)])
def test_calls_in_order(calls, share):
    assert calls_in_order(_episode(calls), TASK) == pytest.approx(share)


def test_an_unhealthy_turn_earns_no_credit_for_its_call_nor_for_the_calls_after_it():
    assert calls_in_order(_episode([A, B], healthy=False), TASK) == 0.0
    broken = _episode([A, B, C])
    broken.turns[1] = TurnRecord(0, 1, ParsedTurn(TurnState.TEXT_POLLUTION, (), B, "", "call"))
    assert calls_in_order(broken, TASK) == pytest.approx(1 / 3)


def test_partial_credit_only_for_failures_and_binary_by_default():
    failed, solved = _episode([A, B]), _episode([A, B, C], success=True)
    assert episode_reward(failed) == 0.0 and episode_reward(solved) == 1.0  # the paper's binary reward
    assert episode_reward(failed, partial_credit=0.5, task=TASK) == pytest.approx(0.5 * 2 / 3)
    assert episode_reward(solved, partial_credit=0.5, task=TASK) == 1.0
    assert rewards_tensor([failed, solved], partial_credit=0.5, tasks={"t": TASK}).tolist() == pytest.approx([1 / 3, 1])
