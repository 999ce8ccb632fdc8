"""The CLI refuses bad input before writing anything: exit status 2, a message naming the problem,
no traceback, files untouched. Each case runs `python -m toolcollapse` in a subprocess."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from toolcollapse.config import GRPOConfig, RunConfig, WorldConfig, dump_config


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolcollapse", *args], capture_output=True, text=True,
                          timeout=300)


def refused(proc: subprocess.CompletedProcess, *names: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for name in names:
        assert name in proc.stderr, proc.stderr


def tree(path: Path) -> dict[str, str]:
    """Every file under `path` with a hash of its bytes: equal trees mean nothing was touched."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command, override", [
    ("sft", "sft.steps=-5"),
    ("rl", "grpo.steps=-3"),
    ("rl", "grpo.lr=nan"),
    ("rl", "grpo.lr=inf"),
    ("sft", "sft.lr=-1"),
    ("rl", "grpo.group_size=0"),
    ("rl", "rollout.temperature=0"),
    ("rl", "rollout.top_p=0.9"),  # RL's log-probs are the untruncated policy's
    ("sft", "sft.betas=[0.9, 1.5]"),
    ("rl", "monitor.collapse_hold=0"),
])
def test_out_of_range_values_exit_2_naming_the_key_and_write_nothing(tmp_path, tiny_checkpoint, command, override):
    out = tmp_path / "out"
    config = "configs/tiny.yaml" if command == "sft" else "configs/tiny_rl.yaml"
    extra = ["--init", str(tiny_checkpoint)] if command == "rl" else []
    refused(cli(command, "--config", config, *extra, "--set", override, "--out", str(out)), override.split("=")[0])
    assert not out.exists()


def _fake_rl_run(path: Path) -> Path:
    (path / "checkpoints" / "step_000050").mkdir(parents=True)
    (path / "checkpoints" / "step_000050" / "COMPLETE").write_text("50")
    (path / "config.yaml").write_text("grpo: {lr: 0.001}\n")
    (path / "metrics.jsonl").write_text('{"step": 0}\n')
    return path


@pytest.mark.slow
def test_rl_refuses_a_directory_that_holds_another_run(tmp_path, tiny_checkpoint):
    run = _fake_rl_run(tmp_path / "run")
    before = tree(run)
    refused(cli("rl", "--config", "configs/tiny_rl.yaml", "--init", str(tiny_checkpoint), "--out", str(run)),
            str(run), "--resume", "--overwrite")
    assert tree(run) == before


def test_sft_refuses_a_directory_that_holds_another_run(tmp_path, tiny_checkpoint):
    run = tmp_path / "sft"
    run.mkdir()
    for f in tiny_checkpoint.iterdir():
        (run / f.name).write_bytes(f.read_bytes())
    dump_config(RunConfig(), run / "toolcollapse.yaml")
    before = tree(run)
    refused(cli("sft", "--config", "configs/tiny.yaml", "--out", str(run)), str(run), "already holds a run",
            "--overwrite")
    assert tree(run) == before


