import subprocess
import sys

import pytest

from toolcollapse.cli import main
from toolcollapse.config import ConfigError, RunConfig, dump_config, load_config


def test_defaults_and_file_roundtrip(tmp_path):
    cfg = load_config("configs/tiny.yaml")
    assert isinstance(cfg, RunConfig) and cfg.model.preset == "tiny"
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


def test_overrides_parse_yaml_values():
    cfg = load_config(None, ["sft.lr=3e-4", "eval.n_tasks=null", "world.seed=3", "sft.betas=[0.8, 0.9]"])
    assert cfg.sft.lr == pytest.approx(3e-4)  # PyYAML reads 3e-4 as a string; floats accept it
    assert cfg.eval.n_tasks is None and cfg.world.seed == 3 and cfg.sft.betas == (0.8, 0.9)


def test_phases_of_the_copy_warmup_and_older_keys():
    cfg = load_config("configs/tiny.yaml", ["sft.copy_warmup=[{content: no_system_prompt, steps: 600, batch_size: 16},"
                                            " {steps: 100}]"])
    assert [(w.content, w.steps, w.batch_size) for w in cfg.sft.copy_warmup] == [
        ("no_system_prompt", 600, 16), ("first_call", 100, 32)]
    # checkpoints and configs written before the list (one phase, three keys) still load
    old = load_config(None, ["sft.copy_warmup_steps=400", "sft.copy_warmup_content=both"])
    assert [(w.content, w.steps, w.batch_size) for w in old.sft.copy_warmup] == [("both", 400, 64)]
    with pytest.raises(ConfigError, match="only sft.copy_warmup"):
        load_config("configs/tiny.yaml", ["sft.copy_warmup_steps=400"])
    with pytest.raises(ConfigError, match=r"sft\.copy_warmup\[0\]\.content"):
        load_config(None, ["sft.copy_warmup_content=everything"])


def test_the_removed_speed_switches_load_where_on_and_refuse_to_be_turned_off(tmp_path):
    """Run directories written before issue 19 hold the old-path switches, always on: they still load (a
    resume); turning one off names the switch and where the path before it lives."""
    from toolcollapse.config import dump_config

    cfg = load_config("configs/tiny_rl.yaml")
    dump_config(cfg, tmp_path / "toolcollapse.yaml")
    text = (tmp_path / "toolcollapse.yaml").read_text()
    old = text.replace("rollout:\n", "rollout:\n  shared_prefix_attention: true\n  compact_finished_rows: true\n")
    old = old.replace("grpo:\n", "grpo:\n  sort_micro_batches: true\n  prefix_once: true\n")
    assert old.count(": true\n") >= 4 and old != text
    (tmp_path / "old.yaml").write_text(old)
    assert load_config(tmp_path / "old.yaml") == cfg
    for key in ("rollout.share_group_prompt", "grpo.prefix_once"):
        with pytest.raises(ConfigError, match=rf"{key}: the switch is gone .* b6b1319"):
            load_config("configs/tiny_rl.yaml", [f"{key}=false"])


@pytest.mark.parametrize("override, names", [
    ("sft.lrr=1", "sft.lrr"),
    ("bogus=1", "bogus"),
    ("sft.steps=ten", "sft.steps"),
    ("sft.steps=1.5", "sft.steps"),
    ("model.preset=huge", "model.preset"),
    ("eval.greedy=yes please", "eval.greedy"),
    ("eval.split=validation", "eval.split"),
    ("sft=3", "sft"),
])
def test_bad_overrides_name_the_key(override, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        load_config("configs/tiny.yaml", [override])


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_bad_yaml_top_level(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)


def test_cli_bad_config_exits_before_work(tmp_path, capsys):
    out = tmp_path / "should_not_exist"
    code = main(["sft", "--config", "configs/tiny.yaml", "--set", "sft.lrr=1", "--out", str(out)])
    assert code == 2 and not out.exists()
    assert "sft.lrr" in capsys.readouterr().err
    assert main(["sft", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert str(tmp_path / "missing.yaml") in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "no_checkpoint")]) == 2
    assert "no_checkpoint" in capsys.readouterr().err


