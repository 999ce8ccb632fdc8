"""What a run writes: every file of an RL run, an SFT run, an evaluation and a study, and every metric
key an RL run logs to `metrics.jsonl`, with its unit and meaning, as the code writes them.

`python -m toolcollapse.outputs > docs/OUTPUTS.md` renders it; tests/test_outputs.py checks that the
page is up to date and that a run with every signal on logs no key this module does not document.

Paths are relative to the directory named in each group; metric keys are patterns where `<name>` stands
for one variable part (never containing `/`), the values it takes listed in the meaning.
"""

from __future__ import annotations

import re
import typing
from typing import Iterable

from toolcollapse.chat import SHORT
from toolcollapse.config import MonitorConfig
from toolcollapse.monitor import CONTENT_NAMES, SLOT_NAMES
from toolcollapse.records import ErrorType, FinishReason, TurnState


def _listed(values: Iterable[str]) -> str:
    return ", ".join(f"`{v}`" for v in values)


STATES = _listed(s.value for s in TurnState)
ERRORS = _listed(e.value for e in ErrorType)
FINISHES = _listed(typing.get_args(FinishReason))
SLOTS = _listed(SLOT_NAMES.values())
CONTENTS = _listed(CONTENT_NAMES.values())
TAGS = _listed(SHORT.get(t, t) for t in MonitorConfig.control_tokens)

# ----------------------------------------------------------------------------- files

CHECKPOINT = "checkpoints/step_<NNNNNN>"

RUN_FILES: list[tuple[str, str]] = [
    ("config.yaml", "The resolved run config (`RunConfig`) the run started with; `--resume` refuses another one "
                    "(except the keys named in `--allow-change`)."),
    ("metrics.jsonl", "One JSON object per RL step, the keys in the metric table below. A resumed run drops the "
                      "lines at and after the step it resumes from and writes them again."),
    ("samples.jsonl", "Decoded rollouts: the first `grpo.samples_per_step` of each step, plus the first group's "
                      "hinted and expert rows. Fields `step`, `task_id`, `reward`, `finish`, `states` (the turn "
                      "states), `kind` (`hinted` or `expert`; absent for the policy's own rows) and `text` (the "
                      "tokens after the prompt, decoded)."),
    ("alarms.jsonl", "Written once an alarm fires (alarms.py): one line per alarm, `step`, `series`, `detector`, "
                     "`value` (the series' value then); after a recovery by the adaptive schedule (or a custom "
                     "handler's events) a line `step`, `event: recovery` and the `adaptive/*` keys of that step."),
    ("failures.jsonl", "With ETS or the adaptive schedule's SFT (`supervision.interleaved`): one line per failed "
                       "task and step (`interleave.Failure`: `step`, `task_id`; under PRS the judge's `turn`, "
                       "`mistake`, `reflection`, `judge_prompt`, and the failed `prefix` token ids, `closed`, "
                       "`observation`, `closing_turn`, `resume_turn`). A resumed run rebuilds its phases from it."),
    ("phases.jsonl", "One line per SFT phase: `step` (the phase follows it), `phase` (`ets`, `adaptive` or "
                     "`sft_only`) and its `phase/*` statistics (the same as `ets/*` in the metric table); the "
                     "`sft_only` control's line also has `target_tokens`, the SFT tokens it matches."),
    ("tb/events.out.tfevents.<...>", "TensorBoard scalars: every finite number of a `metrics.jsonl` line but "
                                     "`step`, at its step."),
    (f"{CHECKPOINT}/", "A checkpoint after NNNNNN updates (six digits): every `grpo.checkpoint_every` steps, "
                       "after the last step, after a step with an ETS or adaptive phase or a recovery, on an "
                       "alarm's `checkpoint` or `stop`, and on SIGTERM / SIGINT; `step_000000` before the first "
                       "step when the adaptive schedule may roll back. The newest `grpo.keep_checkpoints` are "
                       "kept. An `sft_only` control writes only `step_<grpo.steps>`."),
    (f"{CHECKPOINT}/config.json, generation_config.json, model.safetensors",
     "The policy as `save_pretrained` writes it (`toolcollapse eval` and `rl --init` read it); with "
     "`model.lora.rank > 0` the adapters instead: `adapter_config.json`, `adapter_model.safetensors`."),
    (f"{CHECKPOINT}/tokenizer.json, tokenizer_config.json, chat_template.jinja",
     "The tokenizer as `save_pretrained` writes it (the file names depend on the transformers version)."),
    (f"{CHECKPOINT}/toolcollapse.yaml", "The run's config, as `config.yaml`; a resume compares it too."),
    (f"{CHECKPOINT}/trainer.pt", "`torch.save` of `{step, optimizer, rng}`: the updates done, AdamW's state "
                                 "dict, the Python, NumPy and torch RNG states; `--resume` continues exactly."),
    (f"{CHECKPOINT}/COMPLETE", "Written last (the step number as text): a directory without it is not a "
                               "checkpoint."),
    ("checkpoints/.step_<NNNNNN>.partial/, .step_<NNNNNN>.replaced/",
     "A checkpoint being written, or the one it replaces (the same step saved again after a rollback); "
     "renamed into place when whole, removed (or finished) by the next start."),
    (f"{CHECKPOINT}/eval/", "Evaluations of the checkpoint (the evaluation files below), by `toolcollapse "
                            "eval` or a sweep's final evaluation."),
    ("diagnose/summary.json", "`toolcollapse diagnose <run>`: `run`, `steps_done`, `healthy_start`, "
                              "`healthy_min`, `collapse_step`, `below_20_step`, `first_alarm`, `lead_steps` "
                              "(collapse step - first alarm), `alarms` and `baseline_alarms` (each `step`, "
                              "`series`, `detector`, `value`: the run's rules and the baseline detectors replayed "
                              "over `metrics.jsonl`)."),
    ("diagnose/control_tokens.png, states.png, errors.png, content.png",
     "`diagnose`'s figures: the probe's control-token series with alarms and the collapse marked, the four "
     "turn states, the error types over steps, and (when the probe logged them) the content log-probs."),
    ("../.<run>.lock", "Beside the run directory: the OS lock (flock) a running job holds on it, with its pid."),
]

