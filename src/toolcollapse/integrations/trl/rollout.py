"""Our rollout engine as TRL's `rollout_func` (`engine_rollouts`), on any of our environments."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from toolcollapse.config import RunConfig
from toolcollapse.envs import make_env
from toolcollapse.evaluate import sampling_params
from toolcollapse.integrations.trl._common import _generation_model
from toolcollapse.integrations.trl.environment import task_rows
from toolcollapse.rollout import RolloutEngine
from toolcollapse.signals import HBG
from toolcollapse.supervision import without_hint


def task_dataset(cfg: RunConfig, split: str = "train", n: int | None = None) -> Any:
    """The split's tasks of any of our environments (the tool world, BFCL multi-turn) as TRL rows for
    `engine_rollouts` (`task_rows`)."""
    return task_rows(make_env(cfg).tasks(split, n))


def _prompt_key(prompt: Any) -> int:
    if isinstance(prompt, str):
        return hash(prompt)
    return hash(tuple((m["role"], m["content"]) for m in prompt))


def _check_trainer(trainer: Any, temperature: float) -> None:
    if abs(trainer.temperature - temperature) > 1e-9:
        raise ValueError(f"engine_rollouts: GRPOConfig.temperature {trainer.temperature} differs from the run "
                         f"config's rollout.temperature {temperature}; set them equal")
    deepspeed = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if getattr(trainer, "is_fsdp_enabled", False) or (
            deepspeed is not None and deepspeed.zero_stage == 3 and not trainer.args.ds3_gather_for_generation):
        # each forward there is a collective, and the engine's number of forwards differs across ranks
        raise ValueError("engine_rollouts runs the whole model on each rank: use DDP or DeepSpeed ZeRO (with "
                         "ZeRO-3, ds3_gather_for_generation=True), not FSDP")


class TaskPool:
    """The tasks a `rollout_func` plays, looked up by a row's task_id or, without one, by its prompt."""

    def __init__(self, tasks: Sequence[Any]):
        self.by_id = {t.id: t for t in tasks}
        self.by_prompt: dict[int, Any] = {}
        for t in tasks:  # two tasks with one prompt: only the rows' task_id can tell them apart
            key = _prompt_key([{"role": m.role, "content": m.content} for m in t.prompt])
            self.by_prompt[key] = None if key in self.by_prompt else t

    def check(self, data: Any, split: str) -> None:
        """Every row of a training dataset is one of the tasks."""
        ids = data["task_id"] if "task_id" in (data.column_names or ()) else None
        unknown = ([i for i in ids if i not in self.by_id] if ids is not None else
                   [p for p in data["prompt"] if self.by_prompt.get(_prompt_key(p)) is None])
        if unknown:
            raise ValueError(f"engine_rollouts: {len(unknown)} rows of the training dataset are none of the tasks' "
                             f"(build it with task_dataset(cfg, {split!r}), or pass the tasks; rows whose prompts "
                             "are equal need a task_id column)")

    def rows(self, prompts: list[Any], inputs: list[dict[str, Any]] | None) -> list[Any]:
        """The batch's tasks (`inputs`: a MonitoredGRPOTrainer's rows, with their task_id)."""
        if inputs is not None and len(inputs) == len(prompts) and all("task_id" in x for x in inputs):
            rows = [self.by_id.get(x["task_id"]) for x in inputs]
        else:
            rows = [self.by_prompt.get(_prompt_key(p)) for p in prompts]
        if any(t is None for t in rows):
            raise ValueError("engine_rollouts: a row that is none of the tasks' (rows whose prompts are equal need "
                             "their task_id and a MonitoredGRPOTrainer)")
        return rows


