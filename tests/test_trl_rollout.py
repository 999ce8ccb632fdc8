"""Our rollout engine as TRL's rollout function (integrations/trl/rollout.py): the rows `toolcollapse rl`
plays, HBG and OPS included, BFCL multi-turn, and what it refuses. Skipped where TRL is absent."""


import pytest

pytest.importorskip("trl", reason="the TRL integration needs TRL: pip install 'toolcollapse[trl]'")

from trl_helpers import _tool_world_args, _engine_rows, _keeping


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
