"""ETS and PRS with TRL's trainers: GRPO rounds and SFT phases on the same model (`train_interleaved`)."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accelerate import PartialState
from accelerate.utils import gather_object
from datasets import Dataset

from toolcollapse.chat import PieceEncoder, generation_prompt
from toolcollapse.config import RunConfig
from toolcollapse.envs import make_env
from toolcollapse.integrations.trl._common import _append, _from_rank_zero, _sampled_runs
from toolcollapse.integrations.trl.environment import _task_lookup
from toolcollapse.interleave import Failure, judged, phase_examples
from toolcollapse.judge import judge_all, load_judge
from toolcollapse.parser import parse_turn_ids
from toolcollapse.records import Episode, TurnRecord


def train_interleaved(make_grpo: Any, make_sft: Any, rounds: int, window: int,
                      output_dir: str | Path | None = None, phase_data: Any = None) -> list[dict[str, Any]]:
    """ETS (and PRS) with TRL's trainers: `rounds` times, a GRPO round (`make_grpo(round)`: a
    MonitoredGRPOTrainer on the policy, its `args.max_steps` the round's steps, its dataset the round's part
    of the data, as a new trainer starts its data order over), then an SFT phase (`make_sft(dataset)`: e.g.
    TRL's SFTTrainer on the same model object) on the tasks with a reward <= 0 rollout, on any rank, in the
    round's last `window` steps -- the rule of ours and of the paper's released code.

    `phase_data(failures) -> (dataset, trained tokens per epoch)` builds the phase's data from the round's
    failures (each task's newest): by default `reference_rows` (prompt/completion text rows from the dataset's
    reference column: train the completion only); for our environments, `rl_phase_data(cfg, tokenizer,
    prs_target=...)`: our own examples, token for token, PRS's included (pre-tokenized rows, `labels` -100
    where nothing is trained, which SFTTrainer takes as they are).

    At a phase change, as in `toolcollapse rl`: each trainer brings a fresh optimizer (the moments of the
    weights before a phase do not carry over); the monitor's callback, if the trainers share one, keeps its
    rules and numbers the steps on across rounds. One difference: with beta > 0 TRL takes each round's KL
    reference from the model it is given (the post-SFT one; ours keeps the initial model). A round stopped
    by an alarm (`monitor.on_alarm: stop`) ends the schedule. Returns the phases' records, also written to
    <output_dir>/phases.jsonl (default: the first GRPO trainer's output_dir)."""
    phases: list[dict[str, Any]] = []
    offset = 0
    for round_ in range(rounds):
        grpo = make_grpo(round_)
        grpo.step_offset, grpo.failure_window = offset, window
        if rounds > 1 and hasattr(grpo, "checkpoint_subdir"):  # checkpoint-N of one round kept from the next's
            grpo.checkpoint_subdir = f"round_{round_}"
        if grpo.monitor is not None:
            grpo.monitor.step_offset = offset
        output_dir = Path(output_dir or grpo.args.output_dir)
        grpo.train()
        steps = grpo.state.global_step
        failed = sorted(gather_object([f for f in grpo.failures if f["step"] >= steps - window]),
                        key=lambda f: f["step"])  # rank order -> step order: the newest of each task last
        newest = list({json.dumps(f["prompt"], sort_keys=True, default=str): f for f in failed}.values())
        stopped = steps < grpo.args.max_steps
        offset += steps
        record: dict[str, Any] = {"step": offset, "round": round_, "phase": "ets", "tasks": len(newest)}
        if newest and not stopped:
            build = phase_data or functools.partial(reference_rows, tokenizer=grpo.processing_class)
            # built once, on rank 0 (a judge need not be deterministic), so every rank trains the same rows
            data, tokens, stats = _from_rank_zero(build(newest) if PartialState().is_main_process else None)
            record.update(stats)
            sft = make_sft(data)
            sft.train()
            epochs = sft.args.num_train_epochs if sft.args.max_steps <= 0 else None
            record["phase/tokens"] = tokens * epochs if epochs else None
            record["phase/steps"] = sft.state.global_step
            record["phase/loss"] = next((h["train_loss"] for h in reversed(sft.state.log_history)
                                         if "train_loss" in h), None)
        phases.append(record)
        _append(str(output_dir), "phases.jsonl", record)
        if stopped:
            break
    return phases


def reference_rows(failures: list[dict[str, Any]], tokenizer: Any) -> tuple[Any, int, dict[str, float]]:
    """ETS's data from the failures' reference column: text prompt/completion rows (SFTTrainer trains the
    completion), their completion tokens, and no stats."""
    if any(f.get("reference") is None for f in failures):
        raise ValueError("ETS phases from reference rows need the training dataset's reference column; for our "
                         "environments pass phase_data=rl_phase_data(cfg, tokenizer)")
    rows = [{"prompt": f["prompt"], "completion": f["reference"]} for f in failures]
    tokens = sum(len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) for r in rows)
    return Dataset.from_list(rows), tokens, {}


def reference_token_rows(failures: list[dict[str, Any]], tokenizer: Any) -> tuple[Any, int, dict[str, float]]:
    """ETS's data token for token as the SFT term trains it: each failed prompt's tokens as TRL fed them
    (`prompt_ids`, kept by MonitoredGRPOTrainer) with its reference completion tokenized after them, trained
    on the completion only. Pre-tokenized rows (`input_ids`, `labels` -100 on the prompt), so any prompt
    works: text, or the messages of one's own conversations (`conversations.reference_rows`)."""
    if any(f.get("reference") is None or f.get("prompt_ids") is None for f in failures):
        raise ValueError("reference_token_rows needs each failure's reference (the dataset's reference column) and "
                         "prompt_ids (failures kept by MonitoredGRPOTrainer)")
    rows, tokens = [], 0
    for f in failures:
        prompt = [int(i) for i in f["prompt_ids"]]
        reference = tokenizer(f["reference"], add_special_tokens=False)["input_ids"]
        rows.append({"input_ids": prompt + reference, "labels": [-100] * len(prompt) + reference})
        tokens += len(reference)
    return Dataset.from_list(rows), tokens, {}