def test_console_script_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "toolcollapse.cli", "sft", "--config", "configs/tiny.yaml",
                           "--set", "model.max_seq_len=long"], capture_output=True, text=True)
    assert proc.returncode == 2 and "model.max_seq_len" in proc.stderr


def test_a_run_config_inherits_from_its_base_section_by_section(tmp_path):
    long = load_config("configs/tiny_long.yaml")
    tiny = load_config("configs/tiny.yaml")
    assert long.world == tiny.world and long.model == tiny.model and long.rollout == tiny.rollout
    assert long.sft.lr == tiny.sft.lr and long.sft.schedule == "cosine" and long.sft.batch_size == 16
    assert [w.content for w in long.sft.copy_warmup] == ["first_call"]  # a list replaces the base's list
    assert long.name == "tiny_long" and long.out_dir == "runs/tiny_long"
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {child}\nseed: 1\n")
    with pytest.raises(ConfigError, match="leads back"):
        load_config(child)
    child.write_text(f"base: {tmp_path / 'nowhere.yaml'}\n")
    with pytest.raises(ConfigError, match=r"nowhere\.yaml \(the base of .*child\.yaml\)"):
        load_config(child)


@pytest.mark.parametrize("override, message", [
    ("sft.steps=-5", "sft.steps: -5 is not >= 1"),
    ("grpo.steps=0", "grpo.steps: 0 is not >= 1"),
    ("grpo.lr=nan", "grpo.lr: expected a finite number"),
    ("grpo.lr=.inf", "grpo.lr: expected a finite number"),
    ("sft.lr=-1", "sft.lr: -1.0 is not > 0"),
    ("grpo.group_size=1", "grpo.group_size: 1 is not >= 2"),
    ("rollout.temperature=0", "rollout.temperature: 0.0 is not > 0"),
    ("rollout.top_p=1.5", "rollout.top_p: 1.5 is not in (0, 1]"),
    ("grpo.clip_low=1", "grpo.clip_low: 1.0 is not in [0, 1)"),
    ("grpo.dual_clip=1", "grpo.dual_clip: 1.0 is not > 1"),
    ("sft.betas=[0.9, 1.0]", "sft.betas: 1.0 is not in [0, 1)"),
    ("sft.copy_warmup=[{steps: -1}]", r"sft.copy_warmup\[0\].steps: -1 is not >= 0"),
    ("eval.n_tasks=0", "eval.n_tasks: 0 is not >= 1"),
    ("tools.timeout_s=0", "tools.timeout_s: 0.0 is not > 0"),
    ("monitor.alarm_min_scale=0", "monitor.alarm_min_scale"),
    ("threads=0", "threads: 0 is not >= 1"),
])
def test_every_number_is_range_checked_when_the_config_loads(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[0,", r"\[0,")):
        load_config("configs/tiny.yaml", [override])


def test_a_config_built_in_code_is_held_to_the_same_ranges():
    from toolcollapse.config import GRPOConfig, rl_problems

    with pytest.raises(ConfigError, match="lr"):
        GRPOConfig(lr=-1.0)
    assert GRPOConfig(dual_clip=None).dual_clip is None
    assert rl_problems(load_config(None, ["rollout.top_p=0.9"]))  # fine for eval, refused for RL
    assert rl_problems(load_config(None)) == []


def test_a_key_written_twice_in_one_mapping_is_refused_with_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("base: configs/tiny.yaml\nsft:\n  lr: 1.0e-3\n  steps: 3\n  lr: 2.0e-3\n")
    with pytest.raises(ConfigError, match=r"the key 'lr' appears twice in one mapping \(lines 3 and 5\)"):
        load_config(path)
    proc = subprocess.run([sys.executable, "-m", "toolcollapse.cli", "sft", "--config", str(path), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 2 and "appears twice" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # before any work
    path.write_text("base: configs/tiny.yaml\nsft:\n  lr: 1.0e-3\n")  # a key that overrides the base: not a duplicate
    assert load_config(path).sft.lr == 1e-3


def test_a_config_that_is_not_utf8_is_refused_naming_the_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("sft:\n  lr: 1.0e-3  # café\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 24 is 0xe9\)"):
        load_config(path)
    proc = subprocess.run([sys.executable, "-m", "toolcollapse.cli", "sft", "--config", str(path), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 2 and "not UTF-8" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # before any work