SFT_FILES: list[tuple[str, str]] = [
    ("toolcollapse.yaml", "The resolved config; written first (it marks the directory as an SFT run's) and again "
                          "at the end."),
    ("metrics.jsonl", "One line per logged step (every `sft.log_every` and `sft.val_every` steps and the last of "
                      "each phase): `step` (counted across phases), `phase` (`sft`, or `copy warm-up` / `copy "
                      "warm-up <i>`), `loss` (mean NLL per target token, nats), `accuracy` (share of targets that "
                      "are the argmax), `lr`, `grad_norm` (before clipping), `elapsed_s` (seconds since the "
                      "start); on validation steps `val/loss` (nats) and `val/acc_digit`, `val/acc_word`, "
                      "`val/acc_structure` (accuracy by kind of target token on 64 `val` tasks, else `test`)."),
    ("config.json, generation_config.json, model.safetensors",
     "The model as `save_pretrained` writes it, LoRA adapters merged into the weights."),
    ("tokenizer.json, tokenizer_config.json, chat_template.jinja",
     "The tokenizer (trained on the world's text for `model.source: scratch`)."),
    ("SFT_COMPLETE", "Written last, the seconds the run took: a study reuses an SFT directory only with it."),
    ("../.<sft dir>.lock", "Beside the directory: the lock a running SFT holds on it."),
]

EVAL_FILES: list[tuple[str, str]] = [
    ("eval/<split>.jsonl", "Under the checkpoint evaluated (or the path `toolcollapse eval --out` names): one "
                           "line per episode, `task_id`, `template`, `n_calls`, `question`, `answer`, "
                           "`final_text`, `success`, `finish`, `n_tokens` and `turns` (per assistant turn: "
                           "`state`, `errors`, `end` (`call`, `answer`, `none`), `detail`, `call` (`name`, "
                           "`arguments`), `text`, `observation`); `sample` (its index) when a task is sampled "
                           "several times."),
    ("eval/<split>.summary.json", "The summary (`EvalSummary`): `split`, `n_episodes`, `success_rate`, "
                                  "`success_ci95` (Wilson), `n_turns`, `state_rates`, `healthy_rate`, "
                                  "`error_counts` (turns showing each error), `finish_counts`, "
                                  "`success_by_template`, `mean_turns`, `seconds`, `limits` (`max_turns`, "
                                  "`max_new_tokens`, `max_seq_len`, `greedy`, `call_end`; sampled: "
                                  "`temperature`, `top_p`, `seed`, `samples`; `dtype` when not float32): only "
                                  "evaluations under equal limits are compared."),
    ("eval/<split>-sampled.jsonl, eval/<split>-sampled.summary.json",
     "The same for a sampled evaluation (`eval.greedy: false`, `eval.samples` episodes a task; a sweep's "
     "`eval_samples` at `eval_temperature`)."),
]

