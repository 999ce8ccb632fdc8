"""One GRPO step: toolcollapse vs TRL's GRPOTrainer, same model, batch, group and lengths.

Single-turn task (TRL's GRPOTrainer is single-turn): the tool world's prompts
(system prompt with the tool docs + question), one assistant turn each, stopped at
`</tool_call>`, `<|im_end|>` or 64 tokens on both sides; 8 prompts x G = 8, temperature
1, KL coefficient 1e-4 against a frozen reference (both keep one), clip 0.2, one
optimizer step per batch, the whole batch in one forward/backward. TRL runs on CPU
with `use_cpu=True, bf16=False, gradient_checkpointing=False`. The reward (1 for a
healthy tool call) only has to be the same on both sides: it does not change the work.

Prints the median wall time of a step (rollout + update; the first step of each side
is warm-up and not counted), the mean completion length of each side, and the ratio.

    pip install -e '.[bench]'   # TRL is not a dependency of toolcollapse itself
    python bench/grpo_step_vs_trl.py --checkpoint runs/tiny/sft --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from toolcollapse.config import load_config
from toolcollapse.rl import run_rl
from toolcollapse.runtime import read_jsonl

PROMPTS, GROUP, MAX_NEW = 8, 8, 64


def ours(checkpoint: str, steps: int, threads: int) -> tuple[list[float], float]:
    overrides = [f"init={checkpoint}", f"threads={threads}", "rollout.max_turns=1", f"rollout.max_new_tokens={MAX_NEW}",
                 f"rollout.batch_size={PROMPTS * GROUP}", f"grpo.steps={steps}", f"grpo.prompts_per_step={PROMPTS}",
                 f"grpo.group_size={GROUP}", f"grpo.micro_batch_size={PROMPTS * GROUP}", "grpo.kl_coef=1.0e-4",
                 "grpo.checkpoint_every=1000", "grpo.format_reward=1.0", "monitor.probe_every=0"]
    cfg = load_config(Path(checkpoint) / "toolcollapse.yaml", overrides)
    with tempfile.TemporaryDirectory() as tmp:
        run_rl(cfg, Path(tmp) / "rl")
        rows = read_jsonl(Path(tmp) / "rl" / "metrics.jsonl")
    return [r["seconds"] for r in rows[1:]], statistics.mean(r["response_tokens"] for r in rows)


def trl(checkpoint: str, steps: int, threads: int) -> tuple[list[float], float]:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from toolcollapse.chat import STOP_TAGS, render_text
    from toolcollapse.envs import make_env
    from toolcollapse.model import load_model
    from toolcollapse.parser import parse_turn

    torch.set_num_threads(threads)
    cfg = load_config(Path(checkpoint) / "toolcollapse.yaml")
    env = make_env(cfg)
    tasks = env.tasks("train")[:PROMPTS * steps]
    data = Dataset.from_dict({"prompt": [render_text(t.prompt, add_generation_prompt=True) for t in tasks]})
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tools = env.reset(tasks[0]).tools

    def healthy_call(completions, **_):
        return [float(parse_turn(c, tools).state.value == "healthy_call") for c in completions]

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    timer = Timer()
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=tmp, use_cpu=True, bf16=False, gradient_checkpointing=False,
                          per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
                          max_completion_length=MAX_NEW, temperature=1.0, beta=1e-4, epsilon=0.2,
                          learning_rate=1e-4, max_steps=steps, logging_steps=1, report_to="none",
                          save_strategy="no", loss_type="dapo", seed=0,
                          generation_kwargs={"eos_token_id": [tokenizer.convert_tokens_to_ids(t) for t in STOP_TAGS]})
        trainer = GRPOTrainer(model=load_model(checkpoint), reward_funcs=healthy_call, args=args,
                              train_dataset=data, processing_class=tokenizer, callbacks=[timer])
        trainer.train()
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return timer.times[1:], statistics.mean(lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="runs/tiny/sft")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    ours_t, ours_len = ours(args.checkpoint, args.steps, args.threads)
    trl_t, trl_len = trl(args.checkpoint, args.steps, args.threads)
    o, t = statistics.median(ours_t), statistics.median(trl_t)
    print(f"{PROMPTS} prompts x G={GROUP}, <= {MAX_NEW} new tokens, {args.threads} threads, "
          f"median of {args.steps - 1} steps after one warm-up step")
    print(f"toolcollapse: {o:.2f} s/step (mean completion {ours_len:.1f} tokens)  steps {[round(x, 2) for x in ours_t]}")
    print(f"TRL GRPOTrainer: {t:.2f} s/step (mean completion {trl_len:.1f} tokens)  steps {[round(x, 2) for x in trl_t]}")
    print(f"TRL time / toolcollapse time: {t / o:.2f}x")


if __name__ == "__main__":
    main()
