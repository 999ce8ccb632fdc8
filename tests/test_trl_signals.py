"""Our signals inside TRL's GRPOTrainer (issue 19): a signal's loss terms are the same objects in both trainers,
so one batch fed to both gives the same terms and the same metric keys; the toy signal of test_signals.py
plugs into TRL as it plugs into ours. Skipped where TRL is absent."""

import pytest
import torch
from test_signals import SampledNLL, Toy
from trl_helpers import _keeping, _tool_world_args

pytest.importorskip("trl", reason="the TRL integration needs TRL: pip install 'toolcollapse[trl]'")


class Recording(Toy):
    """The toy signal, keeping the Steps TRL hands it, and when its `after_update` ran (the trainer's step then)."""

    def __init__(self, cfg, **given):
        super().__init__(cfg, **given)
        self.steps, self.after = [], []
        self.trainer = None

    def terms(self, step):
        self.steps.append(step)
        return super().terms(step)

    def after_update(self, step):
        self.after.append((self.trainer.state.global_step, step))
        return super().after_update(step)


def test_one_batch_through_both_trainers_gives_equal_loss_terms_and_metric_keys(tmp_path, tiny_checkpoint):
    """TRL's update on its first batch (engine_rollouts, one micro-batch), with unlikelihood and the toy signal,
    then our update (`update.policy_step`) on the same rollouts, from the same weights, with the terms our loop
    builds: the same unlikelihood tokens, the same term values to 1e-5, the same `sup/*` and `toy/*` keys."""
    from transformers import AutoTokenizer

    from toolcollapse.config import load_config
    from toolcollapse.envs import make_env
    from toolcollapse.integrations.trl import MonitoredGRPOTrainer, engine_rollouts, episode_success, task_dataset
    from toolcollapse.model import load_model
    from toolcollapse.rollout import RolloutEngine
    from toolcollapse.signals import Unlikelihood
    from toolcollapse.supervision import unlikely_positions
    from toolcollapse.update import policy_step

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150",
                                               "rollout.max_turns=3", "rollout.max_new_tokens=24",
                                               "grpo.group_size=4", "grpo.micro_batch_size=8"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tasks = make_env(cfg).tasks("train")[:2]
    model = load_model(tiny_checkpoint)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    toy = Recording(cfg)
    trainer = _keeping(MonitoredGRPOTrainer)(
        model=model, reward_funcs=episode_success, args=_tool_world_args(tmp_path, num_generations=4),
        train_dataset=task_dataset(cfg, "train", 2), processing_class=tokenizer,
        rollout_func=engine_rollouts(cfg, tokenizer, tasks=tasks), unlikelihood_coef=0.5, signals=[toy])
    toy.trainer = trainer
    trainer.train()
    trl_log = trainer.state.log_history[0]
    (step,) = toy.steps
    assert len(step.episodes) == 8 and step.kinds == ["policy"] * 8
    assert toy.after == [(1, step)]  # after the update, on the batch's Step

    ours = load_model(tiny_checkpoint)
    ours.load_state_dict(before)
    engine = RolloutEngine(ours, tokenizer, make_env(cfg))
    marked = unlikely_positions(step.episodes, engine.id_to_tag, cfg.rollout.call_end)
    terms = [Unlikelihood(0.5, marked), SampledNLL(5.0)]
    optimizer = torch.optim.AdamW(ours.parameters(), lr=0.0)
    our_log = policy_step(ours, None, optimizer, step.episodes, torch.zeros(8), cfg.grpo, tokenizer.pad_token_id,
                          {}, temperature=cfg.rollout.temperature, terms=terms)
    our_log.update(Toy(cfg).after_update(step))  # as our loop calls it after the update

    n_marked = sum(len(m) for m in marked)
    assert n_marked > 0  # the random policy writes control tokens the grammar rejects: the term has work
    assert trl_log["sup/unlikely_tokens"] == our_log["sup/unlikely_tokens"] == n_marked
    assert trl_log["sup/unlikelihood"] == pytest.approx(our_log["sup/unlikelihood"], rel=1e-5)
    assert trl_log["toy/nll"] == pytest.approx(our_log["toy/nll"], rel=1e-5)
    assert trl_log["toy/turns"] == our_log["toy/turns"] > 0
    keys = lambda log: sorted(k for k in log if k.startswith(("sup/", "toy/")))  # noqa: E731
    assert keys(trl_log) == keys(our_log) == ["sup/unlikelihood", "sup/unlikely_tokens", "toy/nll", "toy/turns"]