STUDY_FILES: list[tuple[str, str]] = [
    ("study.yaml", "`toolcollapse study`: the study file as it ran (its overrides applied); `toolcollapse report "
                   "<out_dir>` reads it."),
    ("provenance.json", "A list of `{commit, date, command}`: where and when the study's runs were started, a new "
                        "entry whenever it runs another commit's code."),
    ("selection.json", "The tries' choice, per setting with `tries`: `chosen` (index), `split`, `seed` and "
                       "`tries` (each `setting`, `overrides`, `success` on the selection split)."),
    ("start/init.sha256", "sha256 of the starting checkpoint's weights: the study refuses to go on from others."),
    ("start/eval/<split>.jsonl, start/eval/<split>.summary.json",
     "The starting checkpoint's evaluations under the sweep's limits (the evaluation files; `-sampled` too)."),
    ("<setting>/seed<seed>/", "One RL run (the run files); its final checkpoint's evaluations in "
                              "`checkpoints/step_<steps>/eval/`. A setting's tries are the settings "
                              "`<setting>.t<k>`."),
    ("report/report.md, report/report.html", "The report (tables, figures, findings; the HTML self-contained), "
                                             "rewritten from the run directories; `toolcollapse report --out` "
                                             "writes it elsewhere."),
    ("report/figures/control_tokens.png, report/figures/states_lr<lr>.png",
     "The report's figures: the probe's control-token series of a plain-GRPO run, and the four turn states "
     "per arm at each learning rate."),
    (".stop", "While a sweep stops (SIGTERM / SIGINT): every run stops after its step with a checkpoint, and "
              "runs not started do not start; removed at the end."),
    ("../.<out_dir>.lock", "Beside the directory: the lock a running study or sweep holds on it."),
    ("<init>/", "When `init` holds no finished SFT and `sft_config` is set: the SFT run (the SFT files) the "
                "study trains there first (at the `init` path, not under `out_dir`)."),
]

# ----------------------------------------------------------------------------- metrics.jsonl of an RL run

OWN = "of the policy's own rollouts (hinted and expert rows left out)"

PHASE_STATS: list[tuple[str, str, str]] = [  # an SFT phase's statistics (interleave.sft_phase, PhaseRunner.run)
    ("tasks", "count", "Failed tasks whose ground truth the phase trained on."),
    ("prs_examples", "count", "PRS examples (one per judged failure) it trained on besides."),
    ("too_long", "count", "Examples left out, longer than `model.max_seq_len`."),
    ("steps", "count", "SFT optimizer steps taken (`supervision.phase.epochs` passes in batches of "
                       "`phase.batch_size`)."),
    ("tokens", "tokens", "Trained tokens, over all its epochs (they add to `sup/sft_tokens_total`)."),
    ("skipped_nonfinite", "count", "SFT steps skipped for a non-finite loss or gradient norm (absent when the "
                                   "phase had no examples)."),
    ("loss_first", "nats", "Token-mean NLL of its first SFT step (absent without steps)."),
    ("loss_last", "nats", "Token-mean NLL of its last SFT step (absent without steps)."),
    ("seconds", "s", "Wall time of the phase."),
]

