"""Multi-turn GRPO (arXiv 2402.03300) on tool use, with the paper's settings as defaults.

One step:
  1. take the next `prompts_per_step` tasks and sample G rollouts of each with the
     KV-cached, token-in/token-out engine (rollout.py);
  2. reward 1 if the task is solved, else 0 (rewards.py); group-normalised
     advantages, with or without the std division (advantages.py);
  3. forward the policy over the rollouts' exact tokens -- the shared system prompt
     once -- and minimise the clipped surrogate with dual clip on the sampled tokens
     only (tool output and template tokens are masked), plus beta * k3 KL to the
     frozen initial model (losses.py), token-mean over the batch;
  4. clip the gradient norm; a non-finite loss or norm skips the step, never the weights.
Every `monitor.probe_every` steps, after the rollouts and before the update (on the weights the
rollouts sampled from, reading the system prompt's keys and values the rollouts ran), a fixed probe set
of oracle conversations is teacher-forced through the policy and its control-token and content
statistics are logged (monitor.py); every `grpo.eval_every` steps the policy runs greedily
on fixed `eval.split` tasks (`val/success`, `val/healthy_rate`: the skill, which the format
can hide). Alarm rules watch the probe's series (alarms.py): an alarm is printed,
written to alarms.jsonl and handled (`monitor.on_alarm`: log, checkpoint, stop; or a
handler passed to `run_rl`). With `grpo.skip_uninformative_steps`, a step whose groups all
have equal rewards makes no optimizer step, so Adam's momentum cannot keep moving the
weights on zero advantages.

Every log-prob the update, the reference and the probe take is at the sampling
temperature (`rollout.temperature`: logits / T), as the rollouts' are, so the first
update's importance ratio is 1 up to float error; top-p would truncate the sampling
distribution and is refused for RL (config.rl_problems).

Departures from the paper (arXiv 2606.26027, verl): the old log-probs are the ones
recorded at sampling time instead of a second forward pass; the learning rate
defaults to a value for the tiny tier, not 1e-6.

With `model.lora.rank > 0` the policy is LoRA adapters (peft) on the initial model,
and checkpoints hold the adapters; the reference stays the full initial model.

The run directory holds `config.yaml`, `metrics.jsonl` (one line per step),
`samples.jsonl` (decoded rollouts), TensorBoard events in `tb/`, and checkpoints that
`--resume` continues from exactly (same seed: the same metrics as an uninterrupted run).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from toolcollapse.advantages import group_advantages
from toolcollapse.alarms import Alarm, Watcher, run_rules
from toolcollapse.chat import CONTROL_TAGS, PieceEncoder, generation_prompt
from toolcollapse.checkpoint import MARKER, clean_partial, complete_checkpoints, load_trainer_state, save_checkpoint
from toolcollapse.config import (ConfigError, RunConfig, checkpoint_problems, differences, dump_config, load_config,
                                 pool_problems, rl_problems)
from toolcollapse.envs import make_env
from toolcollapse.evaluate import sampling_params
from toolcollapse.losses import aggregate, kl_k3, luffy_loss, ppo_clip_loss, unlikelihood
from toolcollapse.parser import first_rejected_control
from toolcollapse.model import (PrefixCache, device_of, load_model, load_tokenizer, logits_after, logits_at, place,
                                resolve_device, run_prefix, shared_prefix_len)
from toolcollapse.sources import add_control_tokens, apply_lora, ready_for_chatml, token_ids
from toolcollapse.monitor import (ProbeSet, build_probe, content_labels, control_gradient_share, resolve_token_ids,
                                  run_probe, sampled_control_stats)
from toolcollapse.optim import lr_at, make_optimizer, set_lr
from toolcollapse.records import CallEnd, Episode, ErrorType, PolicyBatch, Task, TurnState
from toolcollapse.rewards import rewards_tensor
from toolcollapse.rollout import MIN_GROUP_SHARED, RolloutEngine
from toolcollapse.interleave import (FAILURES, PHASES, PhaseRunner, adaptive_handler, collect_failures,
                                     latest_per_task, log_failures, read_failures, sft_phase, trained_tokens)
from toolcollapse.judge import Judge, load_judge
from toolcollapse.encoding import encode_tasks
from toolcollapse.supervision import SFTTerm, StepSupervision, group_rollouts, load_hint_writer, sft_tokens_so_far
from toolcollapse.runtime import (STOP_FILE_ENV, StopOnSignal, append_jsonl, check_new_run_dir, check_writable,
                                  clear_run_dir, jsonl_lines, lock_dir, progress, read_jsonl, seed_everything,
                                  set_threads, storage_problem)

RUN_CONFIG = "config.yaml"


# ----------------------------------------------------------------------------- tensors


def build_batch(episodes: Sequence[Episode], advantages: torch.Tensor, pad_id: int,
                device: torch.device | str = "cpu", unlikely: Sequence[Sequence[int]] | None = None,
                expert: Sequence[bool] | None = None) -> PolicyBatch:
    """The rollouts as right-padded tensors; `unlikely`: per episode, positions of tokens to push down;
    `expert`: per episode, whether it is an off-policy row whose tokens the update shapes apart."""
    width = max(len(ep.tokens) for ep in episodes)
    n = len(episodes)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.bool)
    old = torch.zeros((n, width), dtype=torch.float32)
    for i, ep in enumerate(episodes):
        t = len(ep.tokens)
        ids[i, :t] = torch.tensor(ep.tokens)
        mask[i, :t] = torch.tensor(ep.loss_mask, dtype=torch.bool)
        old[i, :t] = torch.tensor(ep.logprobs)
    marked = None
    if unlikely is not None:
        marked = torch.zeros((n, width), dtype=torch.bool)
        for i, positions in enumerate(unlikely):
            marked[i, list(positions)] = True
    rows = None if expert is None else torch.tensor(list(expert), dtype=torch.bool)
    return PolicyBatch(ids, mask, old, advantages.float(), marked, rows).to(device)


def unlikely_positions(episodes: Sequence[Episode], id_to_tag: dict[int, str], call_end: CallEnd) -> list[list[int]]:
    """Per episode, the position of the first control token the grammar rejects in each failed turn."""
    out = []
    for ep in episodes:
        found = [(t.start, first_rejected_control(ep.tokens[t.start:t.end], id_to_tag, call_end))
                 for t in ep.turns if not t.parsed.state.healthy]
        out.append([start + i for start, i in found if i is not None])
    return out


@dataclass
class BatchPrefix:
    """The prefix every row of a batch shares (the system prompt), run once for all its micro-batches.

    Micro-batches attend to `kv` (`model.logits_after`). When the prefix ran under autograd, its keys
    and values in `kv` are leaves that sum each micro-batch's gradient, and `backward` sends that sum once
    through the prefix's forward to the weights: the gradient of running the prefix in every micro-batch."""

    length: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [1, Hkv, P, D]
    graph: list[tuple[torch.Tensor, torch.Tensor]]  # (the prefix forward's tensor, its leaf in kv)

    def backward(self) -> None:
        pairs = [(out, leaf) for out, leaf in self.graph if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [leaf.grad for _, leaf in pairs])