@pytest.mark.parametrize("steps_per_generation, accumulation, prompts, steps, after", [
    (2, 1, 4, 4, [2, 4]),  # two optimizer steps a generation batch: after each batch's second
    pytest.param(3, 2, 6, 3, [2, 3], marks=pytest.mark.slow),  # batches of 3 micro-batches, optimizer steps of 2:
                                                                # batch 1 ends inside step 2, batch 2 with step 3
])
def test_a_signal_s_after_update_runs_once_a_generation_batch_is_trained(
        tmp_path, tiny_checkpoint, steps_per_generation, accumulation, prompts, steps, after):
    """Each generation batch's Step gets its `after_update` once, after the optimizer step that holds its last
    micro-batch (also where the accumulation steps do not line up with the batches), and its metrics reach
    that step's log."""
    from transformers import AutoTokenizer

    from toolcollapse.config import load_config
    from toolcollapse.integrations.trl import MonitoredGRPOTrainer, engine_rollouts, episode_success, task_dataset
    from toolcollapse.model import load_model

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150",
                                               "rollout.max_turns=2", "rollout.max_new_tokens=12"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tasks = _tasks(cfg, prompts)
    toy = Recording(cfg)
    toy.trainer = MonitoredGRPOTrainer(
        model=load_model(tiny_checkpoint), reward_funcs=episode_success, processing_class=tokenizer,
        args=_tool_world_args(tmp_path, num_generations=4, per_device_train_batch_size=4, max_steps=steps,
                              steps_per_generation=steps_per_generation, gradient_accumulation_steps=accumulation),
        train_dataset=task_dataset(cfg, "train", prompts), signals=[toy],
        rollout_func=engine_rollouts(cfg, tokenizer, tasks=tasks))
    toy.trainer.train()
    assert len(toy.steps) == 2  # two generation batches
    assert toy.after == list(zip(after, toy.steps))
    logs = [r for r in toy.trainer.state.log_history if "loss" in r]
    assert [r["step"] for r in logs if "toy/turns" in r] == after
    assert [r["toy/turns"] for r in logs if "toy/turns" in r] == [
        sum(len(ep.turns) for ep in step.episodes) for step in toy.steps]


