"""Tries: each arm's main coefficient chosen on a validation split, the same number of tries for every arm.

A setting of a study file may list `tries`, alternatives to it (`toolcollapse study` chooses among them; a
sweep refuses them), and its own `seeds` (a sweep's too):

    settings:
      sft_term:
        grpo.lr: 1.0e-4
        supervision.sft_coef: 0.5
        seeds: [0, 1, 2]
        tries: [{supervision.sft_coef: 0.1}]

The setting as written is the first try (its run directories `<out_dir>/sft_term/seed<s>`, so adding tries to a
setting keeps the runs it has); each alternative is a setting of its own, `sft_term.t1`, ... Every try runs at
the setting's first seed; once all have run and been evaluated on `select_split` (greedy), the one with the
highest success there is the setting's arm -- ties go to the earlier try, the setting as written first -- and
only its other seeds run. The choice is written to `<out_dir>/selection.json` with every try's figure, so the
report can list them, and re-running the sweep reads it instead of choosing again. Test figures never enter the
choice.

A control names the setting it matches instead of a path: `supervision.sft_only.match: "@sft_term"` is the
chosen try's run of the same seed; it trains with that run's `supervision.phase.*` keys (its phase LR, say)
unless it sets them itself. Until the choice is made the control waits (it is validated, not run).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from toolcollapse.config import ConfigError

SELECTION_FILE = "selection.json"
MATCH_KEY = "supervision.sft_only.match"


@dataclass(frozen=True)
class Setting:
    """One setting of the grid after expansion: a try of `base` (try_index set), or a setting without tries."""

    name: str  # the run directories' name: `base` (a setting without tries, or its first try) or `base.t<i>`
    base: str  # the setting's name in the file
    try_index: int | None
    sets: dict[str, Any]  # dotted keys -> values (the setting's, then the try's)
    seeds: tuple[int, ...]
    varied: dict[str, Any] | None = None  # a try's own dotted keys


def expand(settings: dict[str, Any], default_seeds: Sequence[int]) -> list[Setting]:
    """The file's settings with `seeds` and `tries` read out, each try a setting of its own."""
    out = []
    for name, sets in settings.items():
        if not isinstance(sets, dict):
            raise ConfigError(f"settings.{name}: expected a mapping of dotted keys to values")
        sets = dict(sets)
        seeds = tuple(sets.pop("seeds", default_seeds))
        if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
            raise ConfigError(f"settings.{name}.seeds: expected a non-empty list of seeds (integers >= 0), got "
                              f"{list(seeds)!r}")
        tries = sets.pop("tries", None)
        if tries is None:
            out.append(Setting(name, name, None, sets, seeds))
            continue
        if not isinstance(tries, list) or not tries or not all(isinstance(t, dict) and t for t in tries):
            raise ConfigError(f"settings.{name}.tries: expected a list of mappings of dotted keys (the alternatives "
                              f"to the setting as written), got {tries!r}")
        if "." in name:
            raise ConfigError(f"settings.{name}: a setting with tries may not have a dot in its name")
        out.append(Setting(name, name, 0, sets, seeds, {}))  # the setting as written is the first try
        out += [Setting(f"{name}.t{i}", name, i, {**sets, **t}, seeds, dict(t)) for i, t in enumerate(tries, 1)]
    return out


def base_name(setting: str) -> str:
    """The file's setting a run directory's setting belongs to (`sft_term.t1` -> `sft_term`)."""
    return re.sub(r"\.t\d+$", "", setting)


def read_selection(out_dir: str | Path) -> dict[str, dict[str, Any]]:
    """{setting: its record} of the choices made so far (empty before any)."""
    path = Path(out_dir) / SELECTION_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err}); delete it to choose again from the tries' evaluations")


def chosen(selection: dict[str, dict[str, Any]], base: str) -> int | None:
    record = selection.get(base)
    return None if record is None else int(record["chosen"])


def run_seeds(setting: Setting, selection: dict[str, dict[str, Any]]) -> tuple[int, ...]:
    """The seeds a setting runs now: all of them, or a try's first only until it is the chosen one."""
    if setting.try_index is None or chosen(selection, setting.base) == setting.try_index:
        return setting.seeds
    return setting.seeds[:1]


def match_target(sets: dict[str, Any], settings: list[Setting], selection: dict[str, dict[str, Any]],
                 out_dir: str) -> tuple[str | None, bool, dict[str, Any]]:
    """(the `match` path a control's config gets, whether its target is decided, the SFT-phase keys it takes from
    the target's chosen try): "@name" resolved to the chosen try's run directory (`{seed}` kept), a path left
    as it is. A control trains as its target's phases did: a try's `supervision.phase.*` keys (its phase LR,
    say) carry over, unless the control sets them itself."""
    match = sets.get(MATCH_KEY)
    if not (isinstance(match, str) and match.startswith("@")):
        return match, True, {}
    target = match[1:]
    bases = {s.base: s for s in settings}
    if target not in bases:
        raise ConfigError(f"{MATCH_KEY}: {match!r} names no setting (settings: {', '.join(bases)})")
    k = chosen(selection, target)
    tried = next(s for s in settings if s.base == target and s.try_index in (None, k or 0))
    phase = {key: v for key, v in tried.sets.items() if key.startswith("supervision.phase.")}
    return str(Path(out_dir) / tried.name / "seed{seed}"), tried.try_index is None or k is not None, phase


def check_selection(settings: list[Setting], selection: dict[str, dict[str, Any]], out_dir: str) -> None:
    """The choices recorded match the file's tries now (same settings, same alternatives, in order): a choice
    made among other tries is a ConfigError, not a silent wrong arm."""
    for base, record in selection.items():
        tries = [{"setting": s.name, "overrides": s.varied} for s in settings if s.base == base]
        recorded = [{"setting": t.get("setting"), "overrides": t.get("overrides")} for t in record.get("tries", [])]
        if tries != recorded or not 0 <= int(record.get("chosen", -1)) < len(tries):
            raise ConfigError(f"{Path(out_dir) / SELECTION_FILE}: the tries of {base!r} were chosen among "
                              f"{[t['overrides'] for t in recorded]}, but the file now lists "
                              f"{[t['overrides'] for t in tries] or 'none'}; delete the record of {base!r} there to "
                              "choose again (its runs stay)")


def pending(settings: list[Setting], selection: dict[str, dict[str, Any]]) -> list[str]:
    """The settings whose try is not chosen yet."""
    return sorted({s.base for s in settings if s.try_index is not None and s.base not in selection})


def choose(settings: list[Setting], out_dir: str, split: str, figure: Any) -> dict[str, dict[str, Any]]:
    """Choose every pending setting's try whose first-seed runs are all evaluated: `figure(setting name, seed,
    split)` is the greedy success of that run on `split` (None: not evaluated). Writes and returns the
    selection."""
    selection = read_selection(out_dir)
    for base in pending(settings, selection):
        tries = [s for s in settings if s.base == base]
        scores = [figure(s.name, s.seeds[0], split) for s in tries]
        if any(v is None for v in scores):
            continue
        best = max(range(len(tries)), key=lambda i: (scores[i], -i))
        selection[base] = {"chosen": best, "split": split, "seed": tries[0].seeds[0],
                           "tries": [{"setting": s.name, "overrides": s.varied,
                                      "success": v} for s, v in zip(tries, scores)]}
    path = Path(out_dir) / SELECTION_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(selection, indent=1) + "\n")
    return selection