def batch_prefix(model: Any, batch: PolicyBatch, shared: int | None = None) -> BatchPrefix | None:
    """The batch's shared prefix run once (None when the rows share too little): up to the position
    that predicts the first sampled token, so every trained position lies after it. `shared`: the rows'
    `shared_prefix_len`, if known."""
    sampled = batch.target_mask.any(dim=0).nonzero()
    if len(sampled) == 0:
        return None
    if shared is None:
        shared = shared_prefix_len([r.tolist() for r in batch.input_ids])
    length = min(shared, int(sampled.min()) - 1)
    if length <= 0:
        return None
    leaf = lambda t: t.detach().requires_grad_() if t.requires_grad else t  # noqa: E731
    kv = run_prefix(model, batch.input_ids[:1, :length])
    leaves = [(leaf(k), leaf(v)) for k, v in kv]
    graph = [(out, new) for pair, new_pair in zip(kv, leaves) for out, new in zip(pair, new_pair) if out.requires_grad]
    return BatchPrefix(length, leaves, graph)


def policy_logprobs(model: Any, batch: PolicyBatch, temperature: float = 1.0,
                    prefix: BatchPrefix | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of the sampling distribution (logits / temperature) at every sampled
    token, [M] each, row-major. `prefix`: the batch's shared prefix, already run (`batch_prefix`);
    else the rows' shared prefix is run here, once for them."""
    select = torch.zeros_like(batch.target_mask)
    select[:, :-1] = batch.target_mask[:, 1:]  # the position before a sampled token predicts it
    if prefix is None or batch.input_ids.shape[1] <= prefix.length:  # (a micro-batch with nothing sampled)
        length = shared_prefix_len([r.tolist() for r in batch.input_ids])
        logits = logits_at(model, batch.input_ids, select, length)  # [M, V] float32
    else:
        p = prefix.length
        logits = logits_after(model, prefix.kv, batch.input_ids[:, p:], select[:, p:])
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    targets = batch.input_ids[batch.target_mask]  # [M]
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, entropy


# ----------------------------------------------------------------------------- one update


@dataclass
class UpdateStats:
    loss: float
    pg_loss: float
    kl_ref: float  # mean k3 KL(policy || reference) over sampled tokens
    approx_kl_old: float  # mean 0.5 * (log ratio)^2 against the sampling policy
    entropy: float  # mean entropy of the policy at sampled positions
    clip_frac_low: float
    clip_frac_high: float
    dual_clip_frac: float
    ratio_mean: float  # the importance ratio to the sampling policy over sampled tokens
    ratio_max: float
    ratio_min: float
    grad_norm: float
    skipped_nonfinite: int  # 1 when the step was skipped (non-finite loss or grad norm)
    n_tokens: int = 0  # sampled tokens in the update
    terms: dict[str, float] = field(default_factory=dict)  # supervision terms computed in the same forward


def grpo_update(model: Any, ref_logp: list[torch.Tensor] | None, optimizer: torch.optim.Optimizer,
                batch: PolicyBatch, cfg: Any, collect: list | None = None, temperature: float = 1.0,
                extra: Callable[[], bool] | None = None, unlikelihood_coef: float = 0.0,
                luffy_gamma: float = 0.0) -> UpdateStats:
    """One optimizer step over the whole batch, in micro-batches (gradient accumulation).

    `collect`, if given, receives (targets, logp, old_logp, entropy) [M] per micro-batch,
    detached: the monitor's statistics come from this forward at no extra cost. `extra`, if
    given, adds another loss's gradient to the same step (a supervision term) and returns
    whether that loss was finite. `unlikelihood_coef` > 0 adds coef * mean -log(1 - p) over the
    batch's `unlikely` tokens, from the same forward. `luffy_gamma` > 0: the tokens of the batch's
    `expert` rows take LUFFY's shaped loss -A * p / (p + gamma) instead of the clipped surrogate
    (and stay out of `collect`: the policy did not sample them)."""
    n_tokens, n_seqs = int(batch.target_mask.sum()), len(batch)
    n_unlikely = int(batch.unlikely.sum()) if unlikelihood_coef > 0 and batch.unlikely is not None else 0
    sums: Counter[str] = Counter()
    finite = True
    prefix, parts = update_plan(model, batch, cfg)
    for k, mb in enumerate(parts):
        logp, entropy = policy_logprobs(model, mb, temperature, prefix)
        old = mb.old_logp[mb.target_mask]
        seq_ids = mb.target_mask.nonzero()[:, 0]  # [M] row of each sampled token
        adv = mb.advantages[seq_ids]
        pg, pg_stats = ppo_clip_loss(logp, old, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
        off = mb.expert[seq_ids] if mb.expert is not None else None  # [M] tokens of off-policy rows
        if luffy_gamma > 0 and off is not None:
            pg = torch.where(off, luffy_loss(logp, adv, luffy_gamma), pg)
        per_token = pg
        kl = torch.zeros_like(logp)
        if ref_logp is not None:
            kl = kl_k3(logp, ref_logp[k])
            per_token = pg + cfg.kl_coef * kl
        loss = aggregate(per_token, seq_ids, cfg.loss_agg, n_tokens, n_seqs)  # the policy loss, as logged
        total = loss
        if n_unlikely:
            ul = unlikelihood(logp[mb.unlikely[mb.target_mask]])  # [K] the micro-batch's rejected tokens
            total = loss + unlikelihood_coef * ul.sum() / n_unlikely
            sums["unlikelihood"] += ul.sum().item()
        if collect is not None:
            own = slice(None) if off is None else ~off
            collect.append((mb.input_ids[mb.target_mask][own], logp.detach()[own], old[own], entropy.detach()[own]))
        finite &= bool(torch.isfinite(total))
        if finite:
            total.backward()
        m = logp.numel()
        with torch.no_grad():
            sums["loss"] += loss.item()
            sums["pg_loss"] += aggregate(pg, seq_ids, cfg.loss_agg, n_tokens, n_seqs).item()
            sums["kl_ref"] += kl.sum().item()
            sums["approx_kl_old"] += (0.5 * (logp - old) ** 2).sum().item()
            sums["entropy"] += entropy.sum().item()
            for name in ("clip_frac_low", "clip_frac_high", "dual_clip_frac"):
                sums[name] += getattr(pg_stats, name) * m
            sums["ratio_mean"] += pg_stats.ratio_mean * m
            sums["ratio_max"] = max(sums["ratio_max"], pg_stats.ratio_max)
            sums["ratio_min"] = min(sums.get("ratio_min", math.inf), pg_stats.ratio_min)
    if prefix is not None and finite:
        prefix.backward()
    if extra is not None and finite:
        finite &= extra()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)) if finite else math.nan
    skipped = not (finite and math.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    per_tok = lambda key: sums[key] / max(1, n_tokens)  # noqa: E731
    return UpdateStats(loss=sums["loss"], pg_loss=sums["pg_loss"], kl_ref=per_tok("kl_ref"),
                       approx_kl_old=per_tok("approx_kl_old"), entropy=per_tok("entropy"),
                       clip_frac_low=per_tok("clip_frac_low"), clip_frac_high=per_tok("clip_frac_high"),
                       dual_clip_frac=per_tok("dual_clip_frac"), ratio_mean=per_tok("ratio_mean"),
                       ratio_max=sums["ratio_max"], ratio_min=sums.get("ratio_min", 1.0),
                       grad_norm=grad_norm, skipped_nonfinite=int(skipped), n_tokens=n_tokens,
                       terms={"sup/unlikelihood": sums["unlikelihood"] / n_unlikely,
                              "sup/unlikely_tokens": n_unlikely} if n_unlikely else {})


def policy_step(model: Any, ref_model: Any | None, optimizer: torch.optim.Optimizer, episodes: Sequence[Episode],
                rewards: torch.Tensor, g: Any, pad_id: int, control_ids: dict[str, int],
                grad_share_rows: int = 0, temperature: float = 1.0,
                sup: StepSupervision | None = None) -> dict[str, float]:
    """Advantages over the whole batch, then `updates_per_batch` passes over it, each one optimizer step per
    mini-batch of whole groups (`grpo.mini_batches`); their statistics. With grad_share_rows > 0, first the
    control tokens' share of the gradient on that many rollouts. `sup`: the supervision terms, added to every
    optimizer step (the SFT term on the ground truth of the mini-batch's own tasks)."""
    sup = sup or StepSupervision()
    advantages, adv_stats = group_advantages(rewards, g.group_size, g.scale_adv_by_std)
    if g.skip_uninformative_steps and adv_stats.frac_groups_informative == 0:
        return {**asdict(adv_stats), "skipped_uninformative": 1, "skipped_nonfinite": 0}
    batch = build_batch(episodes, advantages, pad_id, device_of(model), sup.unlikely,
                        [k == "expert" for k in sup.kinds] if sup.kinds else None)
    if sup.kinds and any(k != "policy" for k in sup.kinds):  # hinted and expert rows: old log-probs of this policy
        recompute_old_logprobs(model, batch, [i for i, k in enumerate(sup.kinds) if k != "policy"], g, temperature)
    share = grad_share(model, batch, g, control_ids, grad_share_rows, temperature) if grad_share_rows else {}
    slices = group_slices(len(batch), g.group_size, g.mini_batches)
    parts = [batch.rows(slice(*rows)) for rows in slices]
    ref_logp = [reference_logprobs(ref_model, part, g, temperature) if ref_model is not None else None
                for part in parts]
    n_groups = len(batch) // g.group_size
    sft_parts = [sup.sft_examples[a // g.group_size:b // g.group_size] if len(sup.sft_examples) == n_groups
                 else sup.sft_examples for a, b in slices]
    collected: list = []  # per-token tensors of the last pass's forwards, for the control-token statistics
    terms: Counter[str] = Counter()  # the supervision terms' statistics, summed over the optimizer steps
    sft_calls = 0
    updates = []
    for epoch in range(g.updates_per_batch):
        last = epoch == g.updates_per_batch - 1
        for part, ref, examples in zip(parts, ref_logp, sft_parts):
            def add_sft_term(examples=examples) -> bool:
                nonlocal sft_calls
                stats = sup.sft.backward(model, examples)
                terms.update(stats)
                sft_calls += 1
                return math.isfinite(stats["sup/sft_nll"])

            updates.append(grpo_update(model, ref, optimizer, part, g, collect=collected if last else None,
                                       temperature=temperature, extra=add_sft_term if sup.sft else None,
                                       unlikelihood_coef=sup.unlikelihood_coef, luffy_gamma=sup.luffy_gamma))
    if sft_calls:
        terms["sup/sft_nll"] /= sft_calls  # the mean NLL; sup/sft_tokens stays the sum trained on
    return {**asdict(adv_stats), **combine_updates(updates, len(parts)), **_control_stats(collected, control_ids), **share,
            **terms, "optimizer_steps": len(updates), "skipped_uninformative": 0}


def group_slices(n_rows: int, group_size: int, k: int) -> list[tuple[int, int]]:
    """[start, end) rows of each of `k` mini-batches of whole groups (contiguous, in batch order)."""
    n_groups = n_rows // group_size
    if n_groups % k:
        raise ValueError(f"{n_groups} groups do not split into {k} mini-batches")
    per = n_groups // k * group_size
    return [(j * per, (j + 1) * per) for j in range(k)]


def combine_updates(updates: Sequence[UpdateStats], n_last: int = 1) -> dict[str, float]:
    """One step's statistics over its optimizer steps: per-token means weighted by each step's tokens, the ratio's
    extremes over all of them, the mean gradient norm (and its largest), skipped steps counted; the unlikelihood
    term's over the last pass (its `n_last` steps)."""
    weights = [max(1, u.n_tokens) for u in updates]

    def mean_of(key: str) -> float:  # over the steps where it is finite (a skipped step's loss can be NaN)
        pairs = [(getattr(u, key), w) for u, w in zip(updates, weights) if math.isfinite(getattr(u, key))]
        return sum(v * w for v, w in pairs) / sum(w for _, w in pairs) if pairs else math.nan

    out = {key: mean_of(key) for key in ("loss", "pg_loss", "kl_ref", "approx_kl_old", "entropy", "clip_frac_low",
                                          "clip_frac_high", "dual_clip_frac", "ratio_mean")}
    finite = [u.grad_norm for u in updates if math.isfinite(u.grad_norm)]
    out.update(ratio_max=max(u.ratio_max for u in updates), ratio_min=min(u.ratio_min for u in updates),
               grad_norm=sum(finite) / len(finite) if finite else math.nan, grad_norm_max=max(finite, default=math.nan),
               skipped_nonfinite=sum(u.skipped_nonfinite for u in updates))
    last_pass = updates[-n_last:]
    unlikely = sum(u.terms.get("sup/unlikely_tokens", 0) for u in last_pass)
    if unlikely:  # the batch's rejected control tokens (a pass's), and their mean -log(1 - p)
        out["sup/unlikelihood"] = sum(u.terms.get("sup/unlikelihood", 0.0) * u.terms.get("sup/unlikely_tokens", 0)
                                      for u in last_pass) / unlikely
        out["sup/unlikely_tokens"] = unlikely
    return out


def grad_share(model: Any, batch: PolicyBatch, g: Any, control_ids: dict[str, int], rows: int,
               temperature: float = 1.0) -> dict[str, float]:
    """Control tokens' share of the policy-gradient norm, on up to `rows` rollouts with a non-zero advantage
    (an extra forward and two backward passes; the parameters' .grad is untouched)."""
    picked = batch.advantages.nonzero()[:rows, 0]
    if picked.numel() == 0:
        return {}
    mb = batch.rows(picked)
    logp, _ = policy_logprobs(model, mb, temperature)
    adv = mb.advantages[mb.target_mask.nonzero()[:, 0]]
    pg, _ = ppo_clip_loss(logp, mb.old_logp[mb.target_mask], adv, g.clip_low, g.clip_high, g.dual_clip)
    is_ctrl = torch.isin(mb.input_ids[mb.target_mask], torch.tensor(list(control_ids.values()), device=logp.device))
    return control_gradient_share(pg, is_ctrl, [p for p in model.parameters() if p.requires_grad])


@torch.no_grad()
def recompute_old_logprobs(model: Any, batch: PolicyBatch, rows: Sequence[int], g: Any,
                           temperature: float = 1.0) -> None:
    """Set the old log-probs of `rows` (hinted rows on their hint-free prompt, expert rows) to the
    current policy's, by a forward pass planned as the update's (`plan_rows`): their first update's
    ratio is then 1."""
    index = torch.tensor(list(rows), device=batch.input_ids.device)
    sub = batch.rows(index)
    prefix, plan = plan_rows(model, sub, g)
    for part_rows in plan:
        part = sub.rows(part_rows).trimmed()
        old = torch.zeros_like(sub.old_logp[part_rows])
        old[:, :part.target_mask.shape[1]][part.target_mask] = policy_logprobs(model, part, temperature, prefix)[0]
        batch.old_logp[index[part_rows]] = old


@torch.no_grad()
def reference_logprobs(ref_model: Any, batch: PolicyBatch, g: Any, temperature: float = 1.0) -> list[torch.Tensor]:
    """The reference's log-probs [M] per micro-batch, in `grpo_update`'s micro-batches."""
    prefix, parts = update_plan(ref_model, batch, g)
    return [policy_logprobs(ref_model, mb, temperature, prefix)[0] for mb in parts]


def update_plan(model: Any, batch: PolicyBatch, g: Any) -> tuple[BatchPrefix | None, list[PolicyBatch]]:
    """How a forward over `batch` runs (the update's, the reference's): `plan_rows`' micro-batches, each
    cut after its last sampled position where they are sorted by length."""
    prefix, plan = plan_rows(model, batch, g)
    return prefix, [batch.rows(rows).trimmed() if g.sort_micro_batches else batch.rows(rows) for rows in plan]


def plan_rows(model: Any, batch: PolicyBatch, g: Any) -> tuple[BatchPrefix | None, list[torch.Tensor]]:
    """The batch's shared prefix run once (`grpo.prefix_once`) and the rows [n] of each micro-batch of
    `grpo.micro_batch_size`, by length (`sort_micro_batches`); but where the prompts are long past that
    prefix (BFCL: each task its own 2-5 k-token system prompt, a batch sharing ~200 tokens) micro-batches
    by prompt, each running its rows' whole prompt once, instead of every row its own copy."""
    if not g.prefix_once:
        return None, micro_batch_rows(batch, g.micro_batch_size, g.sort_micro_batches)
    ids = [r.tolist() for r in batch.input_ids]
    shared = shared_prefix_len(ids)
    prompt_lens = batch.target_mask.float().argmax(dim=1).tolist()  # [N] the first sampled position
    sampled = [i for i, row in enumerate(batch.target_mask.any(dim=1).tolist()) if row]
    if (g.sort_micro_batches and sampled and sum(prompt_lens[i] - shared for i in sampled) / len(sampled) >= MIN_GROUP_SHARED
            and len({tuple(ids[i][:prompt_lens[i]]) for i in sampled}) < len(sampled)):  # (some prompt has 2+ rows)
        return None, micro_batch_rows(batch, g.micro_batch_size, True, prompt_lens)
    return batch_prefix(model, batch, shared), micro_batch_rows(batch, g.micro_batch_size, g.sort_micro_batches)


def micro_batch_rows(batch: PolicyBatch, size: int, by_length: bool,
                     prompt_lens: Sequence[int] | None = None) -> list[torch.Tensor]:
    """The rows [n] of each micro-batch of `size` rows of `batch`. `by_length`: rows sorted by their last
    sampled position (cut after it, the micro-batches pad little: the same sum of gradients).
    `prompt_lens` [N]: the rows of one prompt (its first `prompt_lens` tokens) apart from the others, each
    prompt's sorted by length, so that a micro-batch's rows share their whole prompt."""
    device = batch.target_mask.device
    if not by_length:
        return [torch.arange(s, min(s + size, len(batch)), device=device) for s in range(0, len(batch), size)]
    positions = torch.arange(batch.target_mask.shape[1], device=device)
    ends = (batch.target_mask * positions).amax(dim=1)  # [N] last sampled position (0 if none)
    order = torch.sort(ends, stable=True).indices
    if prompt_lens is None:
        return [order[s:s + size] for s in range(0, len(batch), size)]
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    ids = batch.input_ids.tolist()
    for i in order.tolist():
        by_prompt.setdefault(tuple(ids[i][:prompt_lens[i]]), []).append(i)
    return [torch.tensor(rows[s:s + size], device=device) for rows in by_prompt.values() for s in range(0, len(rows), size)]


# ----------------------------------------------------------------------------- rollout statistics


def rollout_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    turns = [t for ep in episodes for t in ep.turns]
    n_turns = max(1, len(turns))
    states = Counter(t.parsed.state for t in turns)
    errors = Counter(e for t in turns for e in t.parsed.errors)
    out = {
        "success": sum(ep.success for ep in episodes) / len(episodes),
        "healthy_rate": sum(states[s] for s in TurnState if s.healthy) / n_turns,
        "turns_per_episode": len(turns) / len(episodes),
        "response_tokens": sum(sum(ep.loss_mask) for ep in episodes) / len(episodes),
    }
    out.update({f"state/{s.value}": states[s] / n_turns for s in TurnState})
    out.update({f"error/{e.value}": errors[e] / n_turns for e in ErrorType})
    out.update({f"finish/{k}": v / len(episodes) for k, v in Counter(ep.finish for ep in episodes).items()})
    return out


def row_kind_stats(episodes: Sequence[Episode], kinds: Sequence[str]) -> dict[str, float]:
    """`rollout_stats` of the policy's own rows; the success of hinted and expert rows apart."""
    out = rollout_stats([ep for ep, k in zip(episodes, kinds) if k == "policy"])
    for kind in ("hinted", "expert"):
        rows = [ep for ep, k in zip(episodes, kinds) if k == kind]
        if rows:
            out[f"sup/{kind}_success"] = sum(ep.success for ep in rows) / len(rows)
    return out


def sample_records(step: int, episodes: Sequence[Episode], rewards: torch.Tensor, decode, n: int,
                   kinds: Sequence[str] = ()):
    """The first `n` rollouts of the step, and the first group's hinted and expert rows, marked as such."""
    kinds = list(kinds) or ["policy"] * len(episodes)
    group = len(episodes) // max(1, len({ep.task_id for ep in episodes}))
    picked = [i for i in range(len(episodes)) if i < n or (i < group and kinds[i] != "policy")]
    for i in picked:
        ep = episodes[i]
        yield {"step": step, "task_id": ep.task_id, "reward": float(rewards[i]), "finish": ep.finish,
               "states": [s.value for s in ep.states], **({"kind": kinds[i]} if kinds[i] != "policy" else {}),
               "text": decode(ep.tokens[ep.prompt_len:])}


# ----------------------------------------------------------------------------- tasks


def task_order(tasks: Sequence[Task], seed: int) -> list[Task]:
    g = torch.Generator().manual_seed(seed)
    return [tasks[i] for i in torch.randperm(len(tasks), generator=g).tolist()]


def tasks_for_step(order: Sequence[Task], step: int, n: int) -> list[Task]:
    start = (step * n) % len(order)
    return [order[(start + i) % len(order)] for i in range(n)]


# ----------------------------------------------------------------------------- alarms


@dataclass
class AlarmContext:
    """What an alarm handler may act on: the live model and optimizer, a checkpoint, a stop, and the
    adaptive schedule's actions (interleave.adaptive_handler), each returning what it did."""

    step: int  # the step whose metrics raised the alarms; its update is done
    run_dir: Path
    model: Any
    optimizer: torch.optim.Optimizer
    stop: bool = False  # set True to end the run after this step
    rollback: Callable[[], int] | None = None  # restore the newest checkpoint before `step`; its step
    scale_lr: Callable[[float], float] | None = None  # multiply the LR from now on; the scale so far
    sft_phase: Callable[[str], dict[str, float]] | None = None  # SFT on every task failed so far; its stats
    recoveries: int = 0  # adaptive recoveries before this one
    events: dict[str, Any] = field(default_factory=dict)  # what the handler did: into the step's metrics row
    saved: bool = False  # set by save_checkpoint

    def save_checkpoint(self) -> Path:
        """Ask for a resumable checkpoint after this step, written once the step's metrics row is; its path."""
        self.saved = True
        return self.run_dir / "checkpoints" / f"step_{self.step + 1:06d}"


AlarmHandler = Callable[[list[Alarm], AlarmContext], None]


def config_handler(action: str) -> AlarmHandler:
    """monitor.on_alarm: `log` (alarms are always printed and written to alarms.jsonl), `checkpoint`, `stop`."""

    def handle(alarms: list[Alarm], ctx: AlarmContext) -> None:
        if action in ("checkpoint", "stop"):
            path = ctx.save_checkpoint()
            tqdm.write(f"rl: checkpoint on alarm: {path} (after this step)")
        ctx.stop = action == "stop"

    return handle


def _raise(alarms: list[Alarm], ctx: AlarmContext, handle: AlarmHandler) -> bool:
    """Print and record the alarms, run the handler; True if it asks the run to stop."""
    for a in alarms:
        tqdm.write(f"rl: {a.describe()}")
        append_jsonl(ctx.run_dir / "alarms.jsonl", {"step": a.step, "series": a.rule.series,
                                                    "detector": a.rule.detector, "value": a.value})
    handle(alarms, ctx)
    if ctx.events:
        append_jsonl(ctx.run_dir / "alarms.jsonl", {"step": ctx.step, "event": "recovery", **ctx.events})
    if ctx.stop:
        tqdm.write(f"rl: stopped on alarm after step {ctx.step}; continue with --resume {ctx.run_dir}")
    return ctx.stop


def _watcher(cfg: RunConfig, rows: Sequence[dict[str, Any]]) -> Watcher:
    """The run's alarm rules, fed the metrics of the steps already taken (a resumed run does not re-alarm)."""
    watcher = Watcher(run_rules(cfg.monitor))
    for row in rows:
        watcher.update(row["step"], row)
        if "adaptive/recovery" in row:
            watcher.rearm()
    return watcher


# ----------------------------------------------------------------------------- the loop


def _policy_and_reference(cfg: RunConfig, source: Path, fresh: bool) -> tuple[Any, Any, Any]:
    """(policy, tokenizer, frozen reference or None). A fresh run from a Hugging Face model (the
    paper's setting) gets the control tags it lacks; with LoRA the policy is adapters on it."""
    model = load_model(source, trainable=True)  # LoRA adapters of a resumed run come back trainable
    tokenizer = load_tokenizer(source)
    if fresh:
        added, notes = ready_for_chatml(model, tokenizer)
        for note in notes:
            tqdm.write(f"rl: model: {note}")
        if cfg.model.lora.rank > 0:
            model = apply_lora(model, cfg.model.lora, token_ids(tokenizer, added))
    device = resolve_device(cfg.device)
    ref_model = None
    if cfg.grpo.kl_coef > 0:  # the initial model, grown the same way (the new rows are a function of the old)
        ref_model = load_model(cfg.init).eval()
        add_control_tokens(ref_model, load_tokenizer(cfg.init))
        ref_model = place(ref_model, device, cfg.model.dtype)
    return place(model, device, cfg.model.dtype), tokenizer, ref_model


def run_rl(cfg: RunConfig, run_dir: Path, resume: bool = False, on_alarm: AlarmHandler | None = None,
           overwrite: bool = False, judge: Judge | None = None, allow_change: Sequence[str] = ()) -> Path:
    """Train from `cfg.init` (or continue the run in `run_dir`). `on_alarm` replaces the
    monitor.on_alarm action (and the adaptive schedule); `judge`, PRS's `prs.judge`. A new run
    refuses a directory that holds another run unless `overwrite`; a resumed one, a config other
    than the one it started with."""
    run_dir = Path(run_dir)
    g, s, m = cfg.grpo, cfg.supervision, cfg.monitor
    check_run_start(cfg, run_dir, resume, overwrite, allow_change)
    if s.sft_only_enabled:
        return run_sft_only(cfg, run_dir, resume)
    # a chat-model judge or hint writer answers once before any work (ConfigError: a wrong address, model, key)
    judge = judge or (load_judge(s.prs.judge) if s.prs.enabled else None)
    hints = load_hint_writer(s.hbg) if s.hbg.enabled else None
    set_threads(cfg.threads)
    seed_everything(cfg.seed)
    done = complete_checkpoints(run_dir) if resume else []
    source = done[-1] if done else Path(cfg.init)
    model, tokenizer, ref_model = _policy_and_reference(cfg, source, fresh=not done)
    optimizer = make_optimizer(model, g.lr, g.weight_decay, g.betas)
    start = load_trainer_state(done[-1], optimizer) if done else 0
    if not resume:
        clear_run_dir(run_dir, "rl")  # a previous run there, which `overwrite` allowed to replace
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / RUN_CONFIG)
    _truncate_logs(run_dir, start)
    writer = _tensorboard(run_dir, start)
    rows = read_jsonl(run_dir / "metrics.jsonl") if start else []
    watcher = _watcher(cfg, rows)
    if on_alarm is None:
        on_alarm = adaptive_handler(s.adaptive) if s.adaptive.enabled else config_handler(m.on_alarm)

    env = make_env(cfg)
    order = task_order(env.tasks(g.split, g.pool_size), cfg.seed)
    probe, probe_tokens = probe_for(cfg, env, tokenizer)
    val_tasks = env.tasks(cfg.eval.split, g.eval_n) if g.eval_every else []
    engine = RolloutEngine.from_config(model, tokenizer, env, cfg.rollout)
    engine.prefixes = PrefixCache(model)
    params = sampling_params(cfg, greedy=False)
    bar = progress(g.steps, "rl", initial=start)
    last_val = "-"  # the last validation's success (and its cost), for the progress line
    sft_term = SFTTerm(s.sft_coef, g.micro_batch_size, tokenizer.pad_token_id) if s.sft_coef > 0 else None
    sft_tokens_total = sft_tokens_so_far(rows)
    phases = PhaseRunner(run_dir, model, engine.encoder, {t.id: t for t in order}, cfg, read_failures(run_dir))
    lr_scale = next((r["adaptive/lr_scale"] for r in reversed(rows) if "adaptive/lr_scale" in r), 1.0)
    recoveries = sum("adaptive/recovery" in r for r in rows)
    save_at = lambda k: save_checkpoint(run_dir, k, model, tokenizer, optimizer,  # noqa: E731
                                        lambda p: dump_config(cfg, p / "toolcollapse.yaml"), g.keep_checkpoints)
    prompt_len = len(engine.encoder.encode(generation_prompt())[0])  # a turn's <|im_start|>assistant
    if s.adaptive.enabled and s.adaptive.rollback and not done:
        save_at(0)  # a rollback target before the first periodic checkpoint
    model.train()
    interrupt = StopOnSignal("rl", os.environ.get(STOP_FILE_ENV))  # SIGTERM / SIGINT: stop after the step
    halted = False
    try:
        for step in range(start, g.steps):
            t0 = time.time()
            engine.prefixes.clear()  # the weights moved: the rollout runs the system prompt, the probe and validation reuse it
            tasks = tasks_for_step(order, step, g.prompts_per_step)
            episodes, kinds = group_rollouts(engine, tasks, params, g.group_size, s, seed=cfg.seed * 1_000_003 + step,
                                             hints=hints)
            t_rollout = time.time()
            probe_stats = {}  # measured on the weights the rollouts sampled from, before this step's update (step 0: the start)
            if probe is not None and step % m.probe_every == 0:
                probe_stats = run_probe(model, probe, probe_tokens, cfg.rollout.temperature, engine.prefixes)
            t_probe = time.time()
            if val_tasks and step % g.eval_every == 0:
                probe_stats.update(validate(engine, val_tasks, cfg))
                probe_stats["seconds_val"] = time.time() - t_probe
                last_val = f"{probe_stats['val/success']:.2f} ({probe_stats['seconds_val']:.0f}s)"
            t_val = time.time()
            lr = lr_at(step, g.lr, g.warmup_steps, g.steps, g.min_lr_ratio, g.schedule) * lr_scale
            set_lr(optimizer, lr)
            rewards = rewards_tensor(episodes, g.format_reward, g.partial_credit, {t.id: t for t in tasks})
            share_rows = m.grad_share_rows if m.grad_share_every and step % m.grad_share_every == 0 else 0
            sup = StepSupervision(
                sft_term, encode_tasks(engine.encoder, tasks, cfg.rollout.call_end) if sft_term else (),
                s.unlikelihood_coef,
                unlikely_positions(episodes, engine.id_to_tag, cfg.rollout.call_end) if s.unlikelihood_coef else None,
                kinds if set(kinds) != {"policy"} else (), s.ops.gamma if s.ops.enabled and s.ops.shaping == "luffy" else 0.0)
            update_stats = policy_step(model, ref_model, optimizer, episodes, rewards, g, tokenizer.pad_token_id,
                                       probe_tokens, share_rows, cfg.rollout.temperature, sup)
            if s.interleaved:
                failed = collect_failures(step, episodes, kinds, phases.tasks, phases.judge_at(step, judge),
                                          engine.decode, prompt_len)
                log_failures(run_dir, failed)
                phases.failures += failed
            metrics = {"step": step, "lr": lr, **probe_stats, **update_stats, **row_kind_stats(episodes, kinds),
                       "seconds": time.time() - t0, "seconds_probe": t_probe - t_rollout,
                       "seconds_rollout": t_rollout - t0, "seconds_update": time.time() - t_val}
            for author in (judge, hints):  # chat models: their reflections / hints and cost since this process started
                if hasattr(author, "metrics"):
                    metrics.update(author.metrics())
            if phases.ets_round_ends(step):  # part of the step: an alarm's checkpoint or rollback sees it done
                metrics.update({f"ets/{k.removeprefix('phase/')}": v for k, v in
                                _phase(phases, "ets", step=step, failures=phases.ets_failures(step), optimizer=optimizer).items()})
            alarms = watcher.update(step, metrics)
            ctx = AlarmContext(step, run_dir, model, optimizer, recoveries=recoveries)
            stop = False
            if alarms:
                ctx.rollback = functools.partial(_rollback, run_dir, step, model, optimizer)
                ctx.scale_lr = functools.partial(operator.mul, lr_scale)
                ctx.sft_phase = functools.partial(_phase, phases, step=step, failures=latest_per_task(phases.failures),
                                                  optimizer=optimizer)
                stop = _raise(alarms, ctx, on_alarm)
                if "adaptive/recovery" in ctx.events:
                    recoveries += 1
                    lr_scale = ctx.events.get("adaptive/lr_scale", lr_scale)
                    watcher.rearm()
                metrics.update(ctx.events)
            phase_tokens = metrics.get("ets/tokens", 0.0) + metrics.get("adaptive/tokens", 0.0)
            expert_tokens = 0 if update_stats.get("skipped_uninformative") else g.updates_per_batch * sum(
                sum(ep.loss_mask) for ep, k in zip(episodes, kinds) if k == "expert")
            if expert_tokens:  # OPS's ground-truth rows: trained on like SFT tokens, so an sft_only control matches them
                metrics["sup/expert_tokens"] = float(expert_tokens)
            if "sup/sft_tokens" in update_stats or phase_tokens or expert_tokens:
                sft_tokens_total += update_stats.get("sup/sft_tokens", 0.0) + phase_tokens + expert_tokens
                metrics["sup/sft_tokens_total"] = sft_tokens_total
            metrics["alarms_total"] = len(watcher.alarms)
            _log(run_dir, writer, metrics,
                 sample_records(step, episodes, rewards, engine.decode, g.samples_per_step, kinds))
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", healthy=f"{metrics['healthy_rate']:.2f}",
                            informative=f"{metrics['frac_groups_informative']:.2f}", alarms=len(watcher.alarms),
                            **({"val": last_val} if val_tasks else {}), refresh=False)
            # after the step's row: a resumed run starts past it, without redoing its phase or recovery
            halted = interrupt.requested and step + 1 < g.steps  # read once: the save and the break agree
            if (stop or ctx.saved or (step + 1) % g.checkpoint_every == 0 or step + 1 == g.steps or phase_tokens
                    or ctx.events or "ets/steps" in metrics or halted):
                save_at(step + 1)
            if stop or halted:
                break
    except Exception as err:  # a full disk or a directory made read-only surfaces as whatever the writer raises
        cause = storage_problem(run_dir, err)
        if cause is None:
            raise
        raise StorageError(run_dir, cause) from None
    finally:
        interrupt.restore()
    bar.close()
    writer.close()
    if halted:  # asked to stop before the last step (a request after it: the run is simply done)
        interrupt.exit(f"rl: stopped after step {step} with a checkpoint; continue with: toolcollapse rl --resume {run_dir}")
    return run_dir


