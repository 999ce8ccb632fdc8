"""The README's shell commands: the tour runs each in order (slow; .ci/run runs it after the test line), and
the quick checks below hold the tour to the README it reads."""

import shlex
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from readme_tour import ROOT, plan, readme_lines, shrunk_configs, tour  # noqa: E402

from toolcollapse.config import load_config  # noqa: E402
from toolcollapse.study import StudyConfig  # noqa: E402
from toolcollapse.sweep import load_sweep  # noqa: E402


def test_readme_lines_are_the_bash_blocks_without_comments():
    text = "x\n```bash\n# a comment\ntoolcollapse sft --config a.yaml   # trailing\n\n```\n```python\nprint(1)\n```\n" \
           "```bash\ntoolcollapse report d --set 'seeds=[0]' --out /tmp/s\n```\n"
    assert readme_lines(text) == ["toolcollapse sft --config a.yaml",
                                  "toolcollapse report d --set 'seeds=[0]' --out /tmp/s"]


def test_plan_runs_commands_and_names_what_it_skips(tmp_path):
    steps = plan("pip install -e . && toolcollapse study configs/study/quick.yaml", tmp_path)
    assert [s.argv for s in steps] == [None, ["toolcollapse", "study", "configs/study/quick.yaml"]]
    assert "install" in steps[0].why
    assert plan("toolcollapse rl --init /path/to/Qwen", tmp_path)[0].argv is None
    assert plan("python -m pytest -q", tmp_path)[0].argv is None
    report = plan("toolcollapse report d --set 'seeds=[0]' --out /tmp/seed0", tmp_path)[0].argv
    assert report[-1] == f"{tmp_path}/tmp/seed0" and report[-2:-1] == ["--out"]  # nothing written outside


def test_the_readme_has_the_commands_the_tour_is_for():
    lines = readme_lines((ROOT / "README.md").read_text())
    run = [s for line in lines for s in plan(line, Path("/scratch")) if s.argv]
    assert run[0].argv == ["toolcollapse", "study", "configs/study/quick.yaml"]  # the first command first
    assert len(run) >= 20
    for step in run:  # every config a command names is in the repository
        for word in step.argv:
            if word.endswith(".yaml"):
                assert (ROOT / word).is_file(), step.line


def test_shrunk_configs_still_validate(tmp_path, monkeypatch):
    """The tour's shrunk copies of configs/ are all valid, each sweep's runs built and small (a tour failure
    then means a command broke, not the shrinking)."""
    shrunk_configs(tmp_path)
    monkeypatch.chdir(tmp_path)
    runs = sweeps = 0
    for path in sorted(Path("configs").rglob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        if "compute_environment" in raw:  # accelerate's
            continue
        if "settings" in raw:
            matched = {Path(s["supervision.sft_only.match"]).parent.name for s in raw["settings"].values()
                       if "supervision.sft_only.match" in s}
            if matched - set(raw["settings"]):  # controls of another sweep's runs: that sweep runs first
                continue
            _, specs = load_sweep(path, cls=StudyConfig, init_ready=False)
            assert {spec.seed for spec in specs} == {raw["seeds"][0]}, path
            assert specs and all(spec.cfg.grpo.steps <= 2 for spec in specs), path
            sweeps += 1
        else:
            cfg = load_config(path)
            assert cfg.sft.steps <= 4 and cfg.grpo.steps <= 2 and cfg.eval.n_tasks <= 4, path
            runs += 1
    assert runs >= 8 and sweeps >= 20


@pytest.mark.slow
def test_every_readme_command_runs_in_order(tmp_path):
    lines = []
    steps = tour(tmp_path, echo=lines.append)
    print("\n".join(lines))
    assert all(s.rc in (None, 0) for s in steps), "\n".join(lines)
    ran = [s for s in steps if s.argv]
    assert len(ran) >= 20 and all(s.rc == 0 for s in ran)
    # what the README says the commands leave
    assert (tmp_path / "runs/study/quick/report/report.md").is_file()
    assert (tmp_path / "runs/study/quick/plain_lr1e-4/seed0/diagnose/summary.json").is_file()
    assert (tmp_path / "runs/smol/sft_term/metrics.jsonl").is_file()
    assert (tmp_path / "tmp/seed0/report.md").is_file()
    assert (tmp_path / "runs/tiny/rl_alarm/metrics.jsonl").is_file()
    assert shlex.split(ran[0].line)[:2] == ["toolcollapse", "study"]
