"""Parity of the BFCL environment with BFCL itself.

(a) Replay: every entry's ground-truth trajectory (`Task.reference`) goes through the
    parser and the environment (`evaluate.replay_references`); every turn must parse
    healthy, every observation must equal the reference's, every entry must succeed.
(b) Verdicts: perturbed ground-truth trajectories -- a call dropped, two calls of a
    turn swapped, an argument altered, a call duplicated, a call moved to the previous
    turn, a call made in a turn whose ground truth is empty, a turn without calls, a
    call of the private `_load_scenario` inserted -- are judged by our
    environment (stepped turn by turn, then `success`) and by BFCL's own
    `multi_turn_checker` (imported here only; it imports cleanly without stubs). Each
    model call reaches BFCL as its FC decoder writes it (`model_handler/utils.py::
    convert_to_function_call`: `name(k=repr(v),...)`). Agreement is counted on the
    verdict and on BFCL's error type. Seeds are fixed: the same run prints the same figures.

    python bench/bfcl_parity.py                  # every entry, 3 perturbations each
    python bench/bfcl_parity.py --per-entry 1 --entries 20
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from toolcollapse.config import BFCLConfig
from toolcollapse.envs.bfcl import BFCL
from toolcollapse.envs.bfcl.data import CATEGORIES, Entry
from toolcollapse.evaluate import replay_references
from toolcollapse.records import ParsedTurn, Task, ToolCall, TurnState

Trajectory = list[list[ToolCall]]  # the model's calls, per user turn


@dataclass(frozen=True)
class Case:
    task_id: str
    kind: str
    turns: Trajectory


@dataclass(frozen=True)
class Outcome:
    case: Case
    ours: tuple[bool, str]  # (valid, error type)
    bfcl: tuple[bool, str]

    @property
    def agree(self) -> bool:
        return self.ours == self.bfcl


# ---------------------------------------------------------------- trajectories


def reference_calls(task: Task) -> Trajectory:
    """The reference's calls grouped by user turn (a text reply closes a turn)."""
    turns: Trajectory = [[]]
    for msg in task.reference:
        if msg.role == "assistant" and msg.tool_call is not None:
            turns[-1].append(msg.tool_call)
        elif msg.role == "assistant":
            turns.append([])
    return turns[:-1]


def _copy(turns: Trajectory) -> Trajectory:
    return [list(t) for t in turns]


def _pick(rng: random.Random, turns: Trajectory, min_calls: int) -> int | None:
    options = [k for k, t in enumerate(turns) if len(t) >= min_calls]
    return rng.choice(options) if options else None


def drop(turns: Trajectory, rng: random.Random) -> Trajectory | None:
    k = _pick(rng, turns, 1)
    if k is None:
        return None
    out = _copy(turns)
    del out[k][rng.randrange(len(out[k]))]
    return out


def swap(turns: Trajectory, rng: random.Random) -> Trajectory | None:
    k = _pick(rng, turns, 2)
    if k is None:
        return None
    out = _copy(turns)
    j = rng.randrange(len(out[k]) - 1)
    out[k][j], out[k][j + 1] = out[k][j + 1], out[k][j]
    return out if out[k] != turns[k] else None


def alter(turns: Trajectory, rng: random.Random) -> Trajectory | None:
    options = [(k, j) for k, t in enumerate(turns) for j, c in enumerate(t) if c.arguments]
    if not options:
        return None
    k, j = rng.choice(options)
    call = turns[k][j]
    key = rng.choice(sorted(call.arguments))
    out = _copy(turns)
    out[k][j] = ToolCall(call.name, {**call.arguments, key: altered(call.arguments[key])})
    return out


def altered(value: Any) -> Any:
    """A different value of the same JSON type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "_x"
    if isinstance(value, list):
        return value[:-1] if value else ["x"]
    if isinstance(value, dict):
        return {**value, "x": "x"}
    return "x"


def duplicate(turns: Trajectory, rng: random.Random) -> Trajectory | None:
    k = _pick(rng, turns, 1)
    if k is None:
        return None
    out = _copy(turns)
    j = rng.randrange(len(out[k]))
    out[k].insert(j + 1, out[k][j])
    return out


def move_back(turns: Trajectory, rng: random.Random) -> Trajectory | None:
    options = [k for k in range(1, len(turns)) if turns[k]]
    if not options:
        return None
    k = rng.choice(options)
    out = _copy(turns)
    out[k - 1].append(out[k].pop(0))
    return out


def act_when_empty(turns: Trajectory, rng: random.Random) -> Trajectory | None:
    """In a turn whose ground truth is empty, make the next turn's first call already."""
    options = [k for k in range(len(turns) - 1) if not turns[k] and turns[k + 1]]
    if not options:
        return None
    k = rng.choice(options)
    out = _copy(turns)
    out[k].append(out[k + 1][0])
    return out


def skip_turn(turns: Trajectory, rng: random.Random) -> Trajectory | None:
    k = _pick(rng, turns, 1)
    if k is None:
        return None
    out = _copy(turns)
    out[k] = []
    return out


def private_call(turns: Trajectory, rng: random.Random) -> Trajectory | None:
    """Insert a call of a private backend method: neither side may run it (BFCL: NameError)."""
    k = _pick(rng, turns, 1)
    if k is None:
        return None
    out = _copy(turns)
    out[k].insert(rng.randrange(len(out[k]) + 1), ToolCall("_load_scenario", {"scenario": {}}))
    return out


PERTURBATIONS: dict[str, Callable[[Trajectory, random.Random], Trajectory | None]] = {
    "drop": drop, "swap": swap, "alter": alter, "duplicate": duplicate, "move_back": move_back,
    "act_when_empty": act_when_empty, "skip_turn": skip_turn, "private_call": private_call,
}


