"""GRPO through TRL's GRPOTrainer with toolcollapse's monitor and supervision signals, on one of our
environments (the tool world, BFCL multi-turn): a complete script, on a laptop CPU or N GPUs.

    pip install -e '.[trl]'
    # CPU, minutes: the default tiny checkpoint (toolcollapse sft --config configs/tiny.yaml) in TRL's own
    # multi-turn tool loop, the probe every 3 steps (monitor.probe_every), alarms -> <out>/alarms.jsonl
    python examples/trl_grpo.py --checkpoint runs/tiny/sft --out runs/trl/tiny --steps 20
    # our rollout engine inside TRL (rollout_func), one OPS row per group (the ground truth, replayed)
    python examples/trl_grpo.py --checkpoint runs/tiny/sft --out runs/trl/ops --rollouts engine --ops 1
    # ETS/PRS: GRPO rounds and SFTTrainer phases on the failed tasks, with PRS's reflections
    python examples/trl_grpo.py --checkpoint runs/tiny/sft --out runs/trl/prs --rounds 3 --steps 4 --prs reflection
    # BFCL multi-turn on 8 GPUs, ZeRO-3 (its later user turns need our engine: TRL's loop ends at a reply)
    accelerate launch --config_file configs/trl/zero3.yaml --num_processes 8 examples/trl_grpo.py \
        --checkpoint /path/to/Qwen2.5-1.5B-Instruct --config configs/paper/qwen2.5-1.5b-bfcl.yaml \
        --rollouts engine --bf16 --out runs/trl/bfcl
    toolcollapse diagnose runs/trl/tiny    # the monitor's series and alarms, as for one of our runs

The run config (`--config`, default the checkpoint's own toolcollapse.yaml, else configs/tiny_rl.yaml; `--set`
overrides) gives the environment, the rollout limits (with `--rollouts engine`; TRL's tool loop has one
budget for a whole rollout, here 2 x turns x tokens per turn), the monitor (probe, alarm rules,
`monitor.on_alarm`) and the GRPO settings TRL takes from it: steps, lr, KL coefficient, clip (not the dual
clip: TRL has none), group size, prompts per step (per process), micro-batch size (gradient accumulation
over one generation: one optimizer step per step, as `rl`), temperature, seed. The tasks are `rl`'s order
of the training split, cycled.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a toolcollapse checkpoint or a Hugging Face model directory")
    ap.add_argument("--config", help="run config (default: the checkpoint's toolcollapse.yaml, else configs/tiny_rl.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--out", required=True, help="TRL's output_dir: checkpoints, monitor.jsonl, alarms.jsonl")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps, per round with --rounds (default grpo.steps)")
    ap.add_argument("--rollouts", choices=("tool_loop", "engine"), default="tool_loop",
                    help="TRL's own tool loop (environment_factory; the tool world) or our engine (rollout_func)")
    ap.add_argument("--ops", type=int, default=0, help="OPS: ground-truth rows per group (needs --rollouts engine)")
    ap.add_argument("--rounds", type=int, default=0, help="ETS/PRS: rounds of --steps GRPO steps, each then SFT")
    ap.add_argument("--window", type=int, default=None, help="ETS/PRS: failures of the round's last N steps")
    ap.add_argument("--prs", choices=("none", "reflection", "correction"), default="none")
    ap.add_argument("--sft-lr", type=float, default=1e-4, help="the SFT phases' learning rate")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--vllm", choices=("off", "colocate", "server"), default="off",
                    help="TRL's vLLM generation (tool loop only; server: start `VLLM_SERVER_DEV_MODE=1 vllm serve "
                         "CHECKPOINT` first, see docs/TRL.md)")
    args = ap.parse_args()

    from accelerate import PartialState
    from trl import GRPOConfig, SFTConfig, SFTTrainer

    from toolcollapse.chat import CHAT_TEMPLATE
    from toolcollapse.config import load_config
    from toolcollapse.envs import make_env
    from toolcollapse.integrations.trl import (ControlTokenCallback, MonitoredGRPOTrainer, engine_rollouts,
                                               episode_success, rl_phase_data, task_rows, tool_world_environment,
                                               tool_world_reward, train_interleaved)
    from toolcollapse.model import load_model, load_tokenizer
    from toolcollapse.rl import task_order

    own = Path(args.checkpoint) / "toolcollapse.yaml"
    config = args.config or (own if own.is_file() else "configs/tiny_rl.yaml")
    cfg = load_config(config, [f"init={args.checkpoint}", *args.set])
    env = make_env(cfg)
    if args.vllm != "off" and args.rollouts == "engine":
        ap.error("--vllm with --rollouts engine: our engine generates with the trained model itself, not vLLM")
    if args.rollouts == "tool_loop" and (cfg.env != "toolworld" or args.ops):
        ap.error("BFCL and OPS need --rollouts engine (TRL's tool loop ends a rollout at the first reply without a "
                 "call, and has no place for a replayed ground truth)")
    tokenizer, model = load_tokenizer(args.checkpoint), load_model(args.checkpoint)
    g = cfg.grpo
    steps = args.steps or g.steps
    per_round = steps * g.prompts_per_step * PartialState().num_processes  # every process its own prompts
    order = task_order(env.tasks(g.split), cfg.seed)  # rl's order, cycled as rl cycles it; TRL keeps it (no shuffle)
    tasks = [order[i % len(order)] for i in range(per_round * max(1, args.rounds))]
    if args.rollouts == "engine":
        data = task_rows(tasks)
        rollout = dict(reward_funcs=episode_success, rollout_func=engine_rollouts(cfg, tokenizer, tasks=tasks),
                       ops=args.ops)
    else:  # our own model: its system prompt documents the tools (its chat template does not render them)
        data = task_rows(tasks, system_prompt=tokenizer.chat_template == CHAT_TEMPLATE)
        rollout = dict(reward_funcs=tool_world_reward, environment_factory=tool_world_environment(cfg),
                       call_end=cfg.rollout.call_end)
    # one generation of prompts_per_step x G rollouts a process, trained in micro-batches of grpo.micro_batch_size
    # rows, one optimizer step (as rl): TRL generates per_device x steps_per_generation (= accumulation) rows at once
    rows = g.prompts_per_step * g.group_size
    micro = g.micro_batch_size if rows % g.micro_batch_size == 0 else rows
    grpo_args = GRPOConfig(
        output_dir=args.out, max_steps=steps, learning_rate=g.lr, beta=g.kl_coef, epsilon=g.clip_low,
        epsilon_high=g.clip_high, num_generations=g.group_size, per_device_train_batch_size=micro,
        gradient_accumulation_steps=rows // micro,
        temperature=cfg.rollout.temperature,  # TRL's tool loop: one budget for all turns and the tool replies
        max_completion_length=min(cfg.model.max_seq_len, 2 * cfg.rollout.max_turns * cfg.rollout.max_new_tokens),
        max_tool_calling_iterations=cfg.rollout.max_turns - 1, loss_type="dapo", shuffle_dataset=False, seed=cfg.seed,
        logging_steps=1, save_strategy="no", report_to="none", bf16=args.bf16, use_cpu=not _cuda(),
        gradient_checkpointing=False, use_vllm=args.vllm != "off", vllm_mode="colocate" if args.vllm == "off" else args.vllm)
    monitor = ControlTokenCallback.for_tool_world(cfg, tokenizer)

    def make_grpo(round_: int = 0) -> MonitoredGRPOTrainer:
        part = data.select(range(round_ * per_round, (round_ + 1) * per_round))  # each round its own tasks
        return MonitoredGRPOTrainer(model=model, args=grpo_args, train_dataset=part, processing_class=tokenizer,
                                    monitor=monitor, tool_specs=env.tool_table if cfg.env == "toolworld" else None,
                                    **rollout)

    if not args.rounds:
        make_grpo().train()
    else:
        def make_sft(dataset) -> SFTTrainer:
            sft_args = SFTConfig(output_dir=str(Path(args.out) / "sft"), num_train_epochs=1, learning_rate=args.sft_lr,
                                 per_device_train_batch_size=4, max_length=None, save_strategy="no", report_to="none",
                                 bf16=args.bf16, use_cpu=not _cuda(), seed=cfg.seed, logging_steps=1)
            return SFTTrainer(model=model, args=sft_args, train_dataset=dataset, processing_class=tokenizer)

        phases = train_interleaved(make_grpo, make_sft, args.rounds, args.window or steps, args.out,
                                   rl_phase_data(cfg, tokenizer, None if args.prs == "none" else args.prs,
                                                 call_end=cfg.rollout.call_end))
        for p in phases:
            print(p)
    print(f"alarms: {len(monitor.alarms)}; toolcollapse diagnose {args.out}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