METRICS: list[tuple[str, str, str]] = [
    # the step
    ("step", "step", "The step, from 0: its rollouts (and probe, validation) ran on the weights after `step` "
                      "updates."),
    ("lr", "learning rate", "The step's learning rate: the schedule (`grpo.lr`, `schedule`, `warmup_steps`, "
                            "`min_lr_ratio`) times the adaptive schedule's LR scale so far."),
    # rewards and advantages (advantages.py), over all rows of the step
    ("reward_mean", "reward", "Mean reward over every row of the step (hinted and expert rows too): 1 if "
                              "solved, else 0, plus the `grpo.format_reward` and `grpo.partial_credit` shaping "
                              "when set."),
    ("reward_std_within_group", "reward", "Mean over groups of the rewards' standard deviation within the group."),
    ("frac_groups_informative", "fraction 0-1", "Share of groups whose rewards are not all equal (the others "
                                                "have advantage 0: no learning signal)."),
    ("skipped_uninformative", "flag 0/1", "1 when `grpo.skip_uninformative_steps` skipped the update (every group "
                                          "uninformative): the update's keys are then absent."),
    # the update (update.grpo_update, combine_updates)
    ("loss", "dimensionless", "The policy loss as minimised, without the supervision terms: clipped surrogate "
                              "(LUFFY's shaped loss on expert tokens) + `kl_coef` * k3 KL, reduced by "
                              "`grpo.loss_agg`; mean over the step's optimizer steps weighted by their tokens. "
                              "This and the keys below through `ratio_min` count every trained token of the "
                              "batch, OPS's expert rows' too."),
    ("pg_loss", "dimensionless", "The policy-gradient part of `loss` (no KL term)."),
    ("kl_ref", "nats", "Mean k3 estimate of KL(policy || frozen initial model) per sampled token (0 when "
                       "`grpo.kl_coef` is 0)."),
    ("approx_kl_old", "nats", "Mean 0.5 * (log ratio)^2 per sampled token: how far the policy moved from the one "
                              "that sampled."),
    ("entropy", "nats", "Mean entropy of the policy's sampling distribution (logits / `rollout.temperature`) at "
                        "the sampled tokens, in the update's forward."),
    ("clip_frac_low", "fraction 0-1", "Share of sampled tokens with A < 0 and ratio < 1 - `clip_low` (gradient "
                                      "cut by the lower clip)."),
    ("clip_frac_high", "fraction 0-1", "Share of sampled tokens with A > 0 and ratio > 1 + `clip_high` (gradient "
                                       "cut by the upper clip)."),
    ("dual_clip_frac", "fraction 0-1", "Share of sampled tokens with A < 0 and ratio > `dual_clip` (loss bounded "
                                       "by the dual clip)."),
    ("ratio_mean", "ratio", "Mean importance ratio exp(logp - logp_sampling) over the sampled tokens (1 on the "
                            "first optimizer step of a pass)."),
    ("ratio_max", "ratio", "Largest importance ratio of any sampled token over the step's optimizer steps."),
    ("ratio_min", "ratio", "Smallest importance ratio of any sampled token over the step's optimizer steps."),
    ("grad_norm", "L2 norm", "Mean over the step's optimizer steps of the total gradient norm before clipping to "
                             "`grpo.grad_clip` (the SFT term's gradient included); finite ones only."),
    ("grad_norm_max", "L2 norm", "The largest of those gradient norms."),
    ("skipped_nonfinite", "count", "Optimizer steps of the step skipped for a non-finite loss or gradient norm "
                                   "(the weights untouched)."),
    ("optimizer_steps", "count", "Optimizer steps the step took: `grpo.updates_per_batch` * `grpo.mini_batches`."),
    # the rollouts (turn_stats.rollout_stats), the policy's own rows only
    ("success", "fraction 0-1", f"Share {OWN} that solved the task (the environment's verdict)."),
    ("healthy_rate", "fraction 0-1", f"Share of the assistant turns {OWN} in a healthy state (`healthy_call`, "
                                     "`healthy_response`); the collapse is defined on it."),
    ("turns_per_episode", "turns", f"Mean assistant turns per rollout, {OWN}."),
    ("response_tokens", "tokens", f"Mean sampled (trained) tokens per rollout, {OWN}."),
    ("state/<state>", "fraction 0-1", f"Share of the assistant turns {OWN} in that state; `<state>`: {STATES}."),
    ("error/<kind>", "fraction 0-1", f"Share of the assistant turns {OWN} whose parse shows that error (a turn "
                                     f"may show several); `<kind>`: {ERRORS}."),
    ("finish/<reason>", "fraction 0-1", f"Share {OWN} that ended so, only the reasons seen at the step; "
                                        f"`<reason>`: {FINISHES}."),
    # timing
    ("seconds", "s", "Wall time of the step from its start until its row is written (its SFT phases and alarm "
                     "handling included; not the checkpoint)."),
    ("seconds_rollout", "s", "Wall time of the rollouts (HBG's hinted rows and OPS's replay included)."),
    ("seconds_probe", "s", "Wall time of the probe (about 0 on steps without one)."),
    ("seconds_val", "s", "Wall time of the validation (steps with one only)."),
    ("seconds_update", "s", "Wall time of the update stage: rewards, the gradient share, the reference and policy "
                            "forwards, the optimizer steps, the signals' loss terms."),
    ("seconds_signals", "s", "Wall time of the signals' stage: failure collection (and PRS's judge), ETS's and "
                             "PRS's SFT phases."),
    # validation (rl.validate)
    ("val/success", "fraction 0-1", "Greedy success on the first `grpo.eval_n` tasks of `eval.split` under the "
                                    "eval limits, every `grpo.eval_every` steps (step 0 included), before the "
                                    "update: the skill, which the format can hide."),
    ("val/healthy_rate", "fraction 0-1", "Healthy-turn rate of that validation."),
    # alarms
    ("alarms_total", "count", "Alarms raised so far in the run (a resumed run counts its earlier steps' alarms)."),
    # the probe (monitor.run_probe), every monitor.probe_every steps, before the update
    ("probe/<tag>/p@<slot>", "probability", "Mean probability (at the sampling temperature) of control token "
                                            "`<tag>` at the probe set's trained positions of grammar slot "
                                            f"`<slot>`, every `monitor.probe_every` steps. `<tag>`: the short "
                                            f"names of `monitor.control_tokens` (default {TAGS}; also "
                                            "`tool_response_end`, `endoftext`, or the token's text); "
                                            f"`<slot>`: {SLOTS} (a slot with no positions is absent; "
                                            "`call_turn_end` only with `rollout.call_end: sampled`)."),
    ("probe/<tag>/miss_required", "probability", "1 - the mean probability of the token where the grammar "
                                                 "requires it: `tool_call` at `call_open`, `tool_call_end` at "
                                                 "`call_close`, `im_end` at `answer_end` (those tags only)."),
    ("probe/im_end/miss_after_call", "probability", "1 - the mean probability of `<|im_end|>` right after "
                                                    "`</tool_call>` (`call_turn_end`; `rollout.call_end: sampled` "
                                                    "only)."),
    ("probe/<tag>/p_forbidden_mean", "probability", "Mean probability of the token over the probe positions "
                                                    "whose slot forbids it (the parser would reject the turn)."),
    ("probe/<tag>/p_forbidden_max", "probability", "Largest probability of the token at a forbidden position: "
                                                   "the default alarm series (log-odds)."),
    ("probe/<tag>/p_forbidden_p99", "probability", "99th percentile of its probability at forbidden positions."),
    ("probe/content/<label>/logp", "nats (log-prob)", "Mean log-prob of the ground-truth token at the probe "
                                                      "positions whose token carries that content, at the "
                                                      f"sampling temperature; `<label>`: {CONTENTS}. The content "
                                                      "alarms watch it falling."),
    ("probe/content/<label>/acc", "fraction 0-1", "Share of those positions where the ground-truth token is the "
                                                  "greedy choice."),
    # the update's own forward (monitor.sampled_control_stats), last pass, expert rows left out
    ("ctrl/<tag>/p_sampled_mean", "probability", "Mean sampling probability of control token `<tag>` where the "
                                                 "rollouts sampled it (expert rows left out); tags as for the "
                                                 "probe, only those sampled at the step."),
    ("ctrl/<tag>/p_sampled_max", "probability", "Largest sampling probability of `<tag>` where it was sampled."),
    ("ctrl/<tag>/n_sampled", "count", "Times the step's rollouts sampled `<tag>`."),
    ("ctrl/ratio_mean_<group>", "ratio", "Mean importance ratio in the update's last pass over the sampled "
                                         "control tokens (`<group>` `ctrl`) or every other sampled token "
                                         "(`other`)."),
    ("ctrl/ratio_max_<group>", "ratio", "Largest importance ratio there (`ctrl` or `other`)."),
    ("ctrl/entropy_mean_<group>", "nats", "Mean policy entropy at the positions where a control token "
                                          "(`ctrl`) or another token (`other`) was sampled."),
    # the gradient share (monitor.control_gradient_share), every monitor.grad_share_every steps
    ("ctrl/grad_sq_share", "fraction 0-1", "Control tokens' share of the squared policy-gradient norm, "
                                           "|g_ctrl|^2 / (|g_ctrl|^2 + |g_other|^2), on up to "
                                           "`monitor.grad_share_rows` rollouts with a non-zero advantage, every "
                                           "`monitor.grad_share_every` steps (absent without such rollouts)."),
    ("ctrl/grad_norm_ctrl", "L2 norm", "Norm of the gradient of the control-token positions' part of that "
                                       "token-mean loss."),
    ("ctrl/grad_norm_other", "L2 norm", "Norm of the gradient of the other positions' part."),
    ("ctrl/token_share", "fraction 0-1", "Control tokens' share of the sampled tokens in that sub-batch (to "
                                         "compare with `grad_sq_share`)."),
    # supervision signals (supervision.py)
    ("sup/sft_nll", "nats", "Synchronous SFT term (`supervision.sft_coef` > 0): mean NLL per token of the "
                            "ground truth of each mini-batch's tasks, at temperature 1, over all the step's "
                            "optimizer steps (in TRL: over the logging window)."),
    ("sup/sft_tokens", "tokens", "Tokens the SFT term trained on at the step, summed over its optimizer steps."),
    ("sup/sft_tokens_total", "tokens", "Running total of SFT tokens: the SFT term, the ETS / PRS / adaptive "
                                       "phases and OPS's expert rows; from the first step that adds any."),
    ("sup/unlikelihood", "nats", "Unlikelihood term (`supervision.unlikelihood_coef` > 0): mean -log(1 - p) "
                                 "over the batch's first rejected control token of each failed turn, last pass; "
                                 "absent without one."),
    ("sup/unlikely_tokens", "count", "Tokens the unlikelihood term pushed down (last pass)."),
    ("sup/expert_success", "fraction 0-1", "OPS (`supervision.ops`): share of the expert rows (the ground truth "
                                           "replayed) that solved the task."),
    ("sup/hinted_success", "fraction 0-1", "HBG (`supervision.hbg`): share of the hinted rows that solved the "
                                           "task."),
    ("sup/expert_tokens", "tokens", "OPS: the expert rows' trained tokens times `grpo.updates_per_batch`, "
                                    "counted as SFT tokens (absent when `skipped_uninformative`)."),
    # ETS / PRS phases (interleave.py)
    *[(f"ets/{name}", unit, meaning) for name, unit, meaning in PHASE_STATS],
    # chat models writing PRS's reflections (judge/) and HBG's hints (hint/): counts since the process started
    *[(f"{who}/{name}", unit, f"{what} {meaning}") for who, what in (
        ("judge", "PRS's chat-model judge (`supervision.prs.judge.kind` hf or openai):"),
        ("hint", "HBG's chat-model hint writer (`supervision.hbg.hint_writer.kind` hf or openai):"))
      for name, unit, meaning in (
        ("accepted", "count", "replies used as they came (a reflection with the four parts and the reference's "
                              "calls; a hint without the answer)."),
        ("rejected", "count", "replies that were not: the deterministic reflection or the template hint instead."),
        ("failed", "count", "calls that failed after their retries (or were not made past `max_failures`): the "
                            "deterministic reflection or the template hint instead."),
        ("calls", "count", "calls that reached the model (cache misses), failed ones included."),
        ("cache_hits", "count", "replies read from the disk cache (`cache_dir`)."),
        ("failures", "count", "calls that failed after their retries."),
        ("tokens_in", "tokens", "prompt tokens of the calls (the server's `usage`, or the HF model's count)."),
        ("tokens_out", "tokens", "tokens the model wrote."),
        ("seconds", "s", "wall time of the calls."))],
    # the adaptive schedule (interleave.adaptive_handler), on the step whose alarm it handled
    ("adaptive/recovery", "count", "The recovery's number in the run (1: the first)."),
    ("adaptive/rollback_to", "step", "The checkpoint it rolled back to (`step_<k>`: the weights after k "
                                      "updates; `adaptive.rollback`)."),
    ("adaptive/lr_scale", "factor", "The LR multiplier from then on, the product of the recoveries' "
                                    "`adaptive.lr_scale` (only when not 1)."),
    *[(f"adaptive/{name}", unit, f"Its SFT phase on every task failed so far (`adaptive.sft`). {meaning}")
      for name, unit, meaning in PHASE_STATS],
]