def engine_rollouts(cfg: RunConfig, tokenizer: Any, split: str = "train", tasks: Sequence[Any] | None = None) -> Any:
    """A TRL `rollout_func` in which toolcollapse's own engine plays the batch's episodes, on any of our
    environments (`cfg.env`): the tool world, and BFCL multi-turn, whose later user turns TRL's tool loop
    cannot play (it ends a rollout at the first reply without a call). The rows' prompts must be the tasks'
    (`task_dataset(cfg, split)`; `tasks` or the whole `split` are looked up). Rollouts take `cfg.rollout`'s
    limits (turns, tokens per turn, context) and the KV-cached engine (one prefill per prompt and group, the
    shared system prompt attended once); TRL's `temperature` must equal `rollout.temperature` (the
    log-probs the engine returns are at it). Returns, per row, the prompt and completion ids, `env_mask` (1
    where the policy sampled: TRL's loss and our monitor see only those), the sampling log-probs, and for
    reward functions `success` (the environment's verdict: `episode_success`) and `finish`. The OPS rows of
    a `MonitoredGRPOTrainer` (`ops`) are the task's ground truth replayed, its tool replies really run
    (`RolloutEngine.replay`, as `toolcollapse rl` builds OPS's expert rows); its HBG rows (`hbg`) sample
    with the hint of the trainer's HBG signal, or else the run config's (`signals.HBG`) in the system
    message and return the hint-free prompt to train on, as `rl` does (`signals.group_rollouts`)."""
    env = make_env(cfg)
    pool = TaskPool(tasks if tasks is not None else env.tasks(split))
    signals: dict[str, HBG] = {}  # the HBG signal (its hint writer), once a batch has hinted rows
    params = sampling_params(cfg, greedy=False)
    checked: set[int] = set()  # the training datasets already checked against the tasks

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        _check_trainer(trainer, params.temperature)
        if id(trainer.train_dataset) not in checked:  # the whole dataset at once, on every rank alike: a row
            checked.add(id(trainer.train_dataset))      # unknown to one rank's batch only would hang the others
            pool.check(trainer.train_dataset, split)
        rows = pool.rows(prompts, getattr(trainer, "_inputs", None))

        def flags(name: str) -> list[bool]:  # a MonitoredGRPOTrainer's OPS / HBG rows of this batch
            value = getattr(trainer, name, None)
            return value.tolist() if value is not None and len(value) == len(rows) else [False] * len(rows)

        expert, hinted = flags("_expert"), flags("_hinted")
        sampled = [i for i, e in enumerate(expert) if not e]
        hint = getattr(trainer, "hint_prompt", None)  # the trainer's HBG signal's, when it was given one
        if any(hinted) and hint is None:
            if "hbg" not in signals:  # the config's hint writer, loaded (and asked once) at first use
                signals["hbg"] = HBG(cfg)
            hint = signals["hbg"].hinted
        prompts = [hint(rows[i]) if hinted[i] else rows[i] for i in sampled]
        # G contiguous rows of a prompt: one prefill, its cache repeated (the engine's groups)
        runs = [len(list(g)) for _, g in itertools.groupby((rows[i].id, hinted[i]) for i in sampled)]
        group = runs[0] if runs and len(set(runs)) == 1 else 1
        step = getattr(trainer, "step_offset", 0) + trainer.state.global_step  # on across train_interleaved rounds
        rank = trainer.accelerator.process_index
        seed = (trainer.args.seed * 1_000_003 + step * 1_009 + rank) % 2**63
        episodes: dict[int, Any] = {}
        with _generation_model(trainer) as model:
            engine = RolloutEngine.from_config(model, tokenizer, env, cfg.rollout)
            own = engine.generate(prompts[::group], params, group_size=group, seed=seed)
            episodes.update((i, without_hint(ep, engine.prompt_ids(rows[i])) if hinted[i] else ep)
                            for i, ep in zip(sampled, own))
            replayed = [i for i, e in enumerate(expert) if e]
            episodes.update(zip(replayed, engine.replay([rows[i] for i in replayed], params)))
        out: dict[str, list[Any]] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "success",
                                                    "finish")}
        for i in range(len(rows)):
            ep = episodes[i]
            n = ep.prompt_len
            out["prompt_ids"].append(ep.tokens[:n])
            out["completion_ids"].append(ep.tokens[n:])
            out["logprobs"].append(ep.logprobs[n:])
            out["env_mask"].append(ep.loss_mask[n:])
            out["success"].append(float(ep.success))
            out["finish"].append(ep.finish)
        return out

    return rollout


def episode_success(completions: list[Any], success: list[float] | None = None, **_: Any) -> list[float]:
    """The environment's verdict on each episode `engine_rollouts` played: 1 solved, else 0."""
    if success is None:
        raise ValueError("episode_success needs the rollouts of engine_rollouts (rollout_func=engine_rollouts(...))")
    return [float(x) for x in success]
