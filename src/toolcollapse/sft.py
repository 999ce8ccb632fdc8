"""Supervised fine-tuning on oracle trajectories (loss on assistant tokens only).

`run_sft` trains a tokenizer on the world's text and builds a Llama preset from
scratch (`model.source: scratch`), or loads a pretrained model (SmolLM2-135M, a local
Hugging Face directory; toolcollapse.sources), optionally with LoRA adapters, and
trains it on the ground-truth conversations of the train split; the
loss covers exactly the tokens a rollout would sample (`Piece.trainable`: the call
or answer and its stop token), never the prompt, tool results or template tokens.
The checkpoint is a standard `save_pretrained` directory (LoRA adapters merged into
the weights) plus `toolcollapse.yaml` (the resolved config) and `metrics.jsonl`.

With `sft.copy_warmup`, training starts with one or more warm-up phases on short
examples without the ~650-token system prompt: the user question and the first call
(`first_call`), where a tiny model learns to copy entity names out of the question,
or whole conversations minus the system prompt (`no_system_prompt`), where it also
learns to copy numbers out of tool results. Both come far later when every example
carries the system prompt (docs/LOG.md). The main phase then trains on full tasks.

Validation reports accuracy by kind of target token, because a tiny model learns
the format long before it learns to copy: `digit` (digits of values copied from tool
results), `word` (a word that occurs earlier in the question or a tool result:
entity names, units) and `structure` (everything else: tags, JSON, tool names).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from toolcollapse.chat import IM_START, PieceEncoder
from toolcollapse.config import ConfigError, RunConfig, dump_config, sft_tasks_read
from toolcollapse.encoding import Example, batch_logits, encode_tasks, length_grouped_batches, warmup_examples
from toolcollapse.envs import make_env
from toolcollapse.losses import sft_loss
from toolcollapse.model import build_model, n_params, place, resolve_device
from toolcollapse.optim import lr_at, make_optimizer, set_lr
from toolcollapse.runtime import (append_jsonl, check_new_run_dir, clear_run_dir, lock_dir, progress, seed_everything,
                                  set_threads)
from toolcollapse.sources import SCRATCH, apply_lora, load_pretrained, merged
from toolcollapse.tokenizer import train_tokenizer

CONFIG_FILE = "toolcollapse.yaml"
FINISHED = "SFT_COMPLETE"  # written after everything else: `study` reuses an SFT directory only with it
TOKEN_KINDS = ("digit", "word", "structure")


def token_kinds(example: Example, tokenizer: Any) -> list[str]:
    """Kind of each trained target of one conversation, in order (see module docstring)."""
    ids, mask = example
    start = [i for i, t in enumerate(ids) if t == tokenizer.convert_tokens_to_ids(IM_START)][1]  # first user turn
    seen: set[int] = set()
    kinds = []
    tokens = tokenizer.convert_ids_to_tokens(ids)
    for j in range(start, len(ids)):
        if mask[j]:
            text = tokens[j].lstrip("Ġ")
            kinds.append("digit" if text.isdigit() else
                         "word" if ids[j] in seen and any(c.isalpha() for c in text) else "structure")
        else:
            seen.add(ids[j])
    return kinds


@torch.no_grad()
def validate(model: Any, examples: Sequence[Example], kinds: Sequence[Sequence[str]], pad_id: int,
             batch_size: int) -> dict[str, float]:
    """Loss and accuracy by token kind on held-out oracle conversations."""
    was_training = model.training
    model.eval()
    total_nll, hits, counts = 0.0, dict.fromkeys(TOKEN_KINDS, 0), dict.fromkeys(TOKEN_KINDS, 0)
    for i in range(0, len(examples), batch_size):
        logits, targets = batch_logits(model, examples[i:i + batch_size], pad_id)
        total_nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        correct = (logits.argmax(dim=-1) == targets).tolist()
        for ok, kind in zip(correct, [k for ks in kinds[i:i + batch_size] for k in ks]):
            hits[kind] += ok
            counts[kind] += 1
    model.train(was_training)
    out = {"val/loss": total_nll / max(1, sum(counts.values()))}
    out.update({f"val/acc_{k}": hits[k] / max(1, counts[k]) for k in TOKEN_KINDS})
    return out


@dataclass(frozen=True)
class Phase:
    name: str
    examples: Sequence[Example]
    steps: int
    batch_size: int
    length_group: int  # batches drawn from `length_group` batches' worth sorted by length (1: plain shuffle)


def train_phase(model: Any, phase: Phase, sc: Any, rng: random.Random, pad_id: int, step_offset: int,
                run_validation: Callable[[], dict[str, float]], log: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """`phase.steps` optimizer steps on its examples, with a fresh AdamW and its own LR schedule;
    returns the last step's record (loss, accuracy, validation)."""
    steps = phase.steps
    batches = length_grouped_batches(phase.examples, phase.batch_size, rng, group=phase.length_group)
    optimizer = make_optimizer(model, sc.lr, sc.weight_decay, sc.betas)
    bar = progress(steps, phase.name)
    for step in range(steps):
        lr = lr_at(step, sc.lr, sc.warmup_steps, steps, sc.min_lr_ratio, sc.schedule, sc.decay_frac)
        set_lr(optimizer, lr)
        logits, targets = batch_logits(model, next(batches), pad_id)
        loss, stats = sft_loss(logits, targets)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), sc.grad_clip).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.update(1)
        bar.set_postfix(loss=f"{stats.loss:.3f}", acc=f"{stats.accuracy:.3f}", lr=f"{lr:.1e}", refresh=False)
        record: dict[str, Any] = {}
        if step % sc.log_every == 0 or step == steps - 1:
            record = {"loss": stats.loss, "accuracy": stats.accuracy, "lr": lr, "grad_norm": grad_norm}
        if (step + 1) % sc.val_every == 0 or step == steps - 1:
            record.update(run_validation())
        if record:
            log({"step": step_offset + step, "phase": phase.name, **record})
    bar.close()
    return record


