"""Checks that involve a stage or a checkpoint, before any work: an RL run's settings (`rl_problems`), its task
pools against the checkpoint's SFT (`pool_problems`), the checkpoint's call format (`checkpoint_problems`)."""

from __future__ import annotations

from pathlib import Path

from toolcollapse.config.files import load_config
from toolcollapse.config.schema import RunConfig


def rl_problems(cfg: RunConfig) -> list[str]:
    """What stops `cfg` from being an RL run (`rl`, `sweep`, `run_rl` check it before any work)."""
    problems = []
    if cfg.rollout.top_p < 1:
        problems.append(f"rollout.top_p: {cfg.rollout.top_p:g} < 1 is for evaluation only; RL samples from the "
                        "full distribution, because the update's log-probs (the importance ratio's numerator) "
                        "are the untruncated policy's")
    if cfg.grpo.prompts_per_step % cfg.grpo.mini_batches:
        problems.append(f"grpo.mini_batches: {cfg.grpo.mini_batches} does not divide grpo.prompts_per_step="
                        f"{cfg.grpo.prompts_per_step}; a mini-batch holds whole groups")
    s, g = cfg.supervision, cfg.grpo.group_size
    own = (s.ops.rows if s.ops.enabled else 0) + (s.hbg.rows if s.hbg.enabled else 0)
    if own >= g:
        problems.append(f"supervision: {own} expert (ops.rows) and hinted (hbg.rows) rows leave none of "
                        f"grpo.group_size={g} to sample on-policy; lower them or raise the group size")
    if s.prs.enabled and not s.ets.enabled:
        problems.append("supervision.prs: PRS trains in ETS's phases on ETS's data plus reflections; "
                        "set supervision.ets.enabled: true (and its every / window)")
    if s.ets.enabled and s.ets.window > s.ets.every:
        problems.append(f"supervision.ets: window={s.ets.window} > every={s.ets.every}: the window is the last "
                        "steps of one round")
    if s.adaptive.enabled and s.adaptive.rollback and cfg.grpo.keep_checkpoints < 2:
        problems.append("supervision.adaptive.rollback needs grpo.keep_checkpoints >= 2: the newest checkpoint "
                        "can be the alarming step's own weights, and the one before it is the rollback target")
    if s.sft_only_enabled and (s.sft_only.tokens > 0) == (s.sft_only.match is not None):
        problems.append("supervision.sft_only: give tokens or match, not both")
    return problems



def sft_tasks_read(cfg: RunConfig) -> int:
    """How many of the train split's first tasks `cfg`'s SFT reads (its main phase's and warm-ups' conversations)."""
    sc = cfg.sft
    return min(cfg.world.n_train, max([sc.steps * sc.batch_size, *(w.steps * w.batch_size for w in sc.copy_warmup)]))


def pool_problems(cfg: RunConfig, checkpoint: str | Path) -> list[str]:
    """What makes an RL run on the `rl` or `val` tasks unfair from a checkpoint of ours: SFT on tasks past
    `world.sft_pool` (tasks of that pool), or on another world."""
    trained = Path(checkpoint) / "toolcollapse.yaml"
    if cfg.env != "toolworld" or cfg.grpo.split not in ("rl", "val") or not trained.is_file():
        return []
    sft = load_config(trained)
    if (sft.world.seed, sft.world.n_train) != (cfg.world.seed, cfg.world.n_train):
        return [f"grpo.split {cfg.grpo.split}: {checkpoint} was trained on another world (world.seed "
                f"{sft.world.seed}, n_train {sft.world.n_train}); its pools and this run's are not disjoint"]
    read = sft_tasks_read(sft)
    if read > cfg.world.sft_pool:
        return [f"grpo.split {cfg.grpo.split}: {checkpoint}'s SFT read the first {read} train tasks, past "
                f"world.sft_pool={cfg.world.sft_pool}, where the val and rl tasks start; train the start within the "
                "pool or raise world.sft_pool"]
    return []


def checkpoint_problems(cfg: RunConfig, checkpoint: str | Path) -> list[str]:
    """What stops a checkpoint of ours (its `toolcollapse.yaml` says how it was trained) from
    running under `cfg`: a model that learnt another `rollout.call_end`."""
    trained = Path(checkpoint) / "toolcollapse.yaml"
    if not trained.is_file():
        return []
    call_end = load_config(trained).rollout.call_end
    if call_end == cfg.rollout.call_end:
        return []
    return [f"rollout.call_end: {cfg.rollout.call_end!r} here, but {checkpoint} was trained with {call_end!r}: "
            f"the policy would not know where its call turns end"]


def rl_start_problems(cfg: RunConfig) -> list[str]:
    """What stops an RL run from its config alone (the config, and the checkpoint it starts from): checked
    before anything heavy is imported, so a refused config answers at once."""
    return rl_problems(cfg) + (checkpoint_problems(cfg, cfg.init) + pool_problems(cfg, cfg.init) if cfg.init else [])