def test_unlikelihood_is_a_mean_over_the_optimizer_step_under_gradient_accumulation(tmp_path, tiny_checkpoint):
    """One generation batch of 8 rows trained as one micro-batch or as two accumulated ones: the same gradient
    (to 1e-5), as our update's unlikelihood is a mean over the optimizer step's rejected tokens, however its
    micro-batches split them. The two micro-batches hold different counts, so a mean per micro-batch, averaged
    over them, would not be."""
    from transformers import AutoTokenizer, TrainerCallback

    from toolcollapse.config import load_config
    from toolcollapse.integrations.trl import MonitoredGRPOTrainer, engine_rollouts, episode_success, task_dataset
    from toolcollapse.model import load_model

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150",
                                               "rollout.max_turns=3", "rollout.max_new_tokens=24"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)

    class Gradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    class Counting(MonitoredGRPOTrainer):
        def _term_losses(self, inputs, logp, old):
            self.marked = [*getattr(self, "marked", []), int(inputs["unlikely"].sum())]
            return super()._term_losses(inputs, logp, old)

    def gradient(path, **split):
        grads = Gradients()
        trainer = _keeping(Counting)(
            model=load_model(tiny_checkpoint), reward_funcs=episode_success, processing_class=tokenizer,
            args=_tool_world_args(path, num_generations=4, max_grad_norm=0.0, **split),
            train_dataset=task_dataset(cfg, "train", 2), callbacks=[grads], unlikelihood_coef=5.0,
            rollout_func=engine_rollouts(cfg, tokenizer, tasks=_tasks(cfg)))
        trainer.train()
        return trainer, grads.grads

    whole, g_whole = gradient(tmp_path / "whole", per_device_train_batch_size=8)
    split, g_split = gradient(tmp_path / "split", per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert torch.equal(whole.saved[1]["completion_ids"], split.saved[1]["completion_ids"])  # the same rollouts
    assert len(split.marked) == 2 and sum(split.marked) == whole.marked[0] > 0
    assert split.marked[0] != split.marked[1]  # a mean per micro-batch would weigh their tokens differently
    assert whole.state.log_history[0]["sup/unlikely_tokens"] == split.state.log_history[0]["sup/unlikely_tokens"]
    assert (g_split - g_whole).norm() <= 1e-5 * g_whole.norm()



@pytest.mark.slow
def test_with_two_passes_over_a_batch_trl_logs_unlikelihood_of_the_last_pass_as_ours(tmp_path, tiny_checkpoint):
    """num_iterations 2 (ours: grpo.updates_per_batch): two optimizer steps on one generation batch; as our
    update, unlikelihood's sums count the last pass only -- its rejected tokens once, not twice."""
    from transformers import AutoTokenizer

    from toolcollapse.config import load_config
    from toolcollapse.integrations.trl import MonitoredGRPOTrainer, engine_rollouts, episode_success, task_dataset
    from toolcollapse.model import load_model

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150",
                                               "rollout.max_turns=3", "rollout.max_new_tokens=24"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    trainer = _keeping(MonitoredGRPOTrainer)(
        model=load_model(tiny_checkpoint), reward_funcs=episode_success, processing_class=tokenizer,
        args=_tool_world_args(tmp_path, num_generations=4, num_iterations=2, max_steps=2),
        train_dataset=task_dataset(cfg, "train", 2), unlikelihood_coef=0.5,
        rollout_func=engine_rollouts(cfg, tokenizer, tasks=_tasks(cfg)))
    trainer.train()
    marked = int(trainer.saved[1]["unlikely"].sum())
    first, second = (r for r in trainer.state.log_history if "loss" in r)
    assert marked > 0 and "sup/unlikely_tokens" not in first and second["sup/unlikely_tokens"] == marked

def _tasks(cfg, n=2):
    from toolcollapse.envs import make_env

    return make_env(cfg).tasks("train")[:n]


@pytest.mark.slow
def test_the_sft_term_and_unlikelihood_signals_set_trl_s_own_terms(tmp_path, tiny_checkpoint):
    """`signals=[SFTTermSignal(cfg), UnlikelihoodSignal(cfg)]` -- the objects `toolcollapse rl` builds -- run
    their terms on TRL's own batches (the reference column; its rejected controls) with the config's weights:
    the same logs and the same weights as `sft_coef=0.5, unlikelihood_coef=0.25`; with the weights swapped,
    not the same."""
    from transformers import AutoTokenizer

    from toolcollapse.config import load_config
    from toolcollapse.integrations.trl import MonitoredGRPOTrainer, engine_rollouts, episode_success, task_dataset
    from toolcollapse.model import load_model
    from toolcollapse.signals import SFTTermSignal, UnlikelihoodSignal

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150",
                                               "rollout.max_turns=3", "rollout.max_new_tokens=24",
                                               "supervision.sft_coef=0.5", "supervision.unlikelihood_coef=0.25"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tasks = _tasks(cfg)
    data = task_dataset(cfg, "train", 2)
    data = data.add_column("reference", [f"The answer is {t.answer}.<|im_end|>" for t in tasks])

    def train(path, **supervision):
        model = load_model(tiny_checkpoint)
        trainer = MonitoredGRPOTrainer(
            model=model, reward_funcs=episode_success, processing_class=tokenizer, train_dataset=data,
            args=_tool_world_args(path, num_generations=4, learning_rate=1e-3),
            rollout_func=engine_rollouts(cfg, tokenizer, tasks=tasks), **supervision)
        trainer.train()
        return trainer.state.log_history[0], model.state_dict()

    own_log, own = train(tmp_path / "own", sft_coef=0.5, unlikelihood_coef=0.25)
    log, weights = train(tmp_path / "signals", signals=[SFTTermSignal(cfg), UnlikelihoodSignal(cfg)])
    _, swapped = train(tmp_path / "swapped", sft_coef=0.25, unlikelihood_coef=0.5)
    keys = sorted(k for k in own_log if k.startswith("sup/"))
    assert keys == ["sup/sft_nll", "sup/sft_tokens", "sup/sft_tokens_total", "sup/unlikelihood", "sup/unlikely_tokens"]
    assert {k: log[k] for k in keys} == {k: own_log[k] for k in keys} and own_log["sup/sft_tokens"] > 0
    assert all(torch.equal(weights[k], own[k]) for k in own)
    assert any(not torch.equal(swapped[k], own[k]) for k in own)


def test_trl_refuses_a_signal_term_it_cannot_run(tmp_path, tiny_checkpoint):
    """A term with a per-token loss of its own (not the expert rows' `expert_loss`) is not run in TRL's update: the
    first batch stops with an error naming the term; a signal that needs our loop's `start` is refused at once."""
    from transformers import AutoTokenizer

    from toolcollapse.config import load_config
    from toolcollapse.envs import make_env
    from toolcollapse.integrations.trl import MonitoredGRPOTrainer, engine_rollouts, episode_success, task_dataset
    from toolcollapse.model import load_model
    from toolcollapse.signals import ETS, HBG, OPS, LossTerm, LuffyShaping, SFTTermSignal

    class Reweighting(LossTerm):
        def token_loss(self, pg, logp, adv, mb, seq_ids):
            return 2 * pg

    class Shaping(Toy):
        def terms(self, step):
            return [Reweighting()]

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150",
                                               "rollout.max_turns=2", "rollout.max_new_tokens=8", "supervision.sft_coef=0.5"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)

    def trainer(signal):
        return MonitoredGRPOTrainer(
            model=load_model(tiny_checkpoint), reward_funcs=episode_success,
            args=_tool_world_args(tmp_path, num_generations=4), train_dataset=task_dataset(cfg, "train", 2),
            processing_class=tokenizer, signals=[signal],
            rollout_func=engine_rollouts(cfg, tokenizer, tasks=make_env(cfg).tasks("train")[:2]))

    class TwoShapings(Toy):
        def terms(self, step):
            return [LuffyShaping(0.1), LuffyShaping(0.2)]

    with pytest.raises(ValueError, match="Reweighting defines \\['token_loss'\\]"):
        trainer(Shaping(cfg)).train()
    with pytest.raises(ValueError, match="more than one term reshapes the expert rows' loss"):
        trainer(TwoShapings(cfg)).train()
    with pytest.raises(ValueError, match="ETS needs our loop's \\['start'\\].*ETS and PRS are train_interleaved's"):
        trainer(ETS(load_config("configs/tiny_rl.yaml", ["supervision.ets.enabled=true"])))
    with pytest.raises(ValueError, match="sft_coef from both SFTTermSignal and the trainer's sft_coef: pick one"):
        MonitoredGRPOTrainer(model=load_model(tiny_checkpoint), reward_funcs=episode_success,
                             args=_tool_world_args(tmp_path, num_generations=4), processing_class=tokenizer,
                             train_dataset=task_dataset(cfg, "train", 2), sft_coef=0.5, signals=[SFTTermSignal(cfg)])
    ops = load_config("configs/tiny_rl.yaml", ["supervision.ops.enabled=true", "supervision.hbg.enabled=true"])
    with pytest.raises(ValueError, match="expert rows from both OPS and the trainer's ops: pick one"):
        MonitoredGRPOTrainer(model=load_model(tiny_checkpoint), reward_funcs=episode_success,
                             args=_tool_world_args(tmp_path, num_generations=4), processing_class=tokenizer,
                             train_dataset=task_dataset(cfg, "train", 2), ops=1, signals=[OPS(ops)],
                             rollout_func=engine_rollouts(cfg, tokenizer, tasks=make_env(cfg).tasks("train")[:2]))
    with pytest.raises(ValueError, match="HBG's hinted rows sample from its own prompt: that needs rollout_func"):
        MonitoredGRPOTrainer(model=load_model(tiny_checkpoint), reward_funcs=episode_success,
                             args=_tool_world_args(tmp_path, num_generations=4), processing_class=tokenizer,
                             train_dataset=task_dataset(cfg, "train", 2), signals=[HBG(ops)])