def make_cases(tasks: list[Task], per_entry: int, seed: int) -> list[Case]:
    """`per_entry` perturbed trajectories per task, kinds taken in turn (skipping kinds that do
    not apply), each with its own seeded generator."""
    cases = []
    kinds = list(PERTURBATIONS)
    for i, task in enumerate(tasks):
        gt = reference_calls(task)
        made = 0
        for attempt in range(len(kinds)):
            kind = kinds[(i * per_entry + attempt) % len(kinds)]
            turns = PERTURBATIONS[kind](gt, random.Random(f"{seed}:{task.id}:{kind}"))
            if turns is not None:
                cases.append(Case(task.id, kind, turns))
                made += 1
            if made == per_entry:
                break
    return cases


# ---------------------------------------------------------------- verdicts


def our_verdict(env: BFCL, task: Task, turns: Trajectory) -> tuple[bool, str]:
    """Step the trajectory through the environment as a model would write it, then `success`."""
    state = env.reset(task)
    for calls in turns:
        for call in calls:
            env.step(state, ParsedTurn(TurnState.HEALTHY_CALL, (), call, "", "call"))
        env.step(state, ParsedTurn(TurnState.HEALTHY_RESPONSE, (), None, "Done.", "answer"))
    valid = env.success(state)
    return valid, "" if valid else state.extra["bfcl"].verdict.error_type


def bfcl_call_string(call: ToolCall) -> str:
    """BFCL's `convert_to_function_call` for one decoded FC call."""
    return f"{call.name}({','.join(f'{k}={v!r}' for k, v in call.arguments.items())})"


def bfcl_verdict(entry: Entry, turns: Trajectory, tag: str) -> tuple[bool, str]:
    """BFCL's `multi_turn_checker` on the same trajectory (one call per step)."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    decoded = [[[bfcl_call_string(c)] for c in calls] for calls in turns]
    test_entry = {"id": entry.id, "initial_config": entry.initial_config, "involved_classes": list(entry.classes)}
    try:
        result = multi_turn_checker(decoded, [list(t) for t in entry.ground_truth], test_entry,
                                    f"multi_turn_{entry.category}", tag)
    finally:  # BFCL keeps instances in its module globals, keyed by model name and entry
        for key in [k for k in vars(multi_turn_utils) if k.startswith(tag + "_")]:
            del vars(multi_turn_utils)[key]
    return result["valid"], "" if result["valid"] else result["error_type"]


def judge(env: BFCL, tasks: dict[str, Task], cases: list[Case]) -> list[Outcome]:
    outcomes = []
    for i, case in enumerate(cases):
        entry = env.entry(tasks[case.task_id])
        outcomes.append(Outcome(case, our_verdict(env, tasks[case.task_id], case.turns),
                                bfcl_verdict(entry, case.turns, f"parity{i}")))
    return outcomes


# ---------------------------------------------------------------- report


def all_tasks(env: BFCL) -> list[Task]:
    return env.tasks("train") + env.tasks("test")


def entry_index(task: Task) -> int:
    return int(task.id.rsplit("_", 1)[1])


def replay_report(categories: tuple[str, ...]) -> list[str]:
    lines = []
    for category in categories:
        env = BFCL(BFCLConfig(categories=(category,), n_train=100, n_test=100))
        tasks = all_tasks(env)
        r = replay_references(env, tasks, "train+test")
        lines.append(f"  {category:<13} {round(r.success_rate * r.n_tasks):>3}/{r.n_tasks} succeed, "
                     f"{r.healthy_rate:.2%} of {r.n_turns} turns healthy, failures: {list(r.failures) or 'none'}")
    return lines


def verdict_report(outcomes: list[Outcome]) -> list[str]:
    agree = sum(o.agree for o in outcomes)
    passed = Counter(o.bfcl[0] for o in outcomes)
    lines = [(f"  agreement {agree}/{len(outcomes)} (verdict and error type); "
              f"BFCL judged {passed[True]} pass, {passed[False]} fail")]
    by_kind = Counter((o.case.kind, o.bfcl[0]) for o in outcomes)
    for kind in PERTURBATIONS:
        lines.append(f"    {kind:<15} pass {by_kind[(kind, True)]:>4}  fail {by_kind[(kind, False)]:>4}")
    errors = Counter(o.bfcl[1] for o in outcomes if not o.bfcl[0])
    lines += [f"    {e}: {n}" for e, n in sorted(errors.items())]
    lines += [f"  DISAGREE {o.case.task_id} {o.case.kind}: ours {o.ours} bfcl {o.bfcl}" for o in outcomes
              if not o.agree]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--categories", nargs="+", default=list(CATEGORIES))
    ap.add_argument("--per-entry", type=int, default=3, help="perturbed trajectories per entry")
    ap.add_argument("--entries", type=int, default=None, help="entries per category (default: all 200)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.time()
    print("(a) ground-truth replay through the environment")
    print("\n".join(replay_report(tuple(args.categories))))
    env = BFCL(BFCLConfig(categories=tuple(args.categories), n_train=100, n_test=100))
    tasks = [t for c in args.categories for t in sorted(
        (u for u in all_tasks(env) if u.meta["category"] == c), key=entry_index)[:args.entries]]
    cases = make_cases(tasks, args.per_entry, args.seed)
    outcomes = judge(env, {t.id: t for t in tasks}, cases)
    print(f"(b) {len(cases)} perturbed trajectories over {len(tasks)} entries ({', '.join(args.categories)})")
    print("\n".join(verdict_report(outcomes)))
    print(f"({time.time() - t0:.0f}s)")
    return 0 if all(o.agree for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