GROUPS: dict[str, str] = {
    "": "The step, the rewards, the update, the rollouts and the timing",
    "state": "`state/`: turn states (the paper's four)",
    "error": "`error/`: the parser's error types",
    "finish": "`finish/`: how rollouts ended",
    "val": "`val/`: validation (`grpo.eval_every`)",
    "probe": "`probe/`: the probe set (`monitor.probe_every`)",
    "ctrl": "`ctrl/`: control tokens in the update's forward, and the gradient share",
    "sup": "`sup/`: supervision signals",
    "ets": "`ets/`: the ETS (and PRS) phase after the last step of each round (`supervision.ets.every`)",
    "judge": "`judge/`: PRS's chat-model judge, every step once it exists (counts since the process started)",
    "hint": "`hint/`: HBG's chat-model hint writer, every step once it exists (counts since the process started)",
    "adaptive": "`adaptive/`: a recovery of the adaptive schedule (`supervision.adaptive`), on the step whose "
                "alarm it handled",
}


def prefix(pattern: str) -> str:
    """A key pattern's group: the part before its first `/` ('' for none)."""
    return pattern.split("/", 1)[0] if "/" in pattern else ""


def pattern_regex(pattern: str) -> re.Pattern:
    """The regex of a key pattern: each `<name>` matches one or more characters other than `/`."""
    parts = re.split(r"<[^<>]+>", pattern)
    return re.compile("[^/]+".join(re.escape(p) for p in parts))


