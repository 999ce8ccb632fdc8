"""What the TRL tests share: the driver that runs TRL's trainer in one or two processes
(tests/trl_driver.py), our forward on TRL's saved batch, and small trainers and arguments."""

import json
import subprocess
import sys
from pathlib import Path

import torch

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
