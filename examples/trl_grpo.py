"""GRPO through TRL's GRPOTrainer with toolcollapse's monitor and supervision signals, on one of our
environments (the tool world, BFCL multi-turn): a complete script, on a laptop CPU or N GPUs.

    pip install -e '.[trl]'
    # CPU, minutes: the default tiny checkpoint (toolcollapse sft --config configs/tiny.yaml) in TRL's own
    # multi-turn tool loop, the probe every 3 steps (monitor.probe_every), alarms -> <out>/alarms.jsonl
    python examples/trl_grpo.py --checkpoint runs/tiny/sft --out runs/trl/tiny --steps 20
    # your own data: JSON-lines chat conversations, their first turns as targets, the probe built from them
    python examples/trl_grpo.py --checkpoint runs/tiny/sft --out runs/trl/mine --data examples/data/conversations.jsonl
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
of the training split, cycled. Its supervision is honoured: the SFT term (`supervision.sft_coef`, on each
task's ground-truth first turn), unlikelihood, OPS and HBG rows (`--rollouts engine`), ETS / PRS rounds
(`supervision.ets.every` steps each, then an SFTTrainer phase at `supervision.phase.*`; `--rounds` etc.
override); the adaptive schedule and `sft_only` are refused (they run in `toolcollapse rl`). The control
tags a checkpoint lacks (Qwen2.5 and Llama 3 have no `<tool_response>` tokens) are added first
(`ready_for_chatml`), and the final model and tokenizer are saved to `--out`; `--save-steps`,
`--logging-steps` and `--report-to` (TensorBoard, W&B, trackio) are TRL's own. `--set model.lora.rank=16`
trains LoRA adapters (peft; `model.lora.*`), merged into the final save.
"""

from __future__ import annotations