def _rollback(run_dir: Path, step: int, model: Any, optimizer: torch.optim.Optimizer) -> int:
    """Restore the weights and RL optimizer state of the newest checkpoint taken before `step`'s weights
    (a checkpoint `step_k` holds the weights after k updates; step `step` ran on those after `step`)."""
    before = [p for p in complete_checkpoints(run_dir) if int(p.name.removeprefix("step_")) < step]
    if not before:
        raise RuntimeError(f"adaptive rollback at step {step}: no checkpoint before it in {run_dir}/checkpoints "
                           "(raise grpo.keep_checkpoints or lower grpo.checkpoint_every)")
    target = before[-1]
    for later in complete_checkpoints(run_dir):  # weights off the path from now on: never a later rollback's target
        if later.name > target.name:
            (later / MARKER).unlink(missing_ok=True)  # a crash mid-delete leaves no complete-looking half
            shutil.rmtree(later)
    model.load_state_dict(load_model(target, trainable=True).state_dict())
    optimizer.load_state_dict(torch.load(target / "trainer.pt", map_location="cpu", weights_only=False)["optimizer"])
    tqdm.write(f"rl: adaptive: rolled back to {target}")
    return int(target.name.removeprefix("step_"))


def _phase(phases: PhaseRunner, name: str, *, step: int, failures: Sequence[Any],
           optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """An SFT phase, then RL's AdamW state reset (its moments belong to the weights before the phase)."""
    stats = phases.run(name, step, failures)
    optimizer.state.clear()
    return stats


def run_sft_only(cfg: RunConfig, run_dir: Path, resume: bool) -> Path:
    """The `sft_only` control: SFT from `cfg.init` on the ground truth of training tasks (in the run's
    task order) for as many trained tokens as `supervision.sft_only` names, with `supervision.phase`'s
    epochs, LR and batch; no RL. Saves the result as the checkpoint an RL run of `grpo.steps` would."""
    run_dir = Path(run_dir)
    s, g = cfg.supervision, cfg.grpo
    if resume and complete_checkpoints(run_dir):
        return run_dir
    target = s.sft_only.tokens or matched_tokens(s.sft_only.match.replace("{seed}", str(cfg.seed)), cfg)
    set_threads(cfg.threads)
    seed_everything(cfg.seed)
    model, tokenizer, _ = _policy_and_reference(dataclasses.replace(cfg, grpo=dataclasses.replace(g, kl_coef=0.0)),
                                                Path(cfg.init), fresh=True)
    clear_run_dir(run_dir, "rl")
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / RUN_CONFIG)
    encoder = PieceEncoder(tokenizer)
    examples, tokens = [], 0
    for task in task_order(make_env(cfg).tasks(g.split, g.pool_size), cfg.seed):  # one epoch's tokens x epochs reach the target
        if tokens * s.phase.epochs >= target:
            break
        example = encode_tasks(encoder, [task], cfg.rollout.call_end)[0]
        if len(example[0]) > cfg.model.max_seq_len:
            continue
        examples.append(example)
        tokens += trained_tokens([example])
    if not examples:
        tqdm.write("rl: sft_only: the matched run trained on no SFT tokens; the control is the start itself")
    t0 = time.time()
    stats = sft_phase(model, examples, s.phase, g.micro_batch_size, tokenizer.pad_token_id, seed=cfg.seed)
    stats["phase/seconds"] = time.time() - t0
    tqdm.write(f"rl: sft_only: {len(examples)} tasks, {stats['phase/steps']:.0f} SFT steps, "
               f"{stats['phase/tokens']:.0f} tokens (matched to {target:.0f})")
    append_jsonl(run_dir / PHASES, {"step": g.steps, "phase": "sft_only", "target_tokens": target, **stats})
    save_checkpoint(run_dir, g.steps, model, tokenizer, make_optimizer(model, g.lr, g.weight_decay, g.betas),
                    lambda p: dump_config(cfg, p / "toolcollapse.yaml"), g.keep_checkpoints)
    return run_dir