def test_overwrite_never_deletes_a_directory_that_holds_no_run(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    refused(cli("sft", "--config", "configs/tiny.yaml", "--out", str(tmp_path), "--overwrite"), "holds no sft run")
    assert tree(tmp_path) == before


def _corrupt(checkpoint: Path, tmp_path: Path, how: str) -> Path:
    bad = tmp_path / how
    bad.mkdir()
    for f in checkpoint.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    if how == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif how == "bad_header":
        weights.write_bytes(b"\xff" * 8 + data[8:])
    else:  # NaN weights
        tensors = load_file(weights)
        name = sorted(tensors)[0]
        tensors[name][0, 0] = float("nan")
        save_file(tensors, weights, metadata={"format": "pt"})
    return bad


@pytest.mark.parametrize("how, names", [
    ("truncated", ["model.safetensors", "incomplete metadata"]),
    ("bad_header", ["model.safetensors", "header"]),
    ("nan_weights", ["non-finite", "unusable"]),
])
@pytest.mark.slow
def test_a_corrupt_checkpoint_is_named_with_its_fault(tmp_path, tiny_checkpoint, how, names):
    bad = _corrupt(tiny_checkpoint, tmp_path, how)
    before = tree(bad)
    refused(cli("eval", str(bad), "--n", "2"), str(bad), *names)
    assert tree(bad) == before  # no eval/ written into it
    if how == "nan_weights":
        out = tmp_path / "rl"
        refused(cli("rl", "--config", "configs/tiny_rl.yaml", "--init", str(bad), "--out", str(out)), *names)
        assert not out.exists()


@pytest.mark.slow
def test_a_corrupt_optimizer_state_stops_resume_with_its_file_named(tmp_path, tiny_checkpoint):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    for f in tiny_checkpoint.iterdir():
        (step / f.name).write_bytes(f.read_bytes())
    cfg = RunConfig(init=str(tiny_checkpoint), world=WorldConfig(n_train=40, n_test=4, n_ood=4),
                    grpo=GRPOConfig(steps=4, prompts_per_step=2, group_size=2))
    dump_config(cfg, run / "config.yaml")
    dump_config(cfg, step / "toolcollapse.yaml")
    torch.save({"step": 2}, step / "trainer.pt")  # no optimizer state in it
    (step / "trainer.pt").write_bytes((step / "trainer.pt").read_bytes()[:20])  # and cut short
    (step / "COMPLETE").write_text("2")
    before = tree(run)
    refused(cli("rl", "--resume", str(run)), "trainer.pt")
    assert tree(run) == before


def test_python_dash_m_toolcollapse_is_the_command():
    proc = subprocess.run([sys.executable, "-m", "toolcollapse", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "sft" in proc.stdout and "diagnose" in proc.stdout


@pytest.mark.slow
def test_overwrite_replaces_only_a_run_of_its_own_kind(tmp_path, tiny_checkpoint):
    """A folder that merely has a config.yaml is no run (`--out . --overwrite` must not wipe a working
    tree), and an SFT checkpoint is not an RL run."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.yaml").write_text("mine: 1\n")
    (project / "notes.txt").write_text("mine")
    sft_run = tmp_path / "sft_run"
    sft_run.mkdir()
    dump_config(RunConfig(), sft_run / "toolcollapse.yaml")  # what `toolcollapse sft` writes first
    for folder, message in ((project, "holds no rl run"), (sft_run, "holds an sft run, not an rl run")):
        before = tree(folder)
        refused(cli("rl", "--config", "configs/tiny_rl.yaml", "--init", str(tiny_checkpoint), "--out", str(folder),
                    "--overwrite"), message)
        assert tree(folder) == before


@pytest.mark.slow
def test_a_checkpoint_trained_with_another_call_end_is_refused(tmp_path, tiny_checkpoint):
    trained = tmp_path / "sampled"
    trained.mkdir()
    for f in tiny_checkpoint.iterdir():
        (trained / f.name).write_bytes(f.read_bytes())
    dump_config(RunConfig(rollout=RunConfig().rollout.__class__(call_end="sampled")), trained / "toolcollapse.yaml")
    before = tree(trained)
    refused(cli("eval", str(trained), "--n", "2", "--set", "rollout.call_end=template"), "call_end", "'sampled'")
    refused(cli("rl", "--config", "configs/tiny_rl.yaml", "--init", str(trained), "--out", str(tmp_path / "rl")),
            "call_end")
    assert tree(trained) == before and not (tmp_path / "rl").exists()


@pytest.mark.slow
def test_a_sweep_refuses_to_resume_runs_under_a_changed_config(tmp_path, tiny_checkpoint):
    import yaml

    sweep = {"base": "configs/tiny_rl.yaml", "init": str(tiny_checkpoint), "out_dir": str(tmp_path / "study"),
             "seeds": [0], "settings": {"hot": {"grpo.lr": 1.0e-3}}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    import dataclasses

    from toolcollapse.sweep import load_sweep

    [spec] = load_sweep(path)[1]
    spec.run_dir.mkdir(parents=True)
    started = dataclasses.replace(spec.cfg, grpo=dataclasses.replace(spec.cfg.grpo, lr=5e-4), threads=2)
    dump_config(started, spec.run_dir / "config.yaml")  # threads may differ (RESULT_NEUTRAL); lr may not
    before = tree(tmp_path / "study")
    refused(cli("sweep", str(path)), "grpo.lr=0.0005", "another out_dir")
    assert tree(tmp_path / "study") == before


@pytest.mark.slow
def test_sweep_only_names_settings_of_the_file(tmp_path, tiny_checkpoint):
    import yaml

    sweep = {"base": "configs/tiny_rl.yaml", "init": str(tiny_checkpoint), "out_dir": str(tmp_path / "study"),
             "seeds": [0], "settings": {"hot": {"grpo.lr": 1.0e-3}, "cold": {"grpo.lr": 1.0e-5}}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    refused(cli("sweep", str(path), "--only", "hot,warm"), "--only: 'warm' is not a setting")
    table = cli("sweep", str(path), "--only", "cold", "--summary-only")
    assert table.returncode == 0 and "| cold | 0 | not run |" in table.stdout and "hot" not in table.stdout
