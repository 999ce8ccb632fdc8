"""Multi-turn GRPO steps: toolcollapse's `rl` vs TRL's GRPOTrainer running the tool world through its own
tool loop (`environment_factory`), and the integration's overhead on TRL's step -- side by side in one run.

Same checkpoint, same tasks in the same order (`rl.task_order` of the train split; TRL's dataset holds them
in that order, unshuffled), the study configuration: 4 prompts x G 8, temperature 1, KL 1e-4 to a frozen
reference on both sides, clip 0.2, lr 1e-5, one optimizer step per batch, reward 1 for a solved task. TRL
runs our model in its own chat format (`speak_toolcollapse_chat`: Qwen's call parser, `</tool_call>` ends a
turn, the tool reply after the template's <|im_end|>), so both sides show the model the same tokens:
checked first, greedy, episode for episode. Lengths: ours stops a rollout after 8 turns of 64 tokens; TRL
after 8 generations (`max_tool_calling_iterations` 7) within `max_completion_length` tokens in all (tool
replies included), with no per-turn cap -- the mean sampled tokens per rollout of each side are printed.

Four sides, each `--steps` steps (the first is warm-up, not counted), `--rounds` times in alternating order:
  ours        `toolcollapse rl` (probe off; the update forward's control-token statistics on, as by default)
  trl         GRPOTrainer (only the chat-format adaptation above)
  trl+tc      MonitoredGRPOTrainer (ctrl/*, the four states) + ControlTokenCallback (probe of 32 oracle
              conversations at its default interval, 2 steps; alarm rules)
  trl+engine  trl+tc with our rollout engine as TRL's `rollout_func` (`engine_rollouts`) instead of its tool loop
trl and trl+tc sample the same rollouts (the probe draws no random numbers): checked by their rewards.

    pip install -e '.[trl]'
    python bench/grpo_multiturn_vs_trl.py --checkpoint runs/tiny/sft --steps 5 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from toolcollapse.config import load_config
from toolcollapse.envs import make_env
from toolcollapse.evaluate import sampling_params
from toolcollapse.model import load_model, load_tokenizer
from toolcollapse.rl import run_rl, task_order
from toolcollapse.rollout import RolloutEngine
from toolcollapse.runtime import read_jsonl

PROMPTS, GROUP, TURNS, TURN_TOKENS, BUDGET = 4, 8, 8, 64, 1024
STUDY = [f"grpo.prompts_per_step={PROMPTS}", f"grpo.group_size={GROUP}", f"rollout.max_turns={TURNS}",
         f"rollout.max_new_tokens={TURN_TOKENS}", "rollout.temperature=1.0", "grpo.lr=1.0e-5", "grpo.kl_coef=1.0e-4",
         "grpo.clip_low=0.2", "grpo.clip_high=0.2", "grpo.eval_every=0", "grpo.checkpoint_every=1000",
         "threads=1"]


def config(checkpoint: str, steps: int = 1, extra: tuple[str, ...] = ()):
    return load_config("configs/tiny_rl.yaml", [f"init={checkpoint}", f"grpo.steps={steps}", *STUDY, *extra])


def ours(checkpoint: str, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        run_rl(config(checkpoint, steps, ("monitor.probe_every=0",)), Path(tmp) / "rl")
        return read_jsonl(Path(tmp) / "rl" / "metrics.jsonl")


def trl_trainer(checkpoint: str, steps: int, out: str, monitored: bool, greedy: bool = False, tasks=None,
                engine: bool = False):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from toolcollapse.integrations.trl import (ControlTokenCallback, MonitoredGRPOTrainer, engine_rollouts,
                                               episode_success, speak_toolcollapse_chat, tool_world_environment,
                                               tool_world_reward)

    cfg = config(checkpoint, steps)
    env = make_env(cfg)
    tasks = tasks or task_order(env.tasks("train"), cfg.seed)[:PROMPTS * steps]
    data = Dataset.from_list([{"prompt": [{"role": m.role, "content": m.content} for m in t.prompt], "task_id": t.id}
                              for t in tasks])
    tokenizer, model = load_tokenizer(checkpoint), load_model(checkpoint)
    args = GRPOConfig(output_dir=out, use_cpu=True, bf16=False, gradient_checkpointing=False,
                      per_device_train_batch_size=len(tasks) * 2 if greedy else PROMPTS * GROUP,
                      num_generations=2 if greedy else GROUP, max_completion_length=BUDGET,
                      max_tool_calling_iterations=TURNS - 1, temperature=1.0, beta=1e-4, epsilon=0.2,
                      learning_rate=0.0 if greedy else 1e-5, loss_type="dapo", max_steps=steps, logging_steps=1,
                      report_to="none", save_strategy="no", seed=0, shuffle_dataset=False,
                      generation_kwargs={"do_sample": False} if greedy else None)
    common = dict(reward_funcs=tool_world_reward, args=args, train_dataset=data, processing_class=tokenizer,
                  environment_factory=tool_world_environment(cfg))
    if engine:
        common.update(reward_funcs=episode_success, environment_factory=None,
                      rollout_func=engine_rollouts(cfg, tokenizer, tasks=tasks))
    if monitored:
        return MonitoredGRPOTrainer(model=model, tool_specs=env.tool_table, monitor=ControlTokenCallback.for_tool_world(
            cfg, tokenizer), **common)
    call_end = speak_toolcollapse_chat(tokenizer, model)

    class Bare(GRPOTrainer):  # TRL's trainer, speaking our chat format and nothing more
        def _get_tool_suffix_ids(self, tool_messages):
            return [call_end, *super()._get_tool_suffix_ids(tool_messages)]

    return Bare(model=model, **common)


def greedy_identical(checkpoint: str, n: int = 8) -> tuple[int, int]:
    """TRL's tool loop vs our engine, greedy, on `n` train tasks: episodes equal token for token (ids and
    loss masks)."""
    cfg = config(checkpoint)
    env = make_env(cfg)
    tasks = env.tasks("train")[:n]
    engine = RolloutEngine(load_model(checkpoint).eval(), load_tokenizer(checkpoint), env)
    mine = {e.task_id: e for e in engine.generate(tasks, sampling_params(cfg, greedy=True))}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trl_trainer(checkpoint, 1, tmp, monitored=True, greedy=True, tasks=tasks)
        saved = {}
        generate = trainer._generate_and_score_completions

        def keep(inputs):
            saved["inputs"], saved["out"] = inputs, generate(inputs)
            return saved["out"]

        trainer._generate_and_score_completions = keep
        trainer.train()
    out, equal = saved["out"], 0
    for i, x in enumerate(saved["inputs"]):
        ep, sampled = mine[x["task_id"]], out["completion_mask"][i].bool()
        equal += (out["completion_ids"][i][sampled].tolist() == ep.tokens[ep.prompt_len:]
                  and out["tool_mask"][i][sampled].tolist() == ep.loss_mask[ep.prompt_len:])
    return equal, len(saved["inputs"])


def trl(checkpoint: str, steps: int, monitored: bool, engine: bool = False) -> list[dict]:
    from transformers import TrainerCallback

    class Timer(TrainerCallback):  # the whole step: generation, tools, rewards, update (and the probe)
        def __init__(self):
            self.t0, self.seconds = 0.0, []

        def on_step_begin(self, *args, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.seconds.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as tmp:
        trainer = trl_trainer(checkpoint, steps, tmp, monitored, engine=engine)
        timer = Timer()
        trainer.callback_handler.callbacks.insert(0, timer)  # before the monitor's probe: the probe is timed
        trainer.train()
        logs = [h for h in trainer.state.log_history if "reward" in h]
    return [{"seconds": s, "reward_mean": h["reward"], "response_tokens": h["completions/mean_length"],
             "healthy_rate": h.get("healthy_rate")} for s, h in zip(timer.seconds, logs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="runs/tiny/sft")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    equal, n = greedy_identical(args.checkpoint)
    print(f"greedy, TRL's tool loop vs our engine: {equal}/{n} rollouts identical (ids and loss masks)")
    sides = {"ours": lambda: ours(args.checkpoint, args.steps),
             "trl": lambda: trl(args.checkpoint, args.steps, False),
             "trl+tc": lambda: trl(args.checkpoint, args.steps, True),
             "trl+engine": lambda: trl(args.checkpoint, args.steps, True, engine=True)}
    runs: dict[str, list[list[dict]]] = {name: [] for name in sides}
    for k in range(args.rounds):
        for name in (list(sides) if k % 2 == 0 else list(reversed(sides))):
            torch.manual_seed(0)
            runs[name].append(sides[name]())
    same = all([r["reward_mean"] for r in a] == [r["reward_mean"] for r in b]
               for a, b in zip(runs["trl"], runs["trl+tc"]))
    print(f"{PROMPTS} prompts x G {GROUP}, {args.steps} steps x {args.rounds} rounds, 1 thread; "
          f"trl and trl+tc sampled the same rollouts (rewards per step equal): {same}")
    mean = {}
    for name, rows in runs.items():
        timed = [r["seconds"] for run in rows for r in run[1:]]
        mean[name] = statistics.mean(timed)
        tokens = statistics.mean(r["response_tokens"] for run in rows for r in run)
        reward = statistics.mean(r["reward_mean"] for run in rows for r in run)
        healthy = [r["healthy_rate"] for run in rows for r in run if r["healthy_rate"] is not None]
        print(f"  {name:10s} {mean[name]:6.2f} s/step (per round: "
              f"{[round(statistics.mean(r['seconds'] for r in run[1:]), 2) for run in rows]}), sampled tokens per "
              f"rollout {tokens:.1f}, reward {reward:.3f}, healthy turns "
              f"{f'{statistics.mean(healthy):.3f}' if healthy else '(not measured)'}")
    print(f"TRL time / ours: {mean['trl'] / mean['ours']:.2f}x")
    print(f"the integration's overhead on TRL's step: {100 * (mean['trl+tc'] / mean['trl'] - 1):+.1f} %")
    print(f"TRL's step with our engine as its rollout_func: {mean['trl+tc'] / mean['trl+engine']:.2f}x faster than "
          f"with its tool loop; ours / it: {mean['trl+engine'] / mean['ours']:.2f}x")
    print(f"({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