def matched_tokens(match: str, cfg: RunConfig) -> float:
    """The SFT tokens a finished run spent (its metrics' running total)."""
    path = Path(match) / "metrics.jsonl"
    done = complete_checkpoints(Path(match))
    if not path.is_file() or not done or not done[-1].name.endswith(f"{cfg.grpo.steps:06d}"):
        raise ConfigError(f"supervision.sft_only.match: {match} is not a finished run of {cfg.grpo.steps} steps; "
                          "run it first, or put it in the same sweep (the control waits for it there)")
    tokens = sft_tokens_so_far(read_jsonl(path))
    if tokens <= 0 and not resume_config(Path(match)).supervision.adaptive.enabled:
        raise ConfigError(f"supervision.sft_only.match: {match} spent no SFT tokens; nothing to match")
    return tokens  # 0 only for an adaptive run that never alarmed: its control is the start itself


def validate(engine: RolloutEngine, tasks: Sequence[Task], cfg: RunConfig) -> dict[str, float]:
    """Greedy success and healthy-turn rate of the policy on fixed tasks, under the eval limits."""
    stats = rollout_stats(engine.generate(tasks, sampling_params(cfg, greedy=True), seed=cfg.seed))
    return {"val/success": stats["success"], "val/healthy_rate": stats["healthy_rate"]}


