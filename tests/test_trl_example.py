"""examples/trl_grpo.py end to end on CPU: the monitor, a PRS phase, one's own conversations, what it
refuses, and the KL reference grown with the tags it adds. Skipped where TRL is absent."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("trl", reason="the TRL integration needs TRL: pip install 'toolcollapse[trl]'")

from trl_helpers import ROOT


@pytest.mark.slow
@pytest.mark.parametrize("rollouts", ["tool_loop", "engine"])
def test_the_trl_example_script_trains_with_the_monitor_runs_a_prs_phase_and_diagnose_reads_it(
        tmp_path, tiny_checkpoint, rollouts):
    """examples/trl_grpo.py end to end on the random tiny model: two GRPO steps (TRL's tool loop, or our
    engine with an OPS row per group and the config's SFT term; in the tool loop LoRA adapters and the probe
    built from the shipped conversations file, as from one's own data), the probe at both, a PRS phase on the failed
    tasks (every sampled rollout of a random model fails), a TRL checkpoint a step and the final model saved,
    and `toolcollapse diagnose` on the output directory."""
    out = tmp_path / "out"
    # the engine in two rounds of one step (each round's TRL steps count from 1 again), the tool loop one of two
    rounds = ["--steps", "1", "--rounds", "2"] if rollouts == "engine" else ["--steps", "2", "--rounds", "1"]
    sets = ["world.n_train=2000", "world.n_test=200", "world.n_ood=150", "grpo.prompts_per_step=2",
            "grpo.group_size=2", "monitor.probe_size=4", "monitor.probe_every=1", "rollout.max_turns=2",
            "rollout.max_new_tokens=16"]
    cmd = [sys.executable, "examples/trl_grpo.py", "--checkpoint", str(tiny_checkpoint), "--config",
           "configs/tiny_rl.yaml", *[a for s in sets for a in ("--set", s)], *rounds,
           "--prs", "reflection", "--out", str(out), "--rollouts", rollouts, "--save-steps", "1",
           *(["--ops", "1", "--set", "supervision.sft_coef=0.5"] if rollouts == "engine"
             else ["--probe-data", str(ROOT / "examples" / "data" / "conversations.jsonl"),
                   "--set", "model.lora.rank=4"])]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "model.safetensors").is_file()  # the final save
    # --save-steps: each round's checkpoints in their own directory, none overwriting an earlier round's
    checkpoints = sorted(str(p.relative_to(out)) for p in out.rglob("checkpoint-*"))
    assert checkpoints == (["round_0/checkpoint-1", "round_1/checkpoint-1"] if rollouts == "engine"
                           else ["checkpoint-1", "checkpoint-2"]), checkpoints
    # LoRA in the tool loop: TRL's checkpoint holds the adapters, the final save the merged model
    assert (out / checkpoints[0] / "adapter_config.json").is_file() == (rollouts == "tool_loop")
    assert not (out / "adapter_config.json").exists()
    monitored = [json.loads(line) for line in (out / "monitor.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in monitored if "probe/im_end/miss_required" in r}) == [0, 1]
    assert {r["step"] for r in monitored if "healthy_rate" in r} == {0, 1}
    if rollouts == "engine":  # the config's SFT term, honoured
        assert any(r.get("sup/sft_tokens", 0) > 0 for r in monitored), sorted({k for r in monitored for k in r})
    phases = [json.loads(line) for line in (out / "phases.jsonl").read_text().splitlines()]
    assert [p["step"] for p in phases] == ([1, 2] if rollouts == "engine" else [2])
    for phase in phases:  # the failed tasks of the round's last step (window 1): its 2 prompts, or 4 over 2 steps
        assert phase["tasks"] == phase["phase/prs_examples"] == (2 if rollouts == "engine" else 4)
        assert phase["phase/steps"] >= 1
    diagnose = subprocess.run([sys.executable, "-m", "toolcollapse", "diagnose", str(out)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    assert diagnose.returncode == 0, diagnose.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["supervision.adaptive.enabled=true", "supervision.hbg.enabled=true"])
def test_the_trl_example_refuses_a_signal_it_cannot_run_before_loading_the_model(tmp_path, setting):
    """The config's supervision is honoured or refused: the adaptive schedule runs in `toolcollapse rl` only,
    HBG's hinted rows need our engine (TRL's tool loop has no place for them)."""
    cmd = [sys.executable, "examples/trl_grpo.py", "--checkpoint", str(tmp_path / "none"), "--config",
           "configs/tiny_rl.yaml", "--set", setting, "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("toolcollapse rl" if "adaptive" in setting else "--rollouts engine") in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_trl_example_trains_on_one_s_own_conversations(tmp_path, tiny_checkpoint):
    """`--data`: the shipped conversations' first turns as targets (first_turn_reward), the probe built from
    them, the config's SFT term on their ground truth, ETS rounds (an SFT phase on the failed conversations'
    first turns after each); what needs an environment or a judge is refused."""
    data = ROOT / "examples" / "data" / "conversations.jsonl"
    out = tmp_path / "out"
    sets = ["grpo.prompts_per_step=2", "grpo.group_size=2", "monitor.probe_size=4", "monitor.probe_every=1",
            "rollout.max_new_tokens=16", "supervision.sft_coef=0.5"]
    cmd = [sys.executable, "examples/trl_grpo.py", "--checkpoint", str(tiny_checkpoint), "--config",
           "configs/tiny_rl.yaml", *[a for s in sets for a in ("--set", s)], "--steps", "1", "--rounds", "2",
           "--data", str(data), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    monitored = [json.loads(line) for line in (out / "monitor.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in monitored if "probe/content/tool_name/logp" in r}) == [0, 1]
    assert any(r.get("sup/sft_tokens", 0) > 0 for r in monitored)
    # a random model fails both prompts of each one-step round: each phase trains their two reference turns
    phases = [json.loads(line) for line in (out / "phases.jsonl").read_text().splitlines()]
    assert [(p["step"], p["tasks"]) for p in phases] == [(1, 2), (2, 2)], phases
    assert all(p["phase/tokens"] > 0 and p["phase/steps"] >= 1 and p["phase/loss"] > 0 for p in phases), phases
    for extra in (["--ops", "1"], ["--prs", "reflection"]):
        refused = subprocess.run([*cmd[:-2], "--out", str(tmp_path / "no"), *extra], cwd=ROOT,
                                 capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2 and "--data" in refused.stderr and not (tmp_path / "no").exists()


@pytest.mark.slow
def test_the_trl_example_grows_the_kl_reference_with_the_tags_it_adds(tmp_path):
    """A checkpoint whose tokenizer lacks the tool tags (as Qwen2.5's or Llama 3's lacks some): the example adds
    them to the policy, and TRL's KL reference, which it loads from the policy's name_or_path, must have them
    too (else the new ids index past the reference's embedding)."""
    from test_conversations import _tokenizer_without_tags

    from toolcollapse.model import build_model

    ckpt = _tokenizer_without_tags(tmp_path / "ckpt")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    build_model("tiny", len(tok), 2048, tok.pad_token_id, tok.eos_token_id, seed=0).save_pretrained(ckpt)
    sets = ["world.n_train=2000", "world.n_test=200", "world.n_ood=150", "grpo.prompts_per_step=2",
            "grpo.group_size=2", "grpo.kl_coef=0.001", "monitor.probe_size=4", "rollout.max_turns=2",
            "rollout.max_new_tokens=8"]
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "examples/trl_grpo.py", "--checkpoint", str(ckpt), "--config",
                           "configs/tiny_rl.yaml", *[a for s in sets for a in ("--set", s)], "--steps", "1",
                           "--rollouts", "engine", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "added control tokens: <tool_call> </tool_call> <tool_response> </tool_response>" in proc.stdout
    grown = AutoTokenizer.from_pretrained(out / "init")
    assert len(grown) == len(tok) + 4 and (out / "init" / "model.safetensors").is_file()