import argparse
from functools import partial
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
    ap.add_argument("--ops", type=int, default=None, help="OPS: ground-truth rows per group (needs --rollouts "
                    "engine; default: supervision.ops.rows when supervision.ops.enabled)")
    ap.add_argument("--rounds", type=int, default=None, help="ETS/PRS: rounds of --steps GRPO steps, each then SFT "
                    "(default: with supervision.ets.enabled, grpo.steps / supervision.ets.every rounds)")
    ap.add_argument("--window", type=int, default=None, help="ETS/PRS: failures of the round's last N steps "
                    "(default supervision.ets.window with supervision.ets.enabled, else --steps)")
    ap.add_argument("--prs", choices=("none", "reflection", "correction"), default=None,
                    help="PRS's target (default: supervision.prs.target with supervision.prs.enabled, else none)")
    ap.add_argument("--sft-lr", type=float, default=None, help="the SFT phases' learning rate (supervision.phase.lr)")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--report-to", default="none", help="TRL's report_to: none, tensorboard, wandb, trackio, all")
    ap.add_argument("--save-steps", type=int, default=0, help="save a TRL checkpoint every N steps into --out "
                    "(with ETS/PRS rounds: --out/round_<k>/checkpoint-N, each round's steps counted from 1; 0: none; "
                    "the final model is saved to --out either way)")
    ap.add_argument("--logging-steps", type=int, default=1, help="TRL's logging_steps")
    ap.add_argument("--data", help="train on your own JSON-lines chat conversations instead of an environment: "
                    "each one's first assistant turn is the target, rewarded 1 when a completion makes the same call "
                    "or gives the same answer (toolcollapse.conversations.first_turn_reward); the probe is built from "
                    "them too (unless --probe-data)")
    ap.add_argument("--probe-data", help="build the monitor's probe from these JSON-lines chat conversations "
                    "(e.g. examples/data/conversations.jsonl; `toolcollapse probe FILE --tokenizer DIR` shows what it "
                    "watches) instead of the tool world's oracle")
    ap.add_argument("--vllm", choices=("off", "colocate", "server"), default="off",
                    help="TRL's vLLM generation (tool loop only; server: start `VLLM_SERVER_DEV_MODE=1 vllm serve "
                         "CHECKPOINT` first, see docs/TRL.md)")
    args = ap.parse_args()

    from accelerate import PartialState
    from datasets import Dataset
    from trl import GRPOConfig, SFTConfig, SFTTrainer

    from toolcollapse.chat import CHAT_TEMPLATE
    from toolcollapse.config import load_config
    from toolcollapse.conversations import first_turn_reward, read_conversations, reference_rows
    from toolcollapse.envs import make_env
    from toolcollapse.integrations.trl import (ControlTokenCallback, MonitoredGRPOTrainer, engine_rollouts,
                                               episode_success, reference_token_rows, rl_phase_data,
                                               speak_toolcollapse_chat, task_rows,
                                               tool_world_environment, tool_world_reward, train_interleaved)
    from toolcollapse.model import load_model, load_tokenizer
    from toolcollapse.rl import task_order
    from toolcollapse.sources import apply_lora, merged
    from toolcollapse.tags import ready_for_chatml, token_ids

    own = Path(args.checkpoint) / "toolcollapse.yaml"
    config = args.config or (own if own.is_file() else "configs/tiny_rl.yaml")
    cfg = load_config(config, [f"init={args.checkpoint}", *args.set])
    s = cfg.supervision
    if s.adaptive.enabled or s.sft_only_enabled:
        ap.error("supervision.adaptive and supervision.sft_only run in `toolcollapse rl` only; through TRL the "
                 "monitor's alarms can log, checkpoint or stop (monitor.on_alarm)")
    ops = args.ops if args.ops is not None else (s.ops.rows if s.ops.enabled else 0)
    hbg = s.hbg.rows if s.hbg.enabled else 0
    steps = args.steps or (s.ets.every if s.ets.enabled and args.rounds is None else cfg.grpo.steps)
    rounds = args.rounds if args.rounds is not None else (cfg.grpo.steps // s.ets.every if s.ets.enabled else 0)
    if s.ets.enabled and args.rounds is None and (rounds == 0 or cfg.grpo.steps % s.ets.every):
        ap.error(f"supervision.ets: grpo.steps={cfg.grpo.steps} is not a whole number of rounds of "
                 f"supervision.ets.every={s.ets.every} steps; change one, or give --rounds and --steps")
    window = args.window or (s.ets.window if s.ets.enabled else steps)
    prs = args.prs or (s.prs.target if s.prs.enabled else "none")
    env = make_env(cfg)
    if args.data and (args.rollouts == "engine" or ops or hbg or (rounds and prs != "none")):
        ap.error("--data (your own conversations) trains their first turns through TRL's generation: no engine "
                 "rollouts, OPS, HBG or PRS (they replay an environment's tasks, PRS's judge reads them); the SFT "
                 "term, unlikelihood and ETS rounds (SFT on the failed conversations' first turns) work")
    if args.vllm != "off" and args.rollouts == "engine":
        ap.error("--vllm with --rollouts engine: our engine generates with the trained model itself, not vLLM")
    if not args.data and args.rollouts == "tool_loop" and (cfg.env != "toolworld" or ops or hbg):
        ap.error("BFCL, OPS and HBG need --rollouts engine (TRL's tool loop ends a rollout at the first reply without "
                 "a call, and has no place for a replayed ground truth or a hinted prompt)")
    tokenizer, model = load_tokenizer(args.checkpoint), load_model(args.checkpoint)
    added, notes = ready_for_chatml(model, tokenizer)  # a Qwen or Llama checkpoint lacks some of our tags
    for line in ([f"added control tokens: {' '.join(added)}"] if added else []) + notes:
        print(line)
    if added and not cfg.model.lora.rank and cfg.grpo.kl_coef:
        # TRL loads the KL reference from the policy's name_or_path: save the grown model and point there, or the
        # reference would lack the added tags' rows (as `rl` grows its reference the same way)
        grown = Path(args.out) / "init"
        if PartialState().is_main_process:
            model.save_pretrained(grown)
            tokenizer.save_pretrained(grown)
        PartialState().wait_for_everyone()
        model.name_or_path = model.config._name_or_path = str(grown)
    if cfg.model.lora.rank:  # model.lora.*: LoRA adapters (peft), plus the added tags' embedding rows
        model = apply_lora(model, cfg.model.lora, token_ids(tokenizer, added))
        print(f"LoRA rank {cfg.model.lora.rank} on {', '.join(cfg.model.lora.targets)}")
    g = cfg.grpo
    per_round = steps * g.prompts_per_step * PartialState().num_processes  # every process its own prompts
    order = task_order(env.tasks(g.split), cfg.seed)  # rl's order, cycled as rl cycles it; TRL keeps it (no shuffle)
    tasks = [order[i % len(order)] for i in range(per_round * max(1, rounds))]
    if args.data:  # your own conversations: prompts and their ground-truth first turns, cycled
        mine = reference_rows(read_conversations(args.data))
        data = Dataset.from_list([mine[i % len(mine)] for i in range(per_round * max(1, rounds))])
        speak_toolcollapse_chat(tokenizer, model, cfg.rollout.call_end,  # our models: stop at </tool_call> too
                                use_vllm=args.vllm != "off")
        rollout = dict(reward_funcs=first_turn_reward(tokenizer, cfg.rollout.call_end))
    elif args.rollouts == "engine":
        data = task_rows(tasks)
        rollout = dict(reward_funcs=episode_success, rollout_func=engine_rollouts(cfg, tokenizer, tasks=tasks),
                       ops=ops, ops_shaping=s.ops.shaping, luffy_gamma=s.ops.gamma, hbg=hbg)
    else:  # our own model: its system prompt documents the tools (its chat template does not render them)
        data = task_rows(tasks, system_prompt=tokenizer.chat_template == CHAT_TEMPLATE)
        rollout = dict(reward_funcs=tool_world_reward, environment_factory=tool_world_environment(cfg),
                       call_end=cfg.rollout.call_end)
    # one generation of prompts_per_step x G rollouts a process, trained in micro-batches of grpo.micro_batch_size
    # rows, one optimizer step (as rl): TRL generates per_device x steps_per_generation (= accumulation) rows at once
    if s.sft_coef and not args.data:  # the SFT term: each prompt's ground-truth first turn, as the policy writes it
        data = data.add_column("reference", [first_turn_text(t) for t in tasks])
    rows = g.prompts_per_step * g.group_size
    micro = g.micro_batch_size if rows % g.micro_batch_size == 0 else rows
    grpo_args = GRPOConfig(
        output_dir=args.out, max_steps=steps, learning_rate=g.lr, beta=g.kl_coef, epsilon=g.clip_low,
        epsilon_high=g.clip_high, num_generations=g.group_size, per_device_train_batch_size=micro,
        gradient_accumulation_steps=rows // micro,
        temperature=cfg.rollout.temperature,  # TRL's tool loop: one budget for all turns and the tool replies
        max_completion_length=min(cfg.model.max_seq_len, 2 * cfg.rollout.max_turns * cfg.rollout.max_new_tokens),
        max_tool_calling_iterations=cfg.rollout.max_turns - 1, loss_type="dapo", shuffle_dataset=False, seed=cfg.seed,
        logging_steps=args.logging_steps, save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, report_to=args.report_to, bf16=args.bf16, use_cpu=not _cuda(),
        gradient_checkpointing=False, use_vllm=args.vllm != "off", vllm_mode="colocate" if args.vllm == "off" else args.vllm)
    probe_data = args.probe_data or args.data
    monitor = (ControlTokenCallback.from_conversations(probe_data, cfg, tokenizer) if probe_data
               else ControlTokenCallback.for_tool_world(cfg, tokenizer))

    def make_grpo(round_: int = 0) -> MonitoredGRPOTrainer:
        part = data.select(range(round_ * per_round, (round_ + 1) * per_round))  # each round its own tasks
        return MonitoredGRPOTrainer(model=model, args=grpo_args, train_dataset=part, processing_class=tokenizer,
                                    monitor=monitor,
                                    tool_specs=env.tool_table if cfg.env == "toolworld" and not args.data else None,
                                    sft_coef=s.sft_coef, unlikelihood_coef=s.unlikelihood_coef, **rollout)

    if not rounds:
        make_grpo().train()
    else:
        def make_sft(dataset) -> SFTTrainer:
            sft_args = SFTConfig(output_dir=str(Path(args.out) / "sft"), num_train_epochs=s.phase.epochs,
                                 learning_rate=args.sft_lr or s.phase.lr, per_device_train_batch_size=s.phase.batch_size,
                                 max_length=None, save_strategy="no", report_to=args.report_to, bf16=args.bf16,
                                 use_cpu=not _cuda(), seed=cfg.seed, logging_steps=args.logging_steps)
            return SFTTrainer(model=model, args=sft_args, train_dataset=dataset, processing_class=tokenizer)

        phase_data = (partial(reference_token_rows, tokenizer=tokenizer) if args.data  # your conversations' turns
                      else rl_phase_data(cfg, tokenizer, None if prs == "none" else prs, call_end=cfg.rollout.call_end))
        phases = train_interleaved(make_grpo, make_sft, rounds, window, args.out, phase_data)
        for p in phases:
            print(p)
    PartialState().wait_for_everyone()
    if PartialState().is_main_process:  # LoRA adapters merged: `toolcollapse eval` reads it as any model
        merged(model).save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
    print(f"alarms: {len(monitor.alarms)}; toolcollapse diagnose {args.out}")


def first_turn_text(task) -> str:
    """The ground truth's first assistant turn of a task, in our chat format, as the policy writes it after the
    generation prompt: the SFT term's `reference` column."""
    from toolcollapse.chat import render_text

    prompt = render_text([task.prompt[-1]], add_generation_prompt=True)
    return render_text([task.prompt[-1], task.reference[0]]).removeprefix(prompt).removesuffix("\n")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
