"""A small GRPO run through TRL with toolcollapse's monitor, for the tests/test_trl_*.py tests: run in-process, or
under `accelerate launch --cpu --num_processes 2` (gloo). Each rank writes what the tests compare:

  <out>/rank<r>/batch_<step>.pt   the sampled tokens its micro-batches fed the ctrl/* statistics
                                  (targets, logp, old logp, entropy), before the cross-rank reduction
  <out>/rank<r>/gen_<step>.pt     the completions it sampled at that (0-based) step
  <out>/rank<r>/first.pt          its first micro-batch's inputs and the weights they were scored with
  <out>/rank<r>/final.pt          the weights at the end
  <out>/rank<r>/end.json          the global step it stopped at, its alarms and its log history (ETS: the phases)

    python tests/trl_driver.py CHECKPOINT OUT [--steps N] [--inject-at K] [--on-alarm stop]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--per-device", type=int, default=8)  # completions per rank and step
    ap.add_argument("--inject-at", type=int, default=None)  # from this step on, <|im_end|>'s logit + 12
    ap.add_argument("--on-alarm", default="log")
    ap.add_argument("--sft-coef", type=float, default=0.0)
    ap.add_argument("--unlikelihood-coef", type=float, default=0.0)
    ap.add_argument("--ops", type=int, default=0)
    ap.add_argument("--ops-shaping", default="luffy")
    ap.add_argument("--hbg", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=0)  # > 0: ETS, rounds of --steps GRPO steps, then SFT phases
    ap.add_argument("--constant-reward", action="store_true")  # every completion 1.0: GRPO's advantages are 0
    ap.add_argument("--optim", default="adamw_torch")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)  # 0: no clipping
    args = ap.parse_args()
    torch.set_num_threads(1)

    from accelerate import PartialState
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    from toolcollapse.chat import IM_END, STOP_TAGS, render_text
    from toolcollapse.config import load_config
    from toolcollapse.envs import make_env
    from toolcollapse.integrations.trl import ControlTokenCallback, MonitoredGRPOTrainer
    from toolcollapse.model import load_model
    from toolcollapse.records import Message
    from toolcollapse.supervision import hint

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150",
                                               "world.seed=0", "monitor.probe_size=4", "monitor.probe_every=1",
                                               f"monitor.on_alarm={args.on_alarm}"])
    env = make_env(cfg)
    tasks = env.tasks("train")[:64]
    prompts = [render_text([t.prompt[-1]], add_generation_prompt=True) for t in tasks]
    # the ground truth's first turn, as the policy would write it after the prompt
    references = [render_text([t.prompt[-1], t.reference[0]]).removeprefix(p).removesuffix("\n")
                  for t, p in zip(tasks, prompts)]
    # HBG: the plan hint (the tools to call, in order) as a system message before the question
    hinted = [render_text([Message("system", hint(t, "plan")), t.prompt[-1]], add_generation_prompt=True) for t in tasks]
    data = Dataset.from_dict({"prompt": prompts, "reference": references, "hinted_prompt": hinted})
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)

    def length(completions: list[str], **_: object) -> list[float]:  # any reward whose groups differ moves the weights
        if args.constant_reward:
            return [1.0] * len(completions)
        if args.rounds:  # ETS: a task fails unless its completion calls a tool (the answering model never does)
            return [float("<tool_call>" in c) for c in completions]
        return [len(c) / 10 for c in completions]

    monitor = ControlTokenCallback.for_tool_world(cfg, tokenizer)
    config = GRPOConfig(output_dir=str(Path(args.out) / "trainer"), use_cpu=True, bf16=False,
                        gradient_checkpointing=False, per_device_train_batch_size=args.per_device, num_generations=4,
                        max_completion_length=12, temperature=1.0, beta=0.0, learning_rate=args.lr,
                        optim=args.optim, max_grad_norm=args.max_grad_norm,
                        max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no", seed=0,
                        generation_kwargs={"eos_token_id": [tokenizer.convert_tokens_to_ids(t) for t in STOP_TAGS]})
    mine = Path(args.out) / f"rank{PartialState().process_index}"  # after GRPOConfig, which sets up the processes
    mine.mkdir(parents=True, exist_ok=True)

    class Recording(MonitoredGRPOTrainer):
        """Keeps what each rank fed the reduction, and its first micro-batch with the weights that scored it."""

        def _compute_loss(self, model, inputs):
            if not (mine / "first.pt").exists():
                keys = [k for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sft_ids",
                                    "sft_mask", "unlikely", "expert", "advantages") if k in inputs]
                torch.save({"inputs": {k: inputs[k].cpu() for k in keys},
                            "weights": {k: v.detach().clone() for k, v in self.model.state_dict().items()}},
                           mine / "first.pt")
            return super()._compute_loss(model, inputs)

        def _generate_single_turn(self, prompt_ids, *rest, **kwargs):  # what generation was conditioned on
            torch.save(prompt_ids, mine / f"sampled_from_{self.state.global_step}.pt")
            return super()._generate_single_turn(prompt_ids, *rest, **kwargs)

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            torch.save({k: out[k].cpu() for k in ("completion_ids", "completion_mask")},
                       mine / f"gen_{self.state.global_step}.pt")
            return out

        def log(self, logs, start_time=None):
            if self.model.training and self.sampled.parts:
                torch.save(torch.cat(self.sampled.parts), mine / f"batch_{self.state.global_step}.pt")
            super().log(logs, start_time)

    model = load_model(args.checkpoint)

    def make_grpo(round_=0):  # every round on its own part of the data
        part = data.select(range(round_ * 16, (round_ + 1) * 16)) if args.rounds else data
        return Recording(model=model, reward_funcs=length, args=config, train_dataset=part, processing_class=tokenizer,
                         monitor=monitor, sft_coef=args.sft_coef, unlikelihood_coef=args.unlikelihood_coef,
                         ops=args.ops, ops_shaping=args.ops_shaping, hbg=args.hbg)

    if args.rounds:
        from trl import SFTConfig, SFTTrainer

        from toolcollapse.integrations.trl import train_interleaved

        def make_sft(dataset):
            dataset.to_json(str(Path(args.out) / f"phase_{len(list(Path(args.out).glob('phase_*')))}.jsonl"))
            sft_args = SFTConfig(output_dir=str(Path(args.out) / "sft"), use_cpu=True, bf16=False,
                                 per_device_train_batch_size=8, num_train_epochs=2, learning_rate=1e-2,
                                 lr_scheduler_type="constant", logging_steps=1, report_to="none", save_strategy="no",
                                 completion_only_loss=True, seed=0)
            return SFTTrainer(model=model, args=sft_args, train_dataset=dataset, processing_class=tokenizer)

        phases = train_interleaved(make_grpo, make_sft, rounds=args.rounds, window=args.steps)
        (mine / "end.json").write_text(json.dumps({"phases": phases}))
        return
    trainer = make_grpo()

    class Inject(TrainerCallback):
        """From step `inject_at` on, every forward through the LM head puts 12 nats more on <|im_end|>."""

        def on_step_begin(self, args_, state, control, model=None, **kwargs):
            if args.inject_at is not None and state.global_step == args.inject_at:
                end = tokenizer.convert_tokens_to_ids(IM_END)

                def spike(module, inputs, output):
                    output[..., end] += 12.0
                    return output

                model.get_output_embeddings().register_forward_hook(spike)
            return control

    trainer.callback_handler.callbacks.insert(0, Inject())  # before the monitor's probe
    trainer.train()
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, mine / "final.pt")
    (mine / "end.json").write_text(json.dumps({
        "global_step": trainer.state.global_step, "log_history": trainer.state.log_history,
        "alarms": [{"step": a.step, "series": a.rule.series} for a in monitor.alarms],
        "checkpoints": sorted(p.name for p in Path(config.output_dir).glob("checkpoint-*"))}))


if __name__ == "__main__":
    main()
