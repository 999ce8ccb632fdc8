"""ETS and PRS through TRL (integrations/trl/interleaved.py): GRPO rounds and SFTTrainer phases on the
same model, trained on the examples `toolcollapse rl` builds. Skipped where TRL is absent."""

import json

import pytest
import torch

pytest.importorskip("trl", reason="the TRL integration needs TRL: pip install 'toolcollapse[trl]'")

from trl_helpers import _drive, _scripted_trainer, _tool_world_args


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