@pytest.mark.slow
def test_the_ops_and_hbg_signal_objects_run_in_trl_as_its_ops_and_hbg_rows(tmp_path, tiny_checkpoint):
    """`signals=[OPS(cfg), HBG(cfg)]` -- the objects `toolcollapse rl` builds -- lay out TRL's groups from their
    `rows()` and shape the expert rows with OPS's own term (`LuffyShaping.expert_loss`), the hinted rows sampled
    from the HBG signal's prompt: the same rows, logs and weights as the trainer's own `ops=1, hbg=1`."""
    from transformers import AutoTokenizer

    from toolcollapse.config import load_config
    from toolcollapse.envs import make_env
    from toolcollapse.integrations.trl import MonitoredGRPOTrainer, engine_rollouts, episode_success, task_dataset
    from toolcollapse.model import load_model
    from toolcollapse.signals import HBG, OPS

    class Hinting(HBG):
        calls = 0

        def hinted(self, task):
            Hinting.calls += 1
            return super().hinted(task)

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150",
                                               "rollout.max_turns=8", "rollout.max_new_tokens=96",
                                               "supervision.ops.enabled=true", "supervision.ops.gamma=0.3",
                                               "supervision.hbg.enabled=true", "supervision.hbg.rows=1"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tasks = make_env(cfg).tasks("train")[:2]

    def train(path, **supervision):
        model = load_model(tiny_checkpoint)
        trainer = _keeping(MonitoredGRPOTrainer)(
            model=model, reward_funcs=episode_success, args=_tool_world_args(path, num_generations=4, learning_rate=1e-3),
            train_dataset=task_dataset(cfg, "train", 2), processing_class=tokenizer,
            rollout_func=engine_rollouts(cfg, tokenizer, tasks=tasks), **supervision)
        trainer.train()
        return trainer, model.state_dict()

    own, own_weights = train(tmp_path / "own", ops=1, hbg=1, luffy_gamma=0.3)
    by_signal, signal_weights = train(tmp_path / "signals", signals=[OPS(cfg), Hinting(cfg)])
    assert Hinting.calls == 2  # one hinted row a task, from the signal's own prompt
    assert by_signal.saved[1]["expert"].tolist() == own.saved[1]["expert"].tolist() == [False, False, False, True] * 2
    assert by_signal.saved[1]["hinted"].tolist() == own.saved[1]["hinted"].tolist() == [False, False, True, False] * 2
    assert torch.equal(by_signal.saved[1]["completion_ids"], own.saved[1]["completion_ids"])
    a, b = own.state.log_history[0], by_signal.state.log_history[0]
    assert a["sup/expert_rows"] == b["sup/expert_rows"] == 2 and a["sup/hinted_rows"] == b["sup/hinted_rows"] == 2
    assert a["reward"] > 0 and a["sup/expert_luffy_loss"] == b["sup/expert_luffy_loss"] != 0  # the replayed rows solve
    start = load_model(tiny_checkpoint).state_dict()
    assert any(not torch.equal(own_weights[k], start[k]) for k in start)  # the step trained
    assert all(torch.equal(own_weights[k], signal_weights[k]) for k in start)