def _control_stats(collected: list, token_ids: dict[str, int]) -> dict[str, float]:
    if not collected:
        return {}
    targets, logp, old, entropy = (torch.cat(parts) for parts in zip(*collected))
    return sampled_control_stats(targets, logp, old, entropy, token_ids)


def probe_for(cfg: RunConfig, env: Any, tokenizer: Any) -> tuple[ProbeSet | None, dict[str, int]]:
    """The run's probe set (the first `monitor.probe_size` training tasks' oracle conversations, with their
    content labels; None when the probe is off) and the ids of the control tokens it reports."""
    m = cfg.monitor
    token_ids = resolve_token_ids(tokenizer, m.control_tokens)
    if m.probe_every <= 0 or m.probe_size <= 0:
        return None, token_ids
    tasks = env.tasks(cfg.grpo.split)[:m.probe_size]
    encoder = PieceEncoder(tokenizer)
    examples = encode_tasks(encoder, tasks, cfg.rollout.call_end)
    content = [content_labels(encoder, [*t.prompt, *t.reference], cfg.rollout.call_end) for t in tasks]
    return build_probe(examples, tokenizer.pad_token_id, resolve_token_ids(tokenizer, CONTROL_TAGS), content), token_ids


def check_run_start(cfg: RunConfig, run_dir: Path, resume: bool, overwrite: bool,
                    allow_change: Sequence[str] = ()) -> None:
    """ConfigError before anything is loaded or written: an RL-incompatible config, a directory another job
    holds (the lock is taken here and kept for the run's life), one that cannot be written, a new run aimed at
    another run's directory, a resumed run given another config than its checkpoint was saved with (except the
    keys in `allow_change`)."""
    resolve_device(cfg.device)  # ConfigError for a GPU that is not there
    problems = rl_problems(cfg)
    problems += checkpoint_problems(cfg, cfg.init) + pool_problems(cfg, cfg.init) if cfg.init else []
    if problems:
        raise ConfigError(problems[0])
    lock_dir(run_dir, "rl run")
    check_writable(run_dir, checkpoint_bytes(Path(cfg.init)) if cfg.init else 0)
    if not resume:
        check_new_run_dir(run_dir, overwrite, "rl", resume_hint=f"use --resume {run_dir} to continue it, ")
        if overwrite and cfg.init and Path(run_dir).resolve() in Path(cfg.init).resolve().parents:
            raise ConfigError(f"init {cfg.init} lies inside {run_dir}, which --overwrite would delete")
        return
    clean_partial(run_dir)
    saved = [resume_config(run_dir)]
    done = complete_checkpoints(run_dir)
    if done and (done[-1] / "toolcollapse.yaml").is_file():
        saved.append(load_config(done[-1] / "toolcollapse.yaml"))
    changed = {key: (was, now) for config in saved for key, was, now in differences(config, cfg)}
    refused = sorted(set(changed) - set(allow_change))
    if refused:
        listing = "; ".join(f"{k}: {changed[k][0]!r} -> {changed[k][1]!r}" for k in refused)
        raise ConfigError(f"{run_dir} was saved with another config than the one it would resume with ({listing}); "
                          f"restore it, or let them change: toolcollapse rl --resume {run_dir} --allow-change "
                          f"{','.join(refused)}")


