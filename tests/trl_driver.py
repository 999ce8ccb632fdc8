"""A small GRPO run through TRL with toolcollapse's monitor, for tests/test_trl.py: run in-process, or
under `accelerate launch --cpu --num_processes 2` (gloo). Each rank writes what the tests compare:

  <out>/rank<r>/batch_<step>.pt   the sampled tokens its micro-batches fed the ctrl/* statistics
                                  (targets, logp, old logp, entropy), before the cross-rank reduction
  <out>/rank<r>/gen_<step>.pt     the completions it sampled at that (0-based) step
  <out>/rank<r>/first.pt          its first micro-batch's inputs and the weights they were scored with
  <out>/rank<r>/end.json          the global step it stopped at, its alarms and its log history

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

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150",
                                               "world.seed=0", "monitor.probe_size=4", "monitor.probe_every=1",
                                               f"monitor.on_alarm={args.on_alarm}"])
    env = make_env(cfg)
    tasks = env.tasks("train")[:64]
    data = Dataset.from_dict({"prompt": [render_text([t.prompt[-1]], add_generation_prompt=True) for t in tasks]})
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)

    def length(completions: list[str], **_: object) -> list[float]:  # any reward whose groups differ moves the weights
        return [len(c) / 10 for c in completions]

    monitor = ControlTokenCallback.for_tool_world(cfg, tokenizer)
    config = GRPOConfig(output_dir=str(Path(args.out) / "trainer"), use_cpu=True, bf16=False,
                        gradient_checkpointing=False, per_device_train_batch_size=args.per_device, num_generations=4,
                        max_completion_length=12, temperature=1.0, beta=0.0, learning_rate=1e-3,
                        max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no", seed=0,
                        generation_kwargs={"eos_token_id": [tokenizer.convert_tokens_to_ids(t) for t in STOP_TAGS]})
    mine = Path(args.out) / f"rank{PartialState().process_index}"  # after GRPOConfig, which sets up the processes
    mine.mkdir(parents=True, exist_ok=True)

    class Recording(MonitoredGRPOTrainer):
        """Keeps what each rank fed the reduction, and its first micro-batch with the weights that scored it."""

        def _compute_loss(self, model, inputs):
            if not (mine / "first.pt").exists():
                keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
                torch.save({"inputs": {k: inputs[k].cpu() for k in keys},
                            "weights": {k: v.detach().clone() for k, v in self.model.state_dict().items()}},
                           mine / "first.pt")
            return super()._compute_loss(model, inputs)

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            torch.save({k: out[k].cpu() for k in ("completion_ids", "completion_mask")},
                       mine / f"gen_{self.state.global_step}.pt")
            return out

        def log(self, logs, start_time=None):
            if self.model.training and self.sampled.parts:
                torch.save(torch.cat(self.sampled.parts), mine / f"batch_{self.state.global_step}.pt")
            super().log(logs, start_time)

    trainer = Recording(model=load_model(args.checkpoint), reward_funcs=length, args=config, train_dataset=data,
                        processing_class=tokenizer, monitor=monitor)

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
    (mine / "end.json").write_text(json.dumps({
        "global_step": trainer.state.global_step, "log_history": trainer.state.log_history,
        "alarms": [{"step": a.step, "series": a.rule.series} for a in monitor.alarms],
        "checkpoints": sorted(p.name for p in Path(config.output_dir).glob("checkpoint-*"))}))


if __name__ == "__main__":
    main()