def sft_model(cfg: RunConfig, env: Any) -> tuple[Any, Any, str]:
    """(model, tokenizer, a description) for `cfg.model.source`."""
    mc = cfg.model
    if mc.source != SCRATCH:
        prepared = load_pretrained(mc.source, mc.cache_dir, mc.lora)
        for note in prepared.notes:
            print(f"sft: model: {note}")
        return prepared.model, prepared.tokenizer, f"pretrained {mc.source}"
    tokenizer = train_tokenizer(env.tokenizer_corpus(cfg.tokenizer.corpus_tasks), cfg.tokenizer.vocab_size,
                                cfg.tokenizer.single_digits)
    model = build_model(mc.preset, len(tokenizer), mc.max_seq_len, tokenizer.pad_token_id, tokenizer.eos_token_id,
                        cfg.seed)
    if mc.lora.rank > 0:
        model = apply_lora(model, mc.lora, [])
    return model, tokenizer, f"{mc.preset} model from scratch" + (f", LoRA rank {mc.lora.rank}" if mc.lora.rank else "")


def validation_tasks(env: Any, n: int) -> list[Any]:
    """The first `n` tasks of the `val` split (train tasks past the SFT pool: world.sft_pool); of `test` where
    the environment has no val split or its train split is too short to carve one."""
    if "val" in env.splits:
        try:
            return env.tasks("val")[:n]
        except ConfigError as err:
            print(f"sft: validating on test tasks: {err}")
    return env.tasks("test")[:n]


def run_sft(cfg: RunConfig, out_dir: str | Path | None = None, overwrite: bool = False) -> Path:
    """Train and save to `out_dir` (default <out_dir>/sft), which must not hold another run unless
    `overwrite` (ConfigError before anything is written)."""
    out = Path(out_dir) if out_dir is not None else Path(cfg.out_dir) / "sft"
    lock_dir(out, "sft run")
    check_new_run_dir(out, overwrite, "sft")
    device = resolve_device(cfg.device)
    clear_run_dir(out, "sft")
    out.mkdir(parents=True)
    dump_config(cfg, out / CONFIG_FILE)  # first: it marks the directory as this run's (written again at the end)
    set_threads(cfg.threads)
    seed_everything(cfg.seed)
    t0 = time.time()

    env = make_env(cfg)
    model, tokenizer, what = sft_model(cfg, env)
    model = place(model, device, cfg.model.dtype)
    encoder = PieceEncoder(tokenizer, cfg.rollout.call_end)  # who writes a call turn's <|im_end|>: trained in `sampled`
    sc = cfg.sft
    train = encode_tasks(encoder, env.tasks("train", sc.steps * sc.batch_size))
    if cfg.env == "toolworld" and sft_tasks_read(cfg) > cfg.world.sft_pool:
        print(f"sft: note: this recipe reads the first {sft_tasks_read(cfg)} train tasks, past world.sft_pool="
              f"{cfg.world.sft_pool}: the val and rl tasks are among them, so RL on `rl` from it is refused")
    val = encode_tasks(encoder, validation_tasks(env, sc.val_n))
    val_kinds = [token_kinds(e, tokenizer) for e in val]
    longest = max(len(x) for x, _ in train)
    if longest > cfg.model.max_seq_len:
        raise ValueError(f"a training conversation has {longest} tokens > model.max_seq_len={cfg.model.max_seq_len}")

    model.train()
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    warmups = [w for w in sc.copy_warmup if w.steps > 0]
    print(f"sft: {what}, {n_params(model) / 1e6:.2f} M params ({trained / 1e6:.2f} M trained), vocab {len(tokenizer)}, "
          f"{len(train)} conversations (mean {sum(len(x) for x, _ in train) / len(train):.0f} tokens); "
          + "".join(f"{w.steps} steps x {w.batch_size} ({w.content}) + " for w in warmups)
          + f"{sc.steps} steps x {sc.batch_size}; on {device} ({cfg.model.dtype}); setup {time.time() - t0:.1f}s")
    rng = random.Random(cfg.seed)
    group = 16 if sc.group_by_length else 1
    phases = []
    for i, w in enumerate(warmups):
        examples = warmup_examples(encoder, env.tasks("train")[:w.steps * w.batch_size], w.content)
        name = "copy warm-up" + (f" {i + 1}" if len(warmups) > 1 else "")
        # "both" mixes ~50- and ~210-token examples: batch them by length so short ones are not padded
        phases.append(Phase(name, examples, w.steps, w.batch_size, 16 if w.content == "both" else group))
    phases.append(Phase("sft", train, sc.steps, sc.batch_size, group))
    log = lambda record: append_jsonl(out / "metrics.jsonl", {**record, "elapsed_s": round(time.time() - t0, 2)})  # noqa: E731
    done, record = 0, {}
    for phase in phases:
        record = train_phase(model, phase, sc, rng, tokenizer.pad_token_id, done,
                             lambda: validate(model, val, val_kinds, tokenizer.pad_token_id, sc.batch_size), log)
        done += phase.steps

    merged(model).save_pretrained(out)
    tokenizer.save_pretrained(out)
    dump_config(cfg, out / CONFIG_FILE)
    (out / FINISHED).write_text(f"{time.time() - t0:.0f} s\n")  # last: a kill before it leaves an unfinished SFT
    final = {k: round(v, 4) for k, v in record.items() if k.startswith("val/")}
    print(f"sft: done in {time.time() - t0:.0f}s; final train loss {record['loss']:.4f}; {final} -> {out}")
    return out
