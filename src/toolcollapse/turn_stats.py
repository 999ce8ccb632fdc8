"""A step's rollouts in numbers: the four turn states and the named errors as shares of the assistant turns,
success, turns and sampled tokens per rollout (`rollout_stats`, the keys of metrics.jsonl that autopsy.py and
the TRL integration reproduce), and the decoded samples a run keeps."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from toolcollapse.records import Episode, ErrorType, TurnState


def rollout_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    turns = [t for ep in episodes for t in ep.turns]
    n_turns = max(1, len(turns))
    states = Counter(t.parsed.state for t in turns)
    errors = Counter(e for t in turns for e in t.parsed.errors)
    out = {
        "success": sum(ep.success for ep in episodes) / len(episodes),
        "healthy_rate": sum(states[s] for s in TurnState if s.healthy) / n_turns,
        "turns_per_episode": len(turns) / len(episodes),
        "response_tokens": sum(sum(ep.loss_mask) for ep in episodes) / len(episodes),
    }
    out.update({f"state/{s.value}": states[s] / n_turns for s in TurnState})
    out.update({f"error/{e.value}": errors[e] / n_turns for e in ErrorType})
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