def rollout_episode(task: Any, prompt_ids: Any, completion_ids: Any, sampled: Any, tokenizer: Any,
                    env: Any = None, call_end: str = "template", id_to_tag: Mapping[int, str] | None = None) -> Any:
    """A rollout played in TRL (its tool loop, or `engine_rollouts`), in toolcollapse's chat format, as our
    `Episode`: each run of sampled tokens one turn, parsed as our rollouts parse it -- against the tools the
    task offers at that turn (`env`, one of ours, stepped through the turns: BFCL adds tools on the way;
    None: the tools are not checked, only the format) -- and what came between two runs (tool replies, a next
    user turn) its observation: what the judge and the PRS examples read. (Success is not rescored: the
    rollouts kept are failures.) `id_to_tag`: `tag_of_ids(tokenizer)`, when a caller rebuilds many."""
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    prompt, completion = [int(i) for i in prompt_ids], [int(i) for i in completion_ids]
    mask = [int(bool(k)) for k in sampled]
    id_to_tag = tag_of_ids(tokenizer) if id_to_tag is None else id_to_tag
    ep = Episode(task.id, prompt + completion, [0] * len(prompt) + mask, [0.0] * (len(prompt) + len(mask)),
                 len(prompt))
    runs = _sampled_runs(mask)
    state = env.reset(task) if env is not None else None
    for k, (start, end) in enumerate(runs):
        parsed = parse_turn_ids(completion[start:end], id_to_tag, decode, state.tools if state else None, call_end)
        if state is not None and k + 1 < len(runs):
            env.step(state, parsed)  # the tools of the next turn
        record = TurnRecord(len(prompt) + start, len(prompt) + end, parsed)
        if k + 1 < len(runs):  # what the environment said between two turns: tool replies, a next user turn
            gap = decode(completion[end:runs[k + 1][0]])
            said = [m.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")
                    for m in re.findall(r"<\|im_start\|>(?:user|tool)\n(.*?)<\|im_end\|>", gap, re.S)]
            record.observation = "\n".join(said)
        ep.turns.append(record)
    last = ep.turns[-1].parsed if ep.turns else None
    ep.finish = ("answered" if last is not None and last.end == "answer" else
                 "max_turns" if last is not None and last.end == "call" else "malformed")
    ep.final_text = last.text if last is not None and last.end == "answer" else None
    return ep


def tag_of_ids(tokenizer: Any) -> dict[int, str]:
    """id -> control tag, of a tokenizer that has every tag (`chat.PieceEncoder` says what to do if not)."""
    return {i: t for t, i in PieceEncoder(tokenizer).special_ids.items() if i is not None}


def rl_phase_data(cfg: RunConfig, tokenizer: Any, prs_target: str | None = None, judge: Any = None,
                  call_end: str = "template", max_len: int | None = None) -> Any:
    """`phase_data` for `train_interleaved` on any of our environments (rows with `task_id`: from
    `tool_world_dataset` or `task_dataset`): the phase's examples as `toolcollapse rl` builds them
    (`interleave.phase_examples`): each failed task's ground truth (ETS) and, with `prs_target` (reflection
    or correction), one example per failure from the judge's verdict on its rollout (`judge`: default the
    config's `supervision.prs.judge`), rebuilt with `rollout_episode`. Rows are pre-tokenized: `input_ids` and `labels`
    (-100 where the example trains nothing); SFTTrainer takes them as they are with `SFTConfig(max_length=
    None)` (its default, 1024, would cut long prompts such as BFCL's)."""
    if prs_target not in (None, "reflection", "correction"):
        raise ValueError(f"prs_target {prs_target!r}: None (ETS), reflection or correction")
    world, encoder = make_env(cfg), PieceEncoder(tokenizer, call_end)
    # the config's judge (supervision.prs.judge: deterministic, a chat model, a factory), asked once now
    judge = judge or (load_judge(cfg.supervision.prs.judge) if prs_target is not None else None)
    task = _task_lookup(world, cfg)
    generation_prompt_len = len(encoder.encode(generation_prompt())[0])

    def decode(ids: Any) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def build(failures: list[dict[str, Any]]) -> tuple[Any, int, dict[str, float]]:
        if any(f.get("task_id") is None for f in failures):
            raise ValueError("rl_phase_data needs each row's task_id: train on tool_world_dataset or task_dataset rows")
        tasks = {f["task_id"]: task(f["task_id"]) for f in failures}
        ours = [Failure(f["step"], f["task_id"]) for f in failures]
        if prs_target is not None:
            items = [(tasks[f["task_id"]], rollout_episode(tasks[f["task_id"]], f["prompt_ids"], f["completion_ids"],
                                                           f["sampled"], tokenizer, world, call_end)) for f in failures]
            verdicts = judge_all(judge, items, decode)  # a chat-model judge: `concurrency` calls in flight
            ours = [judged(failure, task, episode, verdict, decode, generation_prompt_len)
                    for failure, (task, episode), verdict in zip(ours, items, verdicts)]
        examples, stats = phase_examples(ours, tasks, encoder, prs_target, max_len or cfg.model.max_seq_len)
        if hasattr(judge, "metrics"):
            stats = {**stats, **judge.metrics()}
        rows = [{"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask)]} for ids, mask in examples]
        return Dataset.from_list(rows), sum(sum(mask) for _, mask in examples), stats

    return build
