"""Tries (tries.py): each arm's coefficient chosen on validation, the same number of tries for every arm."""

import json

import pytest
import yaml

from toolcollapse.config import ConfigError
from toolcollapse.sweep import load_sweep, undecided_try
from toolcollapse.tries import choose, expand, read_selection


def _sweep(tmp_path, settings, seeds=(0, 1, 2)):
    init = tmp_path / "sft"
    init.mkdir(exist_ok=True)
    (init / "config.json").write_text("{}")
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": "configs/tiny_rl.yaml", "init": str(init), "out_dir": str(tmp_path / "out"),
                                    "seeds": list(seeds), "settings": settings, "eval_n": 10,
                                    "overrides": {"grpo.split": "rl"}}))
    return path


SETTINGS = {"plain": {"grpo.lr": 1e-4, "seeds": [0]},
            "ets": {"grpo.lr": 1e-4, "supervision.ets.enabled": True, "supervision.phase.lr": 3e-4,
                    "tries": [{"supervision.phase.lr": 1e-3}]},
            "sft_only_ets": {"grpo.lr": 1e-4, "supervision.sft_only.match": "@ets"}}


def _runs(specs):
    return sorted((s.setting, s.seed) for s in specs)


def test_before_the_choice_every_try_runs_its_first_seed_and_the_control_waits(tmp_path):
    sweep, specs = load_sweep(_sweep(tmp_path, SETTINGS))
    assert _runs(specs) == [("ets", 0), ("ets.t1", 0), ("plain", 0)]
    assert {s.setting for s in specs if undecided_try(sweep, s)} == {"ets", "ets.t1"}  # scored on val only
    assert [s.cfg.supervision.phase.lr for s in specs if s.setting.startswith("ets")] == [3e-4, 1e-3]


def test_after_the_choice_the_chosen_try_runs_every_seed_and_the_control_matches_it(tmp_path):
    path = _sweep(tmp_path, SETTINGS)
    sweep, _ = load_sweep(path)
    scores = {"ets": 0.20, "ets.t1": 0.25}
    selection = choose(expand(sweep.settings, sweep.seeds), sweep.out_dir, "val",
                       lambda name, seed, split: scores[name])
    assert selection["ets"]["chosen"] == 1 and read_selection(sweep.out_dir) == selection
    assert [t["overrides"] for t in selection["ets"]["tries"]] == [{}, {"supervision.phase.lr": 1e-3}]
    _, specs = load_sweep(path)
    assert _runs(specs) == [("ets", 0), ("ets.t1", 0), ("ets.t1", 1), ("ets.t1", 2), ("plain", 0),
                            ("sft_only_ets", 0), ("sft_only_ets", 1), ("sft_only_ets", 2)]
    control = [s for s in specs if s.setting == "sft_only_ets"]
    assert control[1].cfg.supervision.sft_only.match == str(tmp_path / "out" / "ets.t1" / "seed{seed}")
    assert {c.cfg.supervision.phase.lr for c in control} == {1e-3}  # the chosen try's phase LR carries over
    # the try not chosen keeps its validation score only; the chosen one and settings without tries get every
    # evaluation (the full study once evaluated every try on test, ood and sampled once the choice was made)
    assert {s.setting for s in specs if undecided_try(sweep, s)} == {"ets"}


def test_ties_go_to_the_earlier_try_and_an_unevaluated_try_waits(tmp_path):
    sweep, _ = load_sweep(_sweep(tmp_path, SETTINGS))
    settings = expand(sweep.settings, sweep.seeds)
    assert choose(settings, sweep.out_dir, "val", lambda name, seed, split: None) == {}
    assert choose(settings, sweep.out_dir, "val", lambda name, seed, split: 0.2)["ets"]["chosen"] == 0


@pytest.mark.parametrize("settings, message", [
    ({"a": {"tries": []}}, "alternatives"),
    ({"a": {"tries": {"grpo.lr": 1e-4}}}, "alternatives"),
    ({"a": {"seeds": []}}, "non-empty list"),
    ({"a": {"seeds": [-1]}}, "non-empty list"),
    ({"a": {"tries": [{"grpo.lr": 1e-4}, {"grpo.nope": 1}]}}, "unknown key grpo.nope"),
    ({"a.b": {"tries": [{"grpo.lr": 1e-4}]}}, "dot in its name"),
    ({"c": {"supervision.sft_only.match": "@missing"}}, "names no setting"),
])
def test_bad_tries_are_config_errors_before_any_work(tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(_sweep(tmp_path, settings))


def test_a_corrupt_selection_file_says_how_to_recover(tmp_path):
    path = _sweep(tmp_path, SETTINGS)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "selection.json").write_text("{not json")
    with pytest.raises(ConfigError, match="delete it"):
        load_sweep(path)


def test_the_selection_survives_as_json(tmp_path):
    sweep, _ = load_sweep(_sweep(tmp_path, SETTINGS))
    choose(expand(sweep.settings, sweep.seeds), sweep.out_dir, "val", lambda name, seed, split: 0.1)
    assert json.loads((tmp_path / "out" / "selection.json").read_text())["ets"]["split"] == "val"


def test_the_setting_as_written_is_the_first_try_and_its_phase_keys_carry_over(tmp_path):
    path = _sweep(tmp_path, SETTINGS)
    sweep, _ = load_sweep(path)
    choose(expand(sweep.settings, sweep.seeds), sweep.out_dir, "val", lambda name, seed, split: 0.3)
    _, specs = load_sweep(path)
    assert ("ets", 2) in _runs(specs) and ("ets.t1", 1) not in _runs(specs)
    control = next(s for s in specs if s.setting == "sft_only_ets")
    assert control.cfg.supervision.phase.lr == 3e-4
    assert control.cfg.supervision.sft_only.match == str(tmp_path / "out" / "ets" / "seed{seed}")


@pytest.mark.parametrize("change, message", [
    ({"overrides": {}}, "grpo.split 'train' holds the val tasks"),
    ({"select_split": "test"}, "choose them on val"),
    ({"eval_n": 0}, "set eval_n"),
])
def test_tries_that_cannot_be_chosen_fairly_are_refused(tmp_path, change, message):
    path = _sweep(tmp_path, SETTINGS)
    raw = yaml.safe_load(path.read_text())
    raw.update(change)
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=message):
        load_sweep(path)


def test_a_choice_made_among_other_tries_is_refused(tmp_path):
    path = _sweep(tmp_path, SETTINGS)
    sweep, _ = load_sweep(path)
    choose(expand(sweep.settings, sweep.seeds), sweep.out_dir, "val", lambda name, seed, split: 0.3)
    raw = yaml.safe_load(path.read_text())
    raw["settings"]["ets"]["tries"] = [{"supervision.phase.lr": 3e-3}]
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="delete the record of 'ets'"):
        load_sweep(path)


def test_a_control_of_a_setting_without_tries_takes_its_phase_keys(tmp_path):
    settings = {"ets": {"supervision.ets.enabled": True, "supervision.phase.lr": 1e-3},
                "sft_only_ets": {"supervision.sft_only.match": "@ets"}}
    sweep, specs = load_sweep(_sweep(tmp_path, settings, seeds=(0,)))
    control = next(s for s in specs if s.setting == "sft_only_ets")
    assert control.cfg.supervision.phase.lr == 1e-3
    assert control.cfg.supervision.sft_only.match == str(tmp_path / "out" / "ets" / "seed{seed}")