class StorageError(ConfigError):
    """The run could not write its logs or a checkpoint (a full disk, a directory made read-only): one message
    that names the last good checkpoint and how to continue."""

    def __init__(self, run_dir: Path, err: OSError):
        done = complete_checkpoints(run_dir)
        last = f"the last good checkpoint is {done[-1]}" if done else "no checkpoint was saved"
        super().__init__(f"{err.strerror} writing {err.filename or run_dir}: the run stopped; {last}. Free space or "
                         f"make {run_dir} writable, then continue with: toolcollapse rl --resume {run_dir}")


def checkpoint_bytes(init: Path) -> int:
    """About what one checkpoint of a run from `init` takes: its weights three times (the model and AdamW's two
    moments), and some room for the rest."""
    return 3 * sum(f.stat().st_size for f in Path(init).glob("*.safetensors")) + (1 << 20)


def resume_config(run_dir: Path) -> RunConfig:
    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no {RUN_CONFIG})")
    return load_config(path)


def _truncate_logs(run_dir: Path, start: int) -> None:
    """Drop log lines of steps at or after `start`: a resumed run rewrites them. A line that does not parse (the
    torn last line of a run killed mid-write) is dropped with a warning."""
    for name in ("metrics.jsonl", "samples.jsonl", "alarms.jsonl", FAILURES, PHASES):
        path = run_dir / name
        if path.is_file():
            keep = []
            for number, line, record in jsonl_lines(path):
                if record is None or not isinstance(record.get("step"), int):
                    tqdm.write(f"rl: {path}:{number}: not a whole log line (a write cut short?), dropped")
                elif record["step"] < start:
                    keep.append(line)
            path.write_text("".join(line + "\n" for line in keep))


def _tensorboard(run_dir: Path, start: int):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run_dir / "tb"), purge_step=start if start else None)


def _log(run_dir: Path, writer, metrics: dict[str, float], samples) -> None:
    append_jsonl(run_dir / "metrics.jsonl", metrics)
    for record in samples:
        append_jsonl(run_dir / "samples.jsonl", record)
    for key, value in metrics.items():
        if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
            writer.add_scalar(key, value, metrics["step"])
    writer.flush()
