"""A step's rollouts in numbers: the four turn states and the named errors as shares of the assistant turns,
success, turns and sampled tokens per rollout (`rollout_stats`, the keys of metrics.jsonl that autopsy.py and
the TRL integration reproduce), and the decoded samples a run keeps."""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Sequence

import torch

from toolcollapse.records import Episode, ErrorType, ParsedTurn, TurnState


TURN_KEYS = [f"state/{s.value}" for s in TurnState] + [f"error/{e.value}" for e in ErrorType]


def count_turns(rollouts: Iterable[Sequence[ParsedTurn]]) -> dict[str, float]:
    """Over rollouts given as their parsed assistant turns: `n_rollouts`, `n_turns`, and the turns in each state
    and with each error (`TURN_KEYS`). Counts, so that trainers on several ranks can sum them first."""
    counts = dict.fromkeys(["n_rollouts", "n_turns", *TURN_KEYS], 0.0)
    for turns in rollouts:
        counts["n_rollouts"] += 1
        for parsed in turns:
            counts["n_turns"] += 1
            counts[f"state/{parsed.state.value}"] += 1
            for error in parsed.errors:
                counts[f"error/{error.value}"] += 1
    return counts


def turn_rates(counts: Mapping[str, float]) -> dict[str, float]:
    """`count_turns`' counts as the rates a run logs: each state's and error's share of the turns,
    `healthy_rate` (a healthy call or response) and `turns_per_episode`."""
    n_turns = max(1.0, counts["n_turns"])
    out = {"healthy_rate": sum(counts[f"state/{s.value}"] for s in TurnState if s.healthy) / n_turns,
           "turns_per_episode": counts["n_turns"] / max(1.0, counts["n_rollouts"])}
    out.update({key: counts[key] / n_turns for key in TURN_KEYS})
    return out


def rollout_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """A step's rollouts: success, the turn rates, sampled tokens a rollout, how they finished."""
    out = {
        "success": sum(ep.success for ep in episodes) / len(episodes),
        **turn_rates(count_turns([t.parsed for t in ep.turns] for ep in episodes)),
        "response_tokens": sum(sum(ep.loss_mask) for ep in episodes) / len(episodes),
    }
    out.update({f"finish/{k}": v / len(episodes) for k, v in Counter(ep.finish for ep in episodes).items()})
    return out


def row_kind_stats(episodes: Sequence[Episode], kinds: Sequence[str]) -> dict[str, float]:
    """`rollout_stats` of the policy's own rows; the success of hinted and expert rows apart."""
    out = rollout_stats([ep for ep, k in zip(episodes, kinds) if k == "policy"])
    for kind in ("hinted", "expert"):
        rows = [ep for ep, k in zip(episodes, kinds) if k == kind]
        if rows:
            out[f"sup/{kind}_success"] = sum(ep.success for ep in rows) / len(rows)
    return out


def sample_records(step: int, episodes: Sequence[Episode], rewards: torch.Tensor, decode, n: int,
                   kinds: Sequence[str] = ()):
    """The first `n` rollouts of the step, and the first group's hinted and expert rows, marked as such."""
    kinds = list(kinds) or ["policy"] * len(episodes)
    group = len(episodes) // max(1, len({ep.task_id for ep in episodes}))
    picked = [i for i in range(len(episodes)) if i < n or (i < group and kinds[i] != "policy")]
    for i in picked:
        ep = episodes[i]
        yield {"step": step, "task_id": ep.task_id, "reward": float(rewards[i]), "finish": ep.finish,
               "states": [s.value for s in ep.states], **({"kind": kinds[i]} if kinds[i] != "policy" else {}),
               "text": decode(ep.tokens[ep.prompt_len:])}
