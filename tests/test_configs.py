"""Every config file the repository ships loads and validates (a typo in one is an error here, not at the end
of someone's run); a study file whose controls match runs of another study says so."""

from pathlib import Path

import pytest

from toolcollapse.config import ConfigError, load_config
from toolcollapse.study import StudyConfig
from toolcollapse.sweep import load_sweep

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.relative_to(ROOT) for p in (ROOT / "configs").rglob("*.yaml")
                 if "trl" not in p.parts)  # trl/: accelerate's files
NEEDS_OTHER_RUNS = {Path("configs/study/supervision_sft_only.yaml")}  # controls of configs/study/supervision.yaml


@pytest.fixture(autouse=True)
def no_local_runs(tmp_path, monkeypatch):
    """The files alone, whatever runs this checkout holds: from a directory with the repository's configs and no
    runs/ (a finished study's selection.json or checkpoints there would change what a config loads to)."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("path", CONFIGS, ids=str)
def test_config_file_loads(path):
    if "study" not in path.parts:
        load_config(path)
    elif path in NEEDS_OTHER_RUNS:
        with pytest.raises(ConfigError, match="is not a finished run"):
            load_sweep(path, cls=StudyConfig, init_ready=False)
    else:
        load_sweep(path, cls=StudyConfig, init_ready=False)


def test_the_paper_regime_study_holds_the_scan():
    """configs/study/paper.yaml reuses the scan's runs: the same out_dir, and every setting of the scan with the
    same config."""
    _, scan = load_sweep("configs/study/paper_scan.yaml", cls=StudyConfig, init_ready=False)
    full, specs = load_sweep("configs/study/paper.yaml", cls=StudyConfig, init_ready=False)
    by_dir = {s.run_dir: s.cfg for s in specs}
    shared = [s for s in scan if s.run_dir in by_dir]
    assert shared and all(by_dir[s.run_dir] == s.cfg for s in shared)
