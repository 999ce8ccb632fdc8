"""toolcollapse's monitor inside TRL's GRPOTrainer: the same numbers as our own monitor on the same batch
and weights; across two processes, statistics of the whole batch (not means of per-rank maxima); an alarm
acted on by every rank alike. Skipped where TRL is absent."""

import json
import subprocess
from collections import Counter
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="the TRL integration needs TRL: pip install 'toolcollapse[trl]'")

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "trl_driver.py"


def _drive(checkpoint, out, *args, processes=1):
    # accelerate starts one process per rank with torchrun; `--multi_gpu` names that launcher, and without a
    # GPU the ranks run on the CPU and talk over gloo (`--cpu` would start a single process)
    launch = ([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"] if processes > 1
              else [sys.executable])
    proc = subprocess.run([*launch, str(DRIVER), str(checkpoint), str(out), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}" / "end.json").read_text()) for r in range(processes)]


def _ctrl(row):
    return {k: v for k, v in row.items() if k.startswith("ctrl/")}


def _our_forward(checkpoint, saved, keep=None):
    """Our update's log-prob and entropy (`update.policy_logprobs`) at the completion tokens of TRL's saved
    micro-batch (its rows where `keep`), right-padded as our update takes them, with the weights TRL
    scored them with. Returns (ids, sampled mask, logp, entropy)."""
    from toolcollapse.model import load_model
    from toolcollapse.records import PolicyBatch
    from toolcollapse.update import policy_logprobs

    x = saved["inputs"]
    keep = torch.ones(len(x["prompt_ids"]), dtype=torch.bool) if keep is None else keep
    model = load_model(checkpoint)
    model.load_state_dict(saved["weights"])
    rows = [(torch.cat([p[m.bool()], c[k.bool()]]), int(m.sum())) for p, m, c, k, e in
            zip(x["prompt_ids"], x["prompt_mask"], x["completion_ids"], x["completion_mask"], keep) if e]
    width = max(len(r) for r, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    sampled = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (r, n) in enumerate(rows):
        ids[i, :len(r)], sampled[i, n:len(r)] = r, True
    with torch.no_grad():
        logp, entropy = policy_logprobs(model.eval(), PolicyBatch(ids, sampled, torch.zeros(ids.shape),
                                                                  torch.zeros(len(rows))))
    return ids, sampled, logp, entropy


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


def test_ets_rows_from_references_train_the_reference_tokens_after_the_prompt_tokens_trl_fed(tokenizer):
    from toolcollapse.integrations.trl import reference_token_rows

    reference = '<tool_call>{"name": "kb_lookup", "arguments": {"entity": "Varkstan"}}</tool_call>'
    failures = [{"prompt_ids": torch.tensor([5, 6, 7], dtype=torch.int32), "reference": reference},
                {"prompt_ids": [8, 9], "reference": "The answer is 7.<|im_end|>"}]
    data, tokens, stats = reference_token_rows(failures, tokenizer)
    for row, f in zip(data, failures):
        prompt = [int(i) for i in f["prompt_ids"]]
        trained = [t for t in row["labels"] if t != -100]
        assert row["input_ids"][:len(prompt)] == prompt and row["labels"][:len(prompt)] == [-100] * len(prompt)
        assert row["input_ids"][len(prompt):] == trained  # the reference, and only it, is trained
        assert tokenizer.decode(trained, skip_special_tokens=False) == f["reference"]
    assert tokens == sum(len(r["input_ids"]) for r in data) - 5 and stats == {}
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in data[0]["labels"]  # the tag as one special token
    with pytest.raises(ValueError, match="prompt_ids"):
        reference_token_rows([{"reference": reference}], tokenizer)


def test_rejected_controls_marks_the_first_bad_control_token_of_each_sampled_turn(tokenizer):
    from toolcollapse.autopsy import control_tag_ids
    from toolcollapse.integrations.trl import rejected_controls

    id_to_tag = control_tag_ids(tokenizer)[0]
    tag = {t: i for i, t in id_to_tag.items()}
    word = tokenizer("hello", add_special_tokens=False)["input_ids"][0]
    # turn 1: a call closed by <|im_end|> inside it (full collapse); a tool response (mask 0); turn 2: a stray
    # </tool_call> and then <tool_response>: only the first is marked; then padding
    ids = [tag["<tool_call>"], word, tag["<|im_end|>"], word, word, tag["</tool_call>"], tag["<tool_response>"],
           tag["<|im_end|>"], 0]
    mask = [1, 1, 1, 0, 1, 1, 1, 1, 0]
    healthy = [word, word, tag["<|im_end|>"], 0, 0, 0, 0, 0, 0]
    out = rejected_controls(torch.tensor([ids, healthy]), torch.tensor([mask, [1, 1, 1, 0, 0, 0, 0, 0, 0]]), id_to_tag)
    assert out[0].nonzero().flatten().tolist() == [2, 5] and not out[1].any()


@pytest.mark.slow
def test_the_sft_term_trains_each_prompt_s_reference_once_and_equals_our_nll(tmp_path, answering_checkpoint):
    from transformers import AutoTokenizer

    from toolcollapse.model import load_model, logits_at

    (end,) = _drive(answering_checkpoint, tmp_path, "--steps", "2", "--sft-coef", "0.5", "--unlikelihood-coef", "0.5")
    first_log = end["log_history"][0]
    saved = torch.load(tmp_path / "rank0" / "first.pt")
    x = saved["inputs"]
    tokenizer = AutoTokenizer.from_pretrained(answering_checkpoint)
    kind, ids = x["sft_mask"], x["sft_ids"]
    carrying = (kind == 2).any(dim=1)
    prompts = [tokenizer.decode(p[m.bool()]) for p, m in zip(x["prompt_ids"], x["prompt_mask"])]
    assert int(carrying.sum()) == len(set(prompts)) == 2  # 8 rows, 2 prompts x 4: each reference once
    for i in carrying.nonzero().flatten().tolist():
        text = tokenizer.decode(ids[i][kind[i] == 2], skip_special_tokens=False)
        assert text.startswith("<tool_call>") and text.endswith("</tool_call><|im_end|>")
        assert tokenizer.decode(ids[i][kind[i] == 1]) == prompts[i]

    # its NLL, by our forward with the weights that step trained from
    model = load_model(answering_checkpoint)
    model.load_state_dict(saved["weights"])
    rows, k = ids[carrying], kind[carrying]
    width = int((k > 0).sum(dim=1).max())
    rows, k = rows[:, :width], k[:, :width]
    select = torch.zeros_like(k, dtype=torch.bool)
    select[:, :-1] = k[:, 1:] == 2
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(logits_at(model.eval(), rows, select), rows[k == 2])
    assert first_log["sup/sft_tokens"] == int((k == 2).sum()) and first_log["sup/sft_tokens_total"] == first_log[
        "sup/sft_tokens"]
    assert first_log["sup/sft_nll"] == pytest.approx(nll.item(), abs=1e-5)
    second = end["log_history"][1]
    assert second["sup/sft_tokens_total"] == first_log["sup/sft_tokens"] + second["sup/sft_tokens"]
    # unlikelihood: as many terms as rejected control tokens the parser found in the step's completions
    assert first_log.get("sup/unlikely_tokens", 0) == int(x["unlikely"].sum())


@pytest.mark.slow
def test_ets_alternates_grpo_rounds_and_sft_phases_on_the_failed_prompts_of_each_round(tmp_path, answering_checkpoint):
    (end,) = _drive(answering_checkpoint, tmp_path, "--steps", "2", "--rounds", "2")
    phases = end["phases"]
    assert [p["step"] for p in phases] == [2, 4] and all(p["phase/steps"] > 0 for p in phases)
    # every completion of the answering model fails (no tool call): each round's 2 steps x 2 prompts are the data
    for k, phase in enumerate(phases):
        rows = [json.loads(line) for line in (tmp_path / f"phase_{k}.jsonl").read_text().splitlines()]
        assert len(rows) == phase["tasks"] == 4
        assert all(r["completion"].startswith("<tool_call>") and r["prompt"].endswith("assistant\n") for r in rows)
    first, second = ([json.loads(line)["prompt"] for line in (tmp_path / f"phase_{k}.jsonl").read_text().splitlines()]
                     for k in (0, 1))
    assert not set(first) & set(second)  # each round on its own part of the data
    # one step count across rounds, and the phase trained the model the next round samples from: the ground
    # truth's tool name, never seen in SFT before, becomes far more likely after the first phase
    monitored = [json.loads(line) for line in (tmp_path / "trainer" / "monitor.jsonl").read_text().splitlines()]
    probes = {r["step"]: r["probe/content/tool_name/logp"] for r in monitored if "probe/content/tool_name/logp" in r}
    assert sorted(probes) == [0, 1, 2, 3]
    assert probes[2] > probes[1] + 2.0
    assert [json.loads(line)["step"] for line in (tmp_path / "trainer" / "phases.jsonl").read_text().splitlines()] == [
        2, 4]


@pytest.mark.slow
@pytest.mark.parametrize("shaping", ["luffy", "none"])
def test_ops_puts_the_reference_in_one_row_of_each_group_and_shapes_its_loss(tmp_path, answering_checkpoint, shaping):
    from transformers import AutoTokenizer

    from toolcollapse.losses import luffy_loss

    (end,) = _drive(answering_checkpoint, tmp_path, "--steps", "2", "--ops", "1", "--ops-shaping", shaping)
    first_log = end["log_history"][0]
    saved = torch.load(tmp_path / "rank0" / "first.pt")
    x = saved["inputs"]
    tokenizer = AutoTokenizer.from_pretrained(answering_checkpoint)
    expert = x["expert"]
    assert int(expert.sum()) == 2 == first_log["sup/expert_rows"]  # 8 rows = 2 groups of 4: one expert row each
    texts = [tokenizer.decode(c[m.bool()], skip_special_tokens=False)
             for c, m in zip(x["completion_ids"], x["completion_mask"])]
    for text in (t for t, e in zip(texts, expert.tolist()) if e):  # the ground truth's first turn
        assert text.startswith("<tool_call>") and text.endswith("</tool_call><|im_end|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    own = x["completion_ids"][~expert][x["completion_mask"][~expert].bool()]
    assert first_log["ctrl/im_end/n_sampled"] == int((own == im_end).sum())  # the monitor leaves expert rows out
    if shaping == "none":
        assert "sup/expert_luffy_loss" not in first_log
        return
    # LUFFY's shaped loss of the expert tokens, from our forward with the same weights and TRL's advantages
    _, sampled, logp, _ = _our_forward(answering_checkpoint, saved, keep=expert)
    advantages = torch.cat([x["advantages"][expert][i].expand(int(sampled[i].sum())) for i in range(len(sampled))])
    assert first_log["sup/expert_luffy_loss"] == pytest.approx(luffy_loss(logp, advantages, 0.1).mean().item(), abs=1e-5)


@pytest.mark.slow
def test_hbg_samples_hinted_rows_with_the_hint_and_trains_them_on_the_plain_prompt(tmp_path, answering_checkpoint):
    from transformers import AutoTokenizer

    (end,) = _drive(answering_checkpoint, tmp_path, "--steps", "1", "--hbg", "1")
    tokenizer = AutoTokenizer.from_pretrained(answering_checkpoint)
    sampled_from = [tokenizer.decode(ids) for ids in torch.load(tmp_path / "rank0" / "sampled_from_0.pt")]
    hinted = ["Hint:" in text for text in sampled_from]
    assert hinted == [False, False, False, True] * 2  # rows 4k + 3: one of each group of 4
    x = torch.load(tmp_path / "rank0" / "first.pt")["inputs"]
    trained_on = [tokenizer.decode(p[m.bool()]) for p, m in zip(x["prompt_ids"], x["prompt_mask"])]
    assert not any("Hint:" in text for text in trained_on)  # every row trains on the plain prompt
    plain = {t for t, h in zip(sampled_from, hinted) if not h}
    assert Counter(trained_on) == {t: 4 for t in plain} and len(plain) == 2  # each group's 4 rows: its plain prompt
    assert end["log_history"][0]["sup/hinted_rows"] == 2


def test_the_tool_world_as_a_trl_environment_runs_the_real_tools_with_the_schemas_we_document():
    from transformers.utils import get_json_schema

    from toolcollapse.config import load_config
    from toolcollapse.integrations.trl import tool_world_dataset, tool_world_environment, tool_world_reward

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=50", "world.n_test=10", "world.n_ood=10"])
    env = tool_world_environment(cfg)()
    world = env.world
    assert len(world.tool_table) == 9
    for spec in world.tool_table.values():  # what TRL's chat template renders, from the method alone
        schema = get_json_schema(getattr(env, spec.name))["function"]
        assert schema["name"] == spec.name and schema["description"] == spec.description
        assert set(schema["parameters"]["properties"]) == set(spec.parameters["properties"])
        assert schema["parameters"].get("required", []) == spec.parameters.get("required", [])
        for name, prop in spec.parameters["properties"].items():
            assert schema["parameters"]["properties"][name]["type"] == prop["type"]
            assert schema["parameters"]["properties"][name].get("enum") == prop.get("enum")
    for split in ("train", "ood_facts"):  # a counterfactual task's tools answer from its own facts
        row = tool_world_dataset(cfg, split, 1)[0]
        task = world.tasks(split)[0]
        assert env.reset(**row) is None and env.task is task
        call = next(m.tool_call for m in task.reference if m.tool_call is not None)
        assert getattr(env, call.name)(**call.arguments) == world.run_call(call, task.meta.get("facts", "real"))
        assert env.calls == [(call.name, call.arguments)]
        right = [{"role": "assistant", "content": f"The answer is {task.answer}."}]
        assert tool_world_reward([right, [{"role": "assistant", "content": "The answer is 0."}]], [env, env]) == [1, 0]
    assert getattr(env, "kb_lookup")(entity="Nowhere", attribute="area_km2").startswith('{"error"')
    with pytest.raises(KeyError, match="not a task of this toolworld environment"):
        env.reset(task_id="train-99999")


@pytest.mark.slow
def test_trl_s_own_tool_loop_trains_on_the_tool_world_environment(tmp_path, answering_checkpoint):
    from transformers import AutoTokenizer
    from trl import GRPOConfig
    from trl.chat_template_utils import qwen2_5_chat_template

    from toolcollapse.config import load_config
    from toolcollapse.integrations.trl import (MonitoredGRPOTrainer, tool_world_dataset, tool_world_environment,
                                               tool_world_reward)
    from toolcollapse.model import load_model

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150"])
    tokenizer = AutoTokenizer.from_pretrained(answering_checkpoint)
    tokenizer.chat_template = qwen2_5_chat_template  # one TRL's tool loop knows; the same ChatML tags as ours
    data = tool_world_dataset(cfg, "train", 8)
    factory = tool_world_environment(cfg)
    env = factory()
    rendered = tokenizer.apply_chat_template(data[0]["prompt"], tools=[getattr(env, n) for n in env.world.tool_table],
                                             tokenize=False, add_generation_prompt=True)
    assert all(f'"name": "{n}"' in rendered for n in env.world.tool_table)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=16, max_steps=1,
                      logging_steps=1, report_to="none", save_strategy="no", seed=0, beta=0.0)
    trainer = MonitoredGRPOTrainer(model=load_model(answering_checkpoint), reward_funcs=tool_world_reward, args=args,
                                   train_dataset=data, processing_class=tokenizer, environment_factory=factory)
    trainer.train()
    log = trainer.state.log_history[0]
    assert "tools/call_frequency" in log and "rewards/tool_world_reward/mean" in log
    assert sum(log[f"state/{s}"] for s in ("healthy_call", "healthy_response", "text_pollution",
                                            "full_collapse")) == pytest.approx(1.0)


def _scripted_trainer(checkpoint, cfg, tasks, turns):
    """A MonitoredGRPOTrainer on the tool world (TRL's own tool loop, our chat format) whose generations are
    scripted: the k-th turn of a rollout of `tasks[i]` (after k tool replies) is `turns[i][k]` (Messages),
    encoded as our policy writes it. It keeps its last generation batch (`saved`: inputs, outputs)."""
    from transformers import AutoTokenizer

    from toolcollapse.chat import PieceEncoder, assistant_body, conversation_pieces
    from toolcollapse.integrations.trl import MonitoredGRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    encoder = PieceEncoder(tokenizer)
    reply = tokenizer.convert_tokens_to_ids("<tool_response>")
    script = {tuple(encoder.encode(conversation_pieces(t.prompt, add_generation_prompt=True))[0]):
              [encoder.encode(assistant_body(m))[0] for m in messages] for t, messages in zip(tasks, turns)}

    class Scripted(MonitoredGRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            out = []
            for ids in prompt_ids:
                prompt = next(p for p in script if tuple(ids[:len(p)]) == p)
                out.append(list(script[prompt][ids.count(reply) - prompt.count(reply)]))
            return out, None

        def _generate_and_score_completions(self, inputs):
            self.saved = (inputs, super()._generate_and_score_completions(inputs))
            return self.saved[1]

    return Scripted, tokenizer


def _tool_world_args(tmp_path, **kwargs):
    from trl import GRPOConfig

    settings = dict(per_device_train_batch_size=8, num_generations=2, max_completion_length=1024, max_steps=1, seed=0,
                    beta=0.0)
    return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False, logging_steps=1,
                      report_to="none", save_strategy="no", shuffle_dataset=False, **{**settings, **kwargs})


@pytest.mark.slow
def test_trl_s_tool_loop_in_our_chat_format_builds_token_for_token_the_episodes_our_engine_builds(
        tmp_path, tiny_checkpoint):
    """TRL's own tool loop (parse, run the environment's tool, append the reply) on a toolcollapse model in
    its own chat format, its generations scripted to the ground truth's turns: the completions, their loss
    masks, the rewards and the four states equal our engine's replay of the same tasks, and so does the
    rollout rebuilt as our Episode (what PRS's judge reads). (With the real tiny SFT checkpoint, greedy, TRL
    and our engine sample the same episodes: bench/grpo_multiturn_vs_trl.py.)"""
    from toolcollapse.config import load_config
    from toolcollapse.envs import make_env
    from toolcollapse.evaluate import sampling_params
    from toolcollapse.integrations.trl import (rollout_episode, tool_world_dataset, tool_world_environment,
                                               tool_world_reward)
    from toolcollapse.model import load_model
    from toolcollapse.rollout import RolloutEngine

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150"])
    world = make_env(cfg)
    tasks = world.tasks("train")[:4]
    Scripted, tokenizer = _scripted_trainer(tiny_checkpoint, cfg, tasks,
                                            [[m for m in t.reference if m.role == "assistant"] for t in tasks])
    engine = RolloutEngine(load_model(tiny_checkpoint), tokenizer, world)
    replayed = {e.task_id: e for e in engine.replay(tasks, sampling_params(cfg, greedy=True))}
    trainer = Scripted(model=load_model(tiny_checkpoint), reward_funcs=tool_world_reward, args=_tool_world_args(tmp_path),
                       train_dataset=tool_world_dataset(cfg, "train", 4, system_prompt=True), processing_class=tokenizer,
                       environment_factory=tool_world_environment(cfg), tool_specs=world.tool_table)
    trainer.train()
    inputs, out = trainer.saved
    for i, x in enumerate(inputs):
        ep = replayed[x["task_id"]]
        keep = out["completion_mask"][i].bool()
        prompt = out["prompt_ids"][i][out["prompt_mask"][i].bool()]
        assert prompt.tolist() == ep.tokens[:ep.prompt_len]
        assert out["completion_ids"][i][keep].tolist() == ep.tokens[ep.prompt_len:]  # tool replies from our tools
        assert out["tool_mask"][i][keep].tolist() == ep.loss_mask[ep.prompt_len:]  # <|im_end|> after a call: 0
        rebuilt = rollout_episode(tasks[i // 2], prompt, out["completion_ids"][i][keep], out["tool_mask"][i][keep],
                                  tokenizer, world)
        assert (rebuilt.tokens, rebuilt.loss_mask, rebuilt.finish, rebuilt.final_text) == (
            ep.tokens, ep.loss_mask, ep.finish, ep.final_text)
        assert [(t.start, t.end, t.parsed, t.observation) for t in rebuilt.turns] == [
            (t.start, t.end, t.parsed, t.observation) for t in ep.turns]
    log = trainer.state.log_history[0]
    assert all(e.success for e in replayed.values()) and log["reward"] == 1.0
    turns = sum(len(e.turns) for e in replayed.values())
    calls = sum(t.parsed.end == "call" for e in replayed.values() for t in e.turns)
    assert calls > 0 and log["turns_per_episode"] == pytest.approx(turns / 4)
    assert log["state/healthy_call"] == pytest.approx(calls / turns) and log["healthy_rate"] == 1.0
    assert log["tools/call_frequency"] == pytest.approx(calls / 4)


@pytest.mark.slow
@pytest.mark.parametrize("prs_target", [None, "reflection", "correction"])
def test_ets_and_prs_phases_through_trl_train_on_the_examples_rl_builds_from_the_same_failures(
        tmp_path, tiny_checkpoint, prs_target):
    """A GRPO round through TRL's tool loop in which two of four tasks fail (a wrong first call, a wrong
    answer), then an SFTTrainer phase: its rows are, token for token and label for label, the examples
    `toolcollapse rl` builds for those failures (`interleave.phase_examples`: ETS's ground truths, and
    PRS's from the deterministic judge's verdict on our engine's replay of the same rollouts)."""
    import dataclasses

    from trl import SFTConfig, SFTTrainer

    from toolcollapse.chat import PieceEncoder, generation_prompt
    from toolcollapse.config import load_config
    from toolcollapse.envs import make_env
    from toolcollapse.evaluate import sampling_params
    from toolcollapse.integrations.trl import (tool_world_dataset, tool_world_environment, rl_phase_data,
                                               tool_world_reward, train_interleaved)
    from toolcollapse.interleave import Failure, judged, phase_examples
    from toolcollapse.judge import deterministic_judge
    from toolcollapse.model import load_model
    from toolcollapse.records import Message, ToolCall
    from toolcollapse.rollout import RolloutEngine

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150"])
    world = make_env(cfg)
    tasks = world.tasks("train")[:4]

    def wrong(task):  # the first call asks about another entity; the answer is 0
        turns = [m for m in task.reference if m.role == "assistant"]
        first = turns[0].tool_call
        arguments = {k: ("Nowhere" if k == "entity" else v) for k, v in first.arguments.items()}
        assert arguments != first.arguments
        return [Message("assistant", "", ToolCall(first.name, arguments)), *turns[1:-1],
                Message("assistant", "The answer is 0.")]

    turns = [wrong(t) if i < 2 else [m for m in t.reference if m.role == "assistant"] for i, t in enumerate(tasks)]
    Scripted, tokenizer = _scripted_trainer(tiny_checkpoint, cfg, tasks, turns)
    model = load_model(tiny_checkpoint)
    data = tool_world_dataset(cfg, "train", 4, system_prompt=True)
    seen = []

    def make_grpo(round_):
        return Scripted(model=model, reward_funcs=tool_world_reward, args=_tool_world_args(tmp_path / "grpo"),
                        train_dataset=data, processing_class=tokenizer,
                        environment_factory=tool_world_environment(cfg), tool_specs=world.tool_table)

    def make_sft(dataset):
        seen.append(dataset)
        args = SFTConfig(output_dir=str(tmp_path / "sft"), use_cpu=True, bf16=False, per_device_train_batch_size=2,
                         num_train_epochs=1, learning_rate=1e-3, max_length=None, report_to="none",
                         save_strategy="no", seed=0)
        return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)

    (phase,) = train_interleaved(make_grpo, make_sft, rounds=1, window=1,
                                 phase_data=rl_phase_data(cfg, tokenizer, prs_target=prs_target))
    # what rl builds: the failed rollouts replayed by our engine, judged, encoded
    failed = [dataclasses.replace(t, reference=tuple(m for m in msgs)) for t, msgs in zip(tasks[:2], turns[:2])]
    episodes = RolloutEngine(model, tokenizer, world).replay(failed, sampling_params(cfg, greedy=True))
    assert not any(e.success for e in episodes)
    encoder = PieceEncoder(tokenizer)
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)  # noqa: E731
    failures = [Failure(0, t.id) for t in tasks[:2]]
    if prs_target:
        failures = [judged(f, t, e, deterministic_judge, decode, len(encoder.encode(generation_prompt())[0]))
                    for f, t, e in zip(failures, tasks, episodes)]
        assert [(f.turn, f.mistake) for f in failures] == [(0, "miscopied_argument")] * 2
    examples, stats = phase_examples(failures, {t.id: t for t in tasks}, encoder, prs_target, 2048)
    assert len(examples) == (4 if prs_target else 2) and phase["tasks"] == 2
    assert phase["phase/prs_examples"] == stats["phase/prs_examples"] == (2 if prs_target else 0)
    (rows,) = seen
    assert [r["input_ids"] for r in rows] == [ids for ids, _ in examples]
    assert [r["labels"] for r in rows] == [[t if m else -100 for t, m in zip(ids, mask)] for ids, mask in examples]
    assert phase["phase/tokens"] == sum(sum(mask) for _, mask in examples)
    assert phase["phase/steps"] == len(examples) // 2 and phase["phase/loss"] > 0  # SFTTrainer trained on them


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_with_constant_rewards_the_sft_term_moves_the_weights_as_our_sft_step_on_the_same_batch(
        tmp_path, answering_checkpoint, processes):
    """Every reward 1: GRPO's advantages are 0 and (beta 0) its loss moves nothing, so one SGD step of TRL
    with the SFT term is exactly our SFT step (`SFTTerm`, token-mean NLL) on the references of the whole
    batch -- with two ranks, both ranks' references together: the terms of the ranks, averaged by DDP, add
    up to one token mean."""
    from toolcollapse.model import load_model
    from toolcollapse.supervision import SFTTerm

    lr, coef = 0.05, 0.5
    ends = _drive(answering_checkpoint, tmp_path, "--steps", "1", "--constant-reward", "--sft-coef", str(coef),
                  "--optim", "sgd", "--lr", str(lr), "--max-grad-norm", "0", processes=processes)
    assert all(e["log_history"][0]["reward_std"] == 0 for e in ends)
    examples = []
    for r in range(processes):
        x = torch.load(tmp_path / f"rank{r}" / "first.pt")["inputs"]  # one micro-batch: the rank's whole batch
        for ids, kind in zip(x["sft_ids"], x["sft_mask"]):
            if (kind == 2).any():
                examples.append((ids[kind > 0].tolist(), (kind[kind > 0] == 2).long().tolist()))
    assert len(examples) == 2 * processes  # each rank: 8 rows, 2 prompts, each reference once
    model = load_model(answering_checkpoint)
    model.load_state_dict(torch.load(tmp_path / "rank0" / "first.pt")["weights"])
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    SFTTerm(coef, 64, model.config.pad_token_id).backward(model.train(), examples)
    finals = [torch.load(tmp_path / f"rank{r}" / "final.pt") for r in range(processes)]
    moved = 0
    for name, p in model.named_parameters():
        ours = before[name] - lr * p.grad
        for final in finals:  # every rank ends with the same weights
            torch.testing.assert_close(final[name], ours, atol=1e-6, rtol=1e-5)
        moved += int((finals[0][name] != before[name]).sum())
    assert moved > 1000  # the step did move the weights


def _engine_rows(trainer):
    """Per row of the trainer's last generation batch: task id, completion ids, env mask, reward."""
    inputs, out = trainer.saved
    rows = []
    for i, x in enumerate(inputs):
        keep = out["completion_mask"][i].bool()
        rows.append((x["task_id"], out["completion_ids"][i][keep].tolist(), out["tool_mask"][i][keep].tolist()))
    return inputs, out, rows


def _keeping(cls):
    class Keeping(cls):
        def _generate_and_score_completions(self, inputs):
            self.saved = (inputs, super()._generate_and_score_completions(inputs))
            return self.saved[1]

    return Keeping


def test_our_engine_as_trl_s_rollout_func_plays_the_rows_rl_plays_hbg_and_ops_included(tmp_path, tiny_checkpoint):
    """engine_rollouts inside GRPOTrainer, a group of 4 = 2 policy rows, 1 HBG row, 1 OPS row, as
    `signals.group_rollouts` builds them in rl: the sampled rows are the episodes our engine samples with
    the same seed (the hinted one from the hinted prompt, returned on the plain one), the OPS row is the
    ground truth replayed with its tool replies really run, and the monitor watches the policy's rows only."""
    from transformers import AutoTokenizer

    from toolcollapse.config import load_config
    from toolcollapse.envs import make_env
    from toolcollapse.evaluate import sampling_params
    from toolcollapse.integrations.trl import MonitoredGRPOTrainer, engine_rollouts, episode_success, task_dataset
    from toolcollapse.model import load_model
    from toolcollapse.rollout import RolloutEngine
    from toolcollapse.supervision import hint, with_hint, without_hint

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150",
                                               "rollout.max_turns=8", "rollout.max_new_tokens=96"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    world = make_env(cfg)
    tasks = world.tasks("train")[:2]
    model = load_model(tiny_checkpoint)
    args = _tool_world_args(tmp_path, num_generations=4)
    trainer = _keeping(MonitoredGRPOTrainer)(
        model=model, reward_funcs=episode_success, args=args, train_dataset=task_dataset(cfg, "train", 2),
        processing_class=tokenizer, rollout_func=engine_rollouts(cfg, tokenizer, tasks=tasks), ops=1, hbg=1)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer.train()
    inputs, out, rows = _engine_rows(trainer)
    # what our engine plays from the same weights and seed: per task 2 samples and 1 from the hinted prompt
    # (one batch, group size 1, as in rl), the hinted one re-based on the plain prompt; and the replay
    engine = RolloutEngine(load_model(tiny_checkpoint).eval(), tokenizer, world)
    params = sampling_params(cfg, greedy=False)
    h = cfg.supervision.hbg
    prompts = [x for t in tasks for x in (t, t, with_hint(t, hint(t, h.level, h.calls)))]
    sampled = engine.generate(prompts, params, group_size=1, seed=args.seed * 1_000_003)
    sampled = [without_hint(e, engine.prompt_ids(tasks[i // 3])) if i % 3 == 2 else e for i, e in enumerate(sampled)]
    replayed = engine.replay(tasks, params)
    want = [e for k in range(2) for e in (*sampled[3 * k:3 * k + 3], replayed[k])]
    assert [r[0] for r in rows] == [e.task_id for e in want]
    for i, ((task_id, ids, mask), ep) in enumerate(zip(rows, want)):
        assert out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist() == ep.tokens[:ep.prompt_len]
        assert ids == ep.tokens[ep.prompt_len:] and mask == ep.loss_mask[ep.prompt_len:]
    assert out["expert"].tolist() == [False, False, False, True] * 2
    assert out["hinted"].tolist() == [False, False, True, False] * 2
    assert len(engine.prompt_ids(prompts[2])) > len(engine.prompt_ids(tasks[0]))  # it sampled with the hint
    assert all(e.success for e in replayed) and len(replayed[0].turns) > 1  # a multi-turn ground truth
    log = trainer.state.log_history[0]
    assert log["reward"] == pytest.approx(sum(e.success for e in want) / 8)
    assert log["sup/expert_rows"] == 2 and log["sup/hinted_rows"] == 2
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    policy = [e for i, e in enumerate(sampled) if i % 3 != 2]
    own = sum(t == im_end and m for ep in policy for t, m in zip(ep.tokens, ep.loss_mask))  # the policy's own
    assert log.get("ctrl/im_end/n_sampled", 0) == own
    assert any((model.state_dict()[k] != v).any() for k, v in before.items())  # the step trained


@pytest.mark.slow
def test_bfcl_multi_turn_runs_in_trl_through_our_engine_its_later_user_turns_masked_out(tmp_path):
    """BFCL multi-turn in GRPOTrainer via engine_rollouts: an OPS row is the ground truth of a task with
    several user turns, played against BFCL's real backends -- the later user turns and the tool replies
    are context (env_mask 0), exactly as in our engine's replay, and BFCL's state check rewards it 1."""
    pytest.importorskip("bfcl_eval", reason="env: bfcl needs `pip install --no-deps bfcl-eval`")
    pytest.importorskip("mpmath", reason="env: bfcl needs the [bfcl] extra")
    from toolcollapse.chat import PieceEncoder, conversation_pieces
    from toolcollapse.config import load_config
    from toolcollapse.envs import make_env
    from toolcollapse.evaluate import sampling_params
    from toolcollapse.integrations.trl import (MonitoredGRPOTrainer, engine_rollouts, episode_success, rollout_episode,
                                               task_dataset)
    from toolcollapse.model import build_model
    from toolcollapse.rollout import RolloutEngine
    from toolcollapse.tokenizer import train_tokenizer

    cfg = load_config("configs/tiny_rl.yaml", ["env=bfcl", "model.max_seq_len=4096", "rollout.max_turns=12",
                                               "rollout.max_new_tokens=160"])
    env = make_env(cfg)
    tokenizer = train_tokenizer(env.tokenizer_corpus(30), 2048)
    encoder = PieceEncoder(tokenizer)
    params = sampling_params(cfg, greedy=False)
    engine = RolloutEngine(build_model("tiny", len(tokenizer), 4096, tokenizer.pad_token_id, tokenizer.eos_token_id,
                                       0), tokenizer, env)
    short = [t for t in env.tasks("train") if t.meta["n_turns"] >= 2
             and len(encoder.encode(conversation_pieces(t.prompt, True))[0]) < 2500]
    task = next(t for t in short if engine.replay([t], params)[0].success)
    model = build_model("tiny", len(tokenizer), 4096, tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
    data = task_dataset(cfg, "train").filter(lambda row: row["task_id"] == task.id)
    trainer = _keeping(MonitoredGRPOTrainer)(
        model=model, reward_funcs=episode_success, args=_tool_world_args(tmp_path, per_device_train_batch_size=2),
        train_dataset=data, processing_class=tokenizer, rollout_func=engine_rollouts(cfg, tokenizer, tasks=[task]),
        ops=1)
    trainer.train()
    inputs, out, rows = _engine_rows(trainer)
    (replayed,) = RolloutEngine(model, tokenizer, env).replay([task], params)
    assert rows[1] == (task.id, replayed.tokens[replayed.prompt_len:], replayed.loss_mask[replayed.prompt_len:])
    completion = tokenizer.decode(rows[1][1])
    assert completion.count("<|im_start|>user") >= task.meta["n_turns"] - 1  # the later user turns are in it...
    user_at = [i for i, t in enumerate(rows[1][1]) if t == tokenizer.convert_tokens_to_ids("<|im_start|>")]
    assert all(rows[1][2][i] == 0 for i in user_at)  # ...as context
    assert out["expert"].tolist() == [False, True] and inputs[1]["success"] == 1.0  # BFCL's state check
    # PRS reads such a rollout rebuilt as our Episode: its turns, and between them the tool replies and
    # the next user turns, as our engine recorded them
    rebuilt = rollout_episode(task, out["prompt_ids"][1][out["prompt_mask"][1].bool()], rows[1][1], rows[1][2],
                              tokenizer, env)
    assert [(t.start, t.end, t.parsed, t.observation) for t in rebuilt.turns] == [
        (t.start, t.end, t.parsed, t.observation) for t in replayed.turns]
    assert any(task.prompt[-1].content not in (t.observation or "") and "<tool_response>" not in (t.observation or "")
               and t.observation for t in rebuilt.turns)  # a later user turn among them
    log = trainer.state.log_history[0]
    assert log["rewards/episode_success/mean"] == pytest.approx((inputs[0]["success"] + 1.0) / 2)


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


def test_speak_toolcollapse_chat_makes_trl_stop_where_our_rollouts_stop_and_refuses_what_it_cannot_do(
        tmp_path, tiny_checkpoint):
    """Our chat format in TRL's tool loop: `</tool_call>` ends a generation (TRL cuts completions at the
    model's end tokens, not only where `generate` stopped), Qwen's call parser is set, vLLM and a model path
    are refused, and any other chat template is left alone."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    from toolcollapse.config import load_config
    from toolcollapse.integrations.trl import (MonitoredGRPOTrainer, speak_toolcollapse_chat, tool_world_dataset,
                                               tool_world_environment, tool_world_reward)
    from toolcollapse.model import load_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("</tool_call>", "<|im_end|>", "<|endoftext|>")}
    model = load_model(tiny_checkpoint)
    with pytest.raises(ValueError, match="vLLM"):
        speak_toolcollapse_chat(tokenizer, model, use_vllm=True)
    with pytest.raises(ValueError, match="model object"):
        speak_toolcollapse_chat(tokenizer, str(tiny_checkpoint))
    other = AutoTokenizer.from_pretrained(tiny_checkpoint)
    other.chat_template = qwen2_5_chat_template
    assert speak_toolcollapse_chat(other, model) is None and getattr(other, "response_template", None) is None
    assert speak_toolcollapse_chat(tokenizer, model, "sampled") is None  # the model writes its own <|im_end|>
    assert ids["</tool_call>"] not in model.generation_config.eos_token_id

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150"])
    model = load_model(tiny_checkpoint)
    end = ids["</tool_call>"]

    def close_at_once(module, inputs, output):  # the random model writes </tool_call> first, every turn
        output[..., end] += 30.0
        return output

    model.get_output_embeddings().register_forward_hook(close_at_once)
    trainer = _keeping(MonitoredGRPOTrainer)(
        model=model, reward_funcs=tool_world_reward, args=_tool_world_args(tmp_path, max_completion_length=32),
        train_dataset=tool_world_dataset(cfg, "train", 4, system_prompt=True), processing_class=tokenizer,
        environment_factory=tool_world_environment(cfg))
    assert set(ids.values()) <= set(model.generation_config.eos_token_id)
    assert tokenizer.response_template is not None
    trainer.train()
    _, out = trainer.saved
    completions = [c[m.bool()].tolist() for c, m in zip(out["completion_ids"], out["completion_mask"])]
    assert completions == [[end]] * 8  # cut there: no padding, no second generation (no call was opened)


def test_engine_rollouts_refuses_a_training_set_with_rows_it_does_not_know_before_any_rollout(tmp_path, tiny_checkpoint):
    """Every rank checks the whole dataset at the first batch, so they all raise together (a row unknown
    to one rank's batch only would leave the others waiting in a collective)."""
    from transformers import AutoTokenizer

    from toolcollapse.config import load_config
    from toolcollapse.envs import make_env
    from toolcollapse.integrations.trl import MonitoredGRPOTrainer, engine_rollouts, episode_success, task_rows
    from toolcollapse.model import load_model

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tasks = make_env(cfg).tasks("train")[:8]
    generated = []

    class Counting(MonitoredGRPOTrainer):
        def _generate(self, prompts):
            generated.append(len(prompts))
            return super()._generate(prompts)

    # the rollout function knows the first 4 tasks; the dataset's last 4 rows (a later batch) are others
    trainer = Counting(model=load_model(tiny_checkpoint), reward_funcs=episode_success, args=_tool_world_args(
        tmp_path, per_device_train_batch_size=4), train_dataset=task_rows(tasks), processing_class=tokenizer,
        rollout_func=engine_rollouts(cfg, tokenizer, tasks=tasks[:4]))
    with pytest.raises(ValueError, match="4 rows of the training dataset are none of the tasks"):
        trainer.train()
    assert generated == [4]  # the first batch's own rows were all known: the check was on the whole dataset


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
