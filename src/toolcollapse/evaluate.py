"""Evaluation: the real multi-turn loop on a split, per-task results and a summary.

Success is the environment's verdict (tool world: the final answer equals the
oracle's). Turn states and error types are counted over every assistant turn of
every episode, exactly as the parser labels them.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from toolcollapse.chat import assistant_body
from toolcollapse.config import ConfigError, RunConfig, checkpoint_problems
from toolcollapse.envs import make_env
from toolcollapse.envs.base import Environment
from toolcollapse.model import load_model, load_tokenizer, place, resolve_device
from toolcollapse.parser import describe, parse_turn
from toolcollapse.records import CallEnd, Episode, ErrorType, Task, TurnState
from toolcollapse.rollout import RolloutEngine, SamplingParams
from toolcollapse.runtime import set_threads, write_jsonl


@dataclass(frozen=True)
class EvalSummary:
    split: str
    n_episodes: int
    success_rate: float
    success_ci95: tuple[float, float]  # Wilson interval
    n_turns: int
    state_rates: dict[str, float]  # share of assistant turns in each of the four states
    healthy_rate: float
    error_counts: dict[str, int]  # turns showing each error type
    finish_counts: dict[str, int]
    success_by_template: dict[str, float]
    mean_turns: float
    seconds: float = 0.0
    limits: dict[str, Any] | None = None  # the rollout limits it ran under (rollout_limits): compare like with like

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 0.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def summarize(episodes: Sequence[Episode], tasks: dict[str, Task], split: str, seconds: float = 0.0,
              limits: dict[str, Any] | None = None) -> EvalSummary:
    turns = [t for ep in episodes for t in ep.turns]
    states = Counter(t.parsed.state for t in turns)
    errors = Counter(e for t in turns for e in t.parsed.errors)
    n_turns = max(1, len(turns))
    by_template: dict[str, list[bool]] = defaultdict(list)
    for ep in episodes:
        by_template[tasks[ep.task_id].meta.get("template", "all")].append(ep.success)
    wins = sum(ep.success for ep in episodes)
    return EvalSummary(
        split=split, n_episodes=len(episodes), success_rate=wins / max(1, len(episodes)),
        success_ci95=wilson(wins, len(episodes)), n_turns=len(turns),
        state_rates={s.value: states[s] / n_turns for s in TurnState},
        healthy_rate=sum(states[s] for s in TurnState if s.healthy) / n_turns,
        error_counts={e.value: errors[e] for e in ErrorType if errors[e]},
        finish_counts=dict(Counter(ep.finish for ep in episodes)),
        success_by_template={k: sum(v) / len(v) for k, v in sorted(by_template.items())},
        mean_turns=len(turns) / max(1, len(episodes)), seconds=seconds, limits=limits,
    )


def episode_record(ep: Episode, task: Task, decode) -> dict[str, Any]:
    return {
        "task_id": ep.task_id, "template": task.meta.get("template"), "n_calls": task.meta.get("n_calls"),
        "question": task.prompt[-1].content, "answer": task.answer, "final_text": ep.final_text,
        "success": ep.success, "finish": ep.finish, "n_tokens": len(ep.tokens),
        "turns": [dict(describe(t.parsed), text=decode(ep.tokens[t.start:t.end]), observation=t.observation)
                  for t in ep.turns],
    }


def format_summary(s: EvalSummary) -> str:
    lo, hi = s.success_ci95
    lines = [
        f"split {s.split}: {s.n_episodes} episodes, {s.n_turns} assistant turns ({s.seconds:.0f}s)",
        f"  success        {s.success_rate:7.1%}   (95% CI {lo:.1%} - {hi:.1%})",
        f"  healthy turns  {s.healthy_rate:7.1%}",
    ]
    lines += [f"    {state:<17}{rate:7.1%}" for state, rate in s.state_rates.items()]
    if s.error_counts:
        lines.append("  error types (turns): " + ", ".join(f"{k} {v}" for k, v in
                                                         sorted(s.error_counts.items(), key=lambda kv: -kv[1])))
    lines.append("  finish: " + ", ".join(f"{k} {v}" for k, v in sorted(s.finish_counts.items())))
    lines.append("  success by template: " + ", ".join(f"{k} {v:.0%}" for k, v in s.success_by_template.items()))
    return "\n".join(lines)


@dataclass(frozen=True)
class ReplayResult:
    split: str
    n_tasks: int
    success_rate: float
    healthy_rate: float
    n_turns: int
    failures: tuple[str, ...]  # ids of tasks whose replay was unhealthy or unsuccessful


def replay_references(env: Environment, tasks: Sequence[Task], split: str,
                      call_end: CallEnd = "template") -> ReplayResult:
    """Feed each task's ground-truth assistant turns through the parser and the environment,
    as a policy that writes exactly the reference would be: every turn should parse healthy,
    the observations after each turn should equal the reference's messages up to its next
    assistant turn (a tool reply after a call; nothing after the final answer; the next
    user message after a multi-turn task's intermediate answer), every episode should succeed."""
    healthy = turns = wins = 0
    failures = []
    for task in tasks:
        state = env.reset(task)
        ok = True
        for i, msg in enumerate(task.reference):
            if msg.role != "assistant":
                continue
            parsed = parse_turn("".join(p.text for p in assistant_body(msg, call_end)), state.tools, call_end)
            turns += 1
            healthy += parsed.state.healthy
            observations = env.step(state, parsed)
            expected = list(itertools.takewhile(lambda m: m.role != "assistant", task.reference[i + 1:]))
            ok &= parsed.state.healthy and observations == expected
        success = env.success(state)
        wins += success
        if not (ok and success):
            failures.append(task.id)
    return ReplayResult(split, len(tasks), wins / max(1, len(tasks)), healthy / max(1, turns), turns,
                        tuple(failures))


def sampling_params(cfg: RunConfig, greedy: bool) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(max_turns=r.max_turns, max_new_tokens=r.max_new_tokens,
                          max_seq_len=cfg.model.max_seq_len, temperature=r.temperature, top_p=r.top_p,
                          greedy=greedy, batch_size=r.batch_size)


def rollout_limits(cfg: RunConfig, greedy: bool, samples: int = 1) -> dict[str, Any]:
    """What an evaluation's figures depend on besides the model and the tasks."""
    p = sampling_params(cfg, greedy)
    limits = {"max_turns": p.max_turns, "max_new_tokens": p.max_new_tokens, "max_seq_len": p.max_seq_len,
              "greedy": greedy, "call_end": cfg.rollout.call_end}
    if not greedy:
        limits.update(temperature=p.temperature, top_p=p.top_p, seed=cfg.seed)
        if samples > 1:
            limits["samples"] = samples
    if cfg.model.dtype != "float32":  # bfloat16 forwards can decode other tokens
        limits["dtype"] = cfg.model.dtype
    return limits


def run_eval(checkpoint: str | Path, cfg: RunConfig, out_path: str | Path | None = None) -> EvalSummary:
    checkpoint = Path(checkpoint)
    problems = checkpoint_problems(cfg, checkpoint)
    if problems:
        raise ConfigError(problems[0])
    device = resolve_device(cfg.device)
    set_threads(cfg.threads)
    model = place(load_model(checkpoint), device, cfg.model.dtype)
    tokenizer = load_tokenizer(checkpoint)
    env = make_env(cfg)
    tasks = env.tasks(cfg.eval.split, cfg.eval.n_tasks)
    engine = RolloutEngine.from_config(model, tokenizer, env, cfg.rollout)
    t0 = time.time()
    k = 1 if cfg.eval.greedy else cfg.eval.samples
    episodes = engine.generate(tasks, sampling_params(cfg, cfg.eval.greedy), group_size=k, seed=cfg.seed,
                               show_progress=True)
    by_id = {t.id: t for t in tasks}
    summary = summarize(episodes, by_id, cfg.eval.split, time.time() - t0, rollout_limits(cfg, cfg.eval.greedy, k))
    if out_path is None:
        tag = "" if cfg.eval.greedy else "-sampled"
        out_path = checkpoint / "eval" / f"{cfg.eval.split}{tag}.jsonl"
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_path, (dict(episode_record(ep, by_id[ep.task_id], engine.decode), **({"sample": i % k} if k > 1 else {}))
                           for i, ep in enumerate(episodes)))
    out_path.with_suffix(".summary.json").write_text(json.dumps(summary.to_json(), indent=2))
    return summary