_REGEXES = [pattern_regex(p) for p, _, _ in METRICS]


def undocumented(keys: Iterable[str]) -> list[str]:
    """The keys no METRICS pattern matches, sorted, each once."""
    return sorted({k for k in keys if not any(r.fullmatch(k) for r in _REGEXES)})


# ----------------------------------------------------------------------------- docs/OUTPUTS.md


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _file_table(files: list[tuple[str, str]]) -> list[str]:
    lines = ["| path | holds |", "|---|---|"]
    return lines + [f"| `{_cell(path)}` | {_cell(what)} |" for path, what in files]


def render() -> str:
    """The Markdown of docs/OUTPUTS.md."""
    out = ["# Outputs: the files and metrics a run writes", "",
           "Generated by `python -m toolcollapse.outputs > docs/OUTPUTS.md` from `src/toolcollapse/outputs.py`, "
           "which is written from the code that writes these files; tests/test_outputs.py checks that this page "
           "is up to date and that a run with every signal on logs no metric it does not list. `<name>` stands "
           "for a variable part of a path or key.", ""]
    sections = [("RL run (`toolcollapse rl`, relative to the run directory)", RUN_FILES),
                ("SFT run (`toolcollapse sft`, relative to its output directory)", SFT_FILES),
                ("Evaluation (`toolcollapse eval`, relative to the checkpoint)", EVAL_FILES),
                ("Study or sweep (`toolcollapse study` / `sweep`, relative to its `out_dir`)", STUDY_FILES)]
    for title, files in sections:
        out += [f"## {title}", "", *_file_table(files), ""]
    out += ["## RL metrics (`metrics.jsonl`)", "",
            "One line a step. A key is absent where its signal is off or had nothing to measure at that step "
            "(the probe every `monitor.probe_every` steps, validation every `grpo.eval_every`, phases and "
            "recoveries on their steps).", ""]
    for group in dict.fromkeys(prefix(key) for key, _, _ in METRICS):
        out += [f"### {GROUPS.get(group, f'`{group}/`')}", "", "| key | unit | meaning |", "|---|---|---|"]
        out += [f"| `{_cell(key)}` | {unit} | {_cell(meaning)} |" for key, unit, meaning in METRICS
                if prefix(key) == group]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
