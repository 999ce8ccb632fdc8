"""toolcollapse's monitor inside TRL's GRPOTrainer (integrations/trl/callback.py, the trainer's forward
statistics): the same numbers as our own monitor on the same batch and weights; across two processes,
statistics of the whole batch (not means of per-rank maxima); an alarm acted on by every rank alike.
Skipped where TRL is absent."""

import json

import pytest
import torch

pytest.importorskip("trl", reason="the TRL integration needs TRL: pip install 'toolcollapse[trl]'")

from trl_helpers import _drive, _ctrl, _our_forward


@pytest.mark.slow
def test_ctrl_and_probe_series_equal_toolcollapse_s_own_monitor_on_the_same_batch_and_weights(
        tmp_path, answering_checkpoint):
    from toolcollapse.chat import CONTROL_TAGS
    from toolcollapse.config import load_config
    from toolcollapse.envs import make_env
    from toolcollapse.integrations.trl import ControlTokenCallback
    from toolcollapse.model import load_model
    from toolcollapse.monitor import resolve_token_ids, run_probe, sampled_control_stats
    from toolcollapse.monitor import probe_for

    (end,) = _drive(answering_checkpoint, tmp_path, "--steps", "2")
    first_log = end["log_history"][0]
    assert first_log["step"] == 1 and first_log["ctrl/im_end/n_sampled"] > 0

    # the first micro-batch, right-padded as our update takes it, scored by our forward with the same weights
    ids, sampled, logp, entropy = _our_forward(answering_checkpoint, torch.load(tmp_path / "rank0" / "first.pt"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(answering_checkpoint)
    ours = sampled_control_stats(ids[sampled], logp, logp, entropy,  # one update per generation: on-policy
                                 resolve_token_ids(tokenizer, load_config("configs/tiny_rl.yaml").monitor.control_tokens))
    assert set(ours) == set(_ctrl(first_log))
    for key, value in ours.items():
        assert first_log[key] == pytest.approx(value, abs=1e-5), key

    # the probe at step 0 (before the first update): our run_probe on the starting weights
    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150",
                                               "world.seed=0", "monitor.probe_size=4"])
    probe, token_ids = probe_for(cfg, make_env(cfg), tokenizer)
    expected = run_probe(load_model(answering_checkpoint), probe, token_ids)
    logged = {k: v for k, v in first_log.items() if k.startswith("probe/")}
    assert set(logged) == set(expected) and len(expected) > 20
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, abs=1e-5), key
    assert ControlTokenCallback.for_tool_world(cfg, tokenizer).token_ids == token_ids
    tags = resolve_token_ids(tokenizer, CONTROL_TAGS)  # the probe's slots: every control tag one distinct token
    assert tags and len(set(tags.values())) == len(CONTROL_TAGS)


@pytest.mark.slow
def test_two_processes_log_whole_batch_statistics_and_stop_together_on_an_injected_spike(
        tmp_path, answering_checkpoint):
    from toolcollapse.config import load_config
    from toolcollapse.monitor import sampled_control_stats, resolve_token_ids
    from transformers import AutoTokenizer

    ends = _drive(answering_checkpoint, tmp_path, "--steps", "6", "--per-device", "4", "--inject-at", "2",
                  "--on-alarm", "stop", processes=2)
    token_ids = resolve_token_ids(AutoTokenizer.from_pretrained(answering_checkpoint),
                                  load_config("configs/tiny_rl.yaml").monitor.control_tokens)

    logs = [row for row in ends[0]["log_history"] if _ctrl(row)]
    assert len(logs) == 3  # steps 1-3: the spike at step 2 stops the run after that step
    for row in logs:
        step = row["step"]
        parts = [torch.load(tmp_path / f"rank{r}" / f"batch_{step}.pt") for r in (0, 1)]
        assert all(len(p) for p in parts)  # each rank scored its own completions
        whole = torch.cat(parts)
        expected = sampled_control_stats(whole[:, 0].long(), *whole[:, 1:].unbind(dim=1), token_ids)
        assert _ctrl(row) == pytest.approx(expected, abs=1e-9), step
        per_rank = [sampled_control_stats(p[:, 0].long(), *p[:, 1:].unbind(dim=1), token_ids) for p in parts]
        for key in (k for k in expected if k.endswith("_max")):  # the batch's maximum, not a mean of maxima
            assert row[key] == max(s.get(key, float("-inf")) for s in per_rank)
        assert row.get("ctrl/im_end/n_sampled", 0) == sum(s.get("ctrl/im_end/n_sampled", 0) for s in per_rank)
    assert [_ctrl(r) for r in ends[1]["log_history"] if _ctrl(r)] == [_ctrl(r) for r in logs]  # same on both ranks

    # the four states: counts summed over both ranks' completions (not a mean of per-rank rates)
    from toolcollapse.integrations.trl import TurnStates

    tokenizer = AutoTokenizer.from_pretrained(answering_checkpoint)
    for row in logs:
        turns = TurnStates(tokenizer)
        for r in (0, 1):
            gen = torch.load(tmp_path / f"rank{r}" / f"gen_{row['step'] - 1}.pt")
            turns.add(gen["completion_ids"], gen["completion_mask"])
        expected = turns.reduce()
        assert {k: row[k] for k in expected} == pytest.approx(expected, abs=1e-12)
        assert sum(v for k, v in expected.items() if k.startswith("state/")) == pytest.approx(1.0)

    # the spike: <|im_end|> pushed up from step 2 on; the probe sees it before that step's update, every rank
    # stops after it, and a checkpoint of that step is saved
    for end in ends:
        assert end["global_step"] == 3
        assert end["alarms"] and {a["step"] for a in end["alarms"]} == {2}
        assert "probe/im_end/p_forbidden_max" in {a["series"] for a in end["alarms"]}
    assert ends[0]["alarms"] == ends[1]["alarms"]
    assert (tmp_path / "trainer" / "checkpoint-3").is_dir()
    alarms = [json.loads(line) for line in (tmp_path / "trainer" / "alarms.jsonl").read_text().splitlines()]
    assert {a["step"] for a in alarms} == {2} and {a["action"] for a in alarms} == {"stop"}
    monitored = [json.loads(line) for line in (tmp_path / "trainer" / "monitor.jsonl").read_text().splitlines()]
    assert [r["step"] for r in monitored if "probe/im_end/p_forbidden_max" in r] == [0, 1, 2]
    assert [r["step"] for r in monitored if "healthy_rate" in r] == [0, 1, 2]  # rollouts of steps 0-2

    # `diagnose` reads the TRL output directory as one of our runs: the same rules, replayed, fire at step 2
    from toolcollapse.diagnose import diagnose_run

    d = diagnose_run(tmp_path / "trainer", tmp_path / "diagnose")
    assert d.steps_done == 3 and d.first_alarm == 2
    assert (tmp_path / "diagnose" / "control_tokens.png").is_file() and (tmp_path / "diagnose" / "states.png").is_file()
