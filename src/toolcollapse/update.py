"""The GRPO update (arXiv 2402.03300; the paper's settings, arXiv 2606.26027): the rollouts as tensors, the
policy's log-probs at the sampled tokens, and one optimizer step per mini-batch of whole groups.

`policy_step` takes one RL step's episodes and rewards: group-normalised advantages over the whole batch,
then `grpo.updates_per_batch` passes, each one optimizer step per mini-batch (`grpo.mini_batches`), each
step in micro-batches of `grpo.micro_batch_size` rows (gradient accumulation) with the rows' shared
prefix (the system prompt) run once. Each optimizer step minimises the clipped surrogate with dual clip
on the sampled tokens only, plus beta * k3 KL to the frozen reference, token-mean over the mini-batch
(losses.py), and the supervision terms handed to it (the SFT term, unlikelihood, LUFFY's shaping on
expert rows); a non-finite loss or gradient norm skips the step, never the weights. The statistics the
monitor reads (ratios, clip fractions, entropy, the control tokens' sampled probabilities) come from the
same forward passes.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from toolcollapse.advantages import group_advantages
from toolcollapse.losses import aggregate, kl_k3, ppo_clip_loss
from toolcollapse.model import device_of, logits_after, logits_at, run_prefix, shared_prefix_len
from toolcollapse.monitor import SampledTokens, control_gradient_share
from toolcollapse.records import Episode, PolicyBatch
from toolcollapse.signals.base import LossTerm, OptimizerStep, RowKind


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


def grpo_update(model: Any, ref_logp: list[torch.Tensor] | None, optimizer: torch.optim.Optimizer,
                batch: PolicyBatch, cfg: Any, collect: SampledTokens | None = None, temperature: float = 1.0,
                terms: Sequence[LossTerm] = ()) -> UpdateStats:
    """One optimizer step over the whole batch, in micro-batches (gradient accumulation).

    `collect`, if given, is fed (targets, logp, old_logp, entropy) [M] of each micro-batch:
    the monitor's statistics come from this forward at no extra cost; the tokens of the
    batch's `expert` rows stay out (the policy did not sample them). `terms`: the supervision signals'
    loss terms (signals/), each already told which optimizer step this is (`LossTerm.begin`)."""
    n_tokens, n_seqs = int(batch.target_mask.sum()), len(batch)
    sums: Counter[str] = Counter()
    finite = True
    prefix, parts = update_plan(model, batch, cfg)
    for k, mb in enumerate(parts):
        logp, entropy = policy_logprobs(model, mb, temperature, prefix)
        old = mb.old_logp[mb.target_mask]
        seq_ids = mb.target_mask.nonzero()[:, 0]  # [M] row of each sampled token
        adv = mb.advantages[seq_ids]
        pg, pg_stats = ppo_clip_loss(logp, old, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
        for term in terms:
            pg = term.token_loss(pg, logp, adv, mb, seq_ids)
        per_token = pg
        kl = torch.zeros_like(logp)
        if ref_logp is not None:
            kl = kl_k3(logp, ref_logp[k])
            per_token = pg + cfg.kl_coef * kl
        loss = aggregate(per_token, seq_ids, cfg.loss_agg, n_tokens, n_seqs)  # the policy loss, as logged
        total = loss
        for term in terms:
            added = term.forward_loss(logp, mb)
            if added is not None:
                total = total + added
        if collect is not None:
            own = slice(None) if mb.expert is None else ~mb.expert[seq_ids]  # [M] the policy's own tokens
            collect.add(mb.input_ids[mb.target_mask][own], logp[own], old[own], entropy[own])
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
    for term in terms:
        if finite:
            finite &= term.backward(model)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)) if finite else math.nan
    skipped = not (finite and math.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return _update_stats(sums, n_tokens, grad_norm, skipped)


def _update_stats(sums: Counter[str], n_tokens: int, grad_norm: float, skipped: bool) -> UpdateStats:
    """An optimizer step's statistics from its micro-batches' sums (per sampled token where they are sums)."""
    per_tok = lambda key: sums[key] / max(1, n_tokens)  # noqa: E731
    return UpdateStats(loss=sums["loss"], pg_loss=sums["pg_loss"], kl_ref=per_tok("kl_ref"),
                       approx_kl_old=per_tok("approx_kl_old"), entropy=per_tok("entropy"),
                       clip_frac_low=per_tok("clip_frac_low"), clip_frac_high=per_tok("clip_frac_high"),
                       dual_clip_frac=per_tok("dual_clip_frac"), ratio_mean=per_tok("ratio_mean"),
                       ratio_max=sums["ratio_max"], ratio_min=sums.get("ratio_min", 1.0),
                       grad_norm=grad_norm, skipped_nonfinite=int(skipped), n_tokens=n_tokens)


def policy_step(model: Any, ref_model: Any | None, optimizer: torch.optim.Optimizer, episodes: Sequence[Episode],
                rewards: torch.Tensor, g: Any, pad_id: int, control_ids: dict[str, int],
                grad_share_rows: int = 0, temperature: float = 1.0, kinds: Sequence[RowKind] = (),
                terms: Sequence[LossTerm] = ()) -> dict[str, float]:
    """Advantages over the whole batch, then `updates_per_batch` passes over it, each one optimizer step per
    mini-batch of whole groups (`grpo.mini_batches`); their statistics. With grad_share_rows > 0, first the
    control tokens' share of the gradient on that many rollouts. `kinds`: each row's, when some are not the
    policy's own (HBG's hinted rows, OPS's expert rows); `terms`: the supervision signals' loss terms, in every
    optimizer step (a term's `marked` positions become the batch's `unlikely` mask)."""
    advantages, adv_stats = group_advantages(rewards, g.group_size, g.scale_adv_by_std)
    if g.skip_uninformative_steps and adv_stats.frac_groups_informative == 0:
        return {**asdict(adv_stats), "skipped_uninformative": 1, "skipped_nonfinite": 0}
    unlikely = next((term.marked for term in terms if term.marked is not None), None)
    batch = build_batch(episodes, advantages, pad_id, device_of(model), unlikely,
                        [k == "expert" for k in kinds] if kinds else None)
    if kinds and any(k != "policy" for k in kinds):  # hinted and expert rows: old log-probs of this policy
        recompute_old_logprobs(model, batch, [i for i, k in enumerate(kinds) if k != "policy"], g, temperature)
    share = grad_share(model, batch, g, control_ids, grad_share_rows, temperature) if grad_share_rows else {}
    slices = group_slices(len(batch), g.group_size, g.mini_batches)
    parts = [batch.rows(slice(*rows)) for rows in slices]
    ref_logp = [reference_logprobs(ref_model, part, g, temperature) if ref_model is not None else None
                for part in parts]
    collected = SampledTokens(control_ids)  # the last pass's forwards, for the control-token statistics
    updates = []
    for epoch in range(g.updates_per_batch):
        last = epoch == g.updates_per_batch - 1
        for part, ref, (start, end) in zip(parts, ref_logp, slices):
            for term in terms:
                term.begin(OptimizerStep(part, start, end, len(batch), g.group_size, last))
            updates.append(grpo_update(model, ref, optimizer, part, g, collect=collected if last else None,
                                       temperature=temperature, terms=terms))
    signals = {k: v for term in terms for k, v in term.metrics().items()}
    return {**asdict(adv_stats), **combine_updates(updates), **collected.reduce(), **share,
            **signals, "optimizer_steps": len(updates), "skipped_uninformative": 0}


def group_slices(n_rows: int, group_size: int, k: int) -> list[tuple[int, int]]:
    """[start, end) rows of each of `k` mini-batches of whole groups (contiguous, in batch order)."""
    n_groups = n_rows // group_size
    if n_groups % k:
        raise ValueError(f"{n_groups} groups do not split into {k} mini-batches")
    per = n_groups // k * group_size
    return [(j * per, (j + 1) * per) for j in range(k)]


def combine_updates(updates: Sequence[UpdateStats]) -> dict[str, float]:
    """One step's statistics over its optimizer steps: per-token means weighted by each step's tokens, the ratio's
    extremes over all of them, the mean gradient norm (and its largest), skipped steps counted."""
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
    return prefix, [batch.rows(rows).trimmed() for rows in plan]


def plan_rows(model: Any, batch: PolicyBatch, g: Any) -> tuple[BatchPrefix | None, list[torch.Tensor]]:
    """The batch's shared prefix run once and the rows [n] of each micro-batch of `grpo.micro_batch_size`,
    sorted by length; but where the prompts are long past that
    prefix (`grpo.by_prompt_min_tokens`; BFCL: each task its own 2-5 k-token system prompt, a batch sharing ~200 tokens) micro-batches
    by prompt, each running its rows' whole prompt once, instead of every row its own copy."""
    ids = [r.tolist() for r in batch.input_ids]
    shared = shared_prefix_len(ids)
    prompt_lens = batch.target_mask.float().argmax(dim=1).tolist()  # [N] the first sampled position
    sampled = [i for i, row in enumerate(batch.target_mask.any(dim=1).tolist()) if row]
    if (sampled and sum(prompt_lens[i] - shared for i in sampled) / len(sampled) >= g.by_prompt_min_tokens
            and len({tuple(ids[i][:prompt_lens[i]]) for i in sampled}) < len(sampled)):  # (some prompt has 2+ rows)
        return None, micro_batch_rows(batch, g.micro_batch_size, prompt_lens)
    return batch_prefix(model, batch, shared), micro_batch_rows(batch, g.micro_batch_size)


def micro_batch_rows(batch: PolicyBatch, size: int, prompt_lens: Sequence[int] | None = None) -> list[torch.Tensor]:
    """The rows [n] of each micro-batch of `size` rows of `batch`, sorted by their last sampled position
    (cut after it, the micro-batches pad little: the same sum of gradients as in any order).
    `prompt_lens` [N]: the rows of one prompt (its first `prompt_lens` tokens) apart from the others, each
    prompt's sorted by length, so that a micro-batch's rows share their whole prompt."""
    device = batch.target_mask.device
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
