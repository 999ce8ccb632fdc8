"""Multi-turn GRPO (arXiv 2402.03300) on tool use, with the paper's settings as defaults.

One step:
  1. take the next `prompts_per_step` tasks and sample G rollouts of each with the
     KV-cached, token-in/token-out engine (rollout.py);
  2. reward 1 if the task is solved, else 0 (rewards.py); group-normalised
     advantages, with or without the std division (advantages.py);
  3. (update.py) forward the policy over the rollouts' exact tokens -- the shared system prompt
     once -- and minimise the clipped surrogate with dual clip on the sampled tokens
     only (tool output and template tokens are masked), plus beta * k3 KL to the
     frozen initial model (losses.py), token-mean over the batch;
  4. clip the gradient norm; a non-finite loss or norm skips the step, never the weights.
Every `monitor.probe_every` steps, after the rollouts and before the update (on the weights the
rollouts sampled from, reading the system prompt's keys and values the rollouts ran), a fixed probe set
of oracle conversations is teacher-forced through the policy and its control-token and content
statistics are logged (monitor/); every `grpo.eval_every` steps the policy runs greedily
on fixed `eval.split` tasks (`val/success`, `val/healthy_rate`: the skill, which the format
can hide). The alarm rules watch each step's metrics (`monitor.Monitor`, the one TRL's callback
feeds too; the rules: alarms.py): an alarm is printed,
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

`run_rl` is a loop over named, timed stages (`seconds_<stage>` in each row): rollout (the policy's rows and
the signals'), monitor (probe, validation), update (reward, advantages, the GRPO update with the signals' loss
terms), signals (each signal's `after_update`: ETS's and PRS's phases), alarms (the rules and their handler:
the config's action or the adaptive schedule), log, checkpoint. The signals are the modules of signals/,
built from the config (`signals.build_signals`); the loop never names one.

The run directory (rundir.py) holds `config.yaml`, `metrics.jsonl` (one line per step),
`samples.jsonl` (decoded rollouts), TensorBoard events in `tb/`, and checkpoints that
`--resume` continues from exactly (same seed: the same metrics as an uninterrupted run).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from toolcollapse.alarms import Alarm
from toolcollapse.chat import PieceEncoder, generation_prompt
from toolcollapse.checkpoint import MARKER, complete_checkpoints, load_trainer_state, save_checkpoint
from toolcollapse.config import ConfigError, RunConfig, dump_config
from toolcollapse.encoding import encode_tasks
from toolcollapse.envs import make_env
from toolcollapse.evaluate import sampling_params
from toolcollapse.interleave import PHASES, PhaseRunner, latest_per_task, read_failures, sft_phase, trained_tokens
from toolcollapse.judge import Judge
from toolcollapse.model import PrefixCache, load_model, load_tokenizer, place, resolve_device
from toolcollapse.monitor import Monitor
from toolcollapse.optim import lr_at, make_optimizer, set_lr
from toolcollapse.records import Task
from toolcollapse.rewards import rewards_tensor
from toolcollapse.rollout import RolloutEngine
from toolcollapse.rundir import (RUN_CONFIG, StorageError, check_run_start, log_step, open_tensorboard, resume_config,
                                 truncate_logs)
from toolcollapse.runtime import (STOP_FILE_ENV, StopOnSignal, append_jsonl, clear_run_dir, progress, read_jsonl,
                                  seed_everything, set_threads, storage_problem)
from toolcollapse.signals import Signal, Step, build_signals, group_rollouts, group_rows
from toolcollapse.sources import apply_lora
from toolcollapse.supervision import sft_tokens_so_far
from toolcollapse.tags import add_control_tokens, ready_for_chatml, token_ids
from toolcollapse.turn_stats import rollout_stats, row_kind_stats, sample_records
from toolcollapse.update import policy_step


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
    recovered: bool = False  # set by a handler that recovered the run: the alarm rules start afresh
    sft_phase: Callable[[str], dict[str, float]] | None = None  # SFT on every task failed so far; its stats
    recoveries: int = 0  # adaptive recoveries before this one
    events: dict[str, Any] = field(default_factory=dict)  # what the handler did: into the step's metrics row
    saved: bool = False  # set by save_checkpoint

    def save_checkpoint(self) -> Path:
        """Ask for a resumable checkpoint after this step, written once the step's metrics row is; its path."""
        self.saved = True
        return self.run_dir / "checkpoints" / f"step_{self.step + 1:06d}"


AlarmHandler = Callable[[list[Alarm], AlarmContext], None]


def config_handler(monitor: Monitor) -> AlarmHandler:
    """monitor.on_alarm: `log` (alarms are always printed and written to alarms.jsonl), `checkpoint`, `stop`
    (`Monitor.actions`, what TRL's callback does too)."""
    checkpoint, stop = monitor.actions()

    def handle(alarms: list[Alarm], ctx: AlarmContext) -> None:
        if checkpoint:
            path = ctx.save_checkpoint()
            tqdm.write(f"rl: checkpoint on alarm: {path} (after this step)")
        ctx.stop = stop

    return handle


def _raise(alarms: list[Alarm], ctx: AlarmContext, handle: AlarmHandler) -> bool:
    """Print and record the alarms, run the handler; True if it asks the run to stop."""
    for a in alarms:
        tqdm.write(f"rl: {a.describe()}")
        append_jsonl(ctx.run_dir / "alarms.jsonl", Monitor.record(a))
    handle(alarms, ctx)
    if ctx.events:
        append_jsonl(ctx.run_dir / "alarms.jsonl", {"step": ctx.step, "event": "recovery", **ctx.events})
    if ctx.stop:
        tqdm.write(f"rl: stopped on alarm after step {ctx.step}; continue with --resume {ctx.run_dir}")
    return ctx.stop


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


@dataclass
class Run:
    """An RL run's live objects, which the stages of a step read and the signals' `start` hooks see."""

    cfg: RunConfig
    run_dir: Path
    model: Any
    ref_model: Any
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    engine: RolloutEngine
    phases: PhaseRunner
    signals: list[Signal]
    order: list[Task]  # the training tasks in the run's order
    monitor: Monitor  # the probe and the alarm rules
    val_tasks: list[Task]
    on_alarm: AlarmHandler
    writer: Any
    start: int  # the first step this process runs
    fresh: bool  # no checkpoint to continue from
    rows: list[dict[str, Any]] = field(default_factory=list)  # the metrics of the steps taken (resumed: what
    #                                                           a signal's `start` restores its state from)
    lr_scale: float = 1.0  # the LR's cut by alarm handlers so far (the adaptive schedule's)
    recoveries: int = 0
    sft_tokens_total: float = 0.0
    last_val: str = "-"  # the last validation's success (and its cost), for the progress line

    def save(self, step: int) -> None:
        g = self.cfg.grpo
        save_checkpoint(self.run_dir, step, self.model, self.tokenizer, self.optimizer,
                        lambda p: dump_config(self.cfg, p / "toolcollapse.yaml"), g.keep_checkpoints)


def run_rl(cfg: RunConfig, run_dir: Path, resume: bool = False, on_alarm: AlarmHandler | None = None,
           overwrite: bool = False, judge: Judge | None = None, allow_change: Sequence[str] = ()) -> Path:
    """Train from `cfg.init` (or continue the run in `run_dir`). `on_alarm` replaces the
    monitor.on_alarm action (and the adaptive schedule); `judge`, PRS's `prs.judge`. A new run
    refuses a directory that holds another run unless `overwrite`; a resumed one, a config other
    than the one it started with."""
    run_dir = Path(run_dir)
    check_run_start(cfg, run_dir, resume, overwrite, allow_change)
    if cfg.supervision.sft_only_enabled:
        return run_sft_only(cfg, run_dir, resume)
    # a chat-model judge or hint writer answers once before any work (ConfigError: a wrong address, model, key)
    signals = build_signals(cfg, **({"judge": judge} if judge is not None else {}))
    run = start_run(cfg, run_dir, resume, signals, on_alarm)
    g = cfg.grpo
    bar = progress(g.steps, "rl", initial=run.start)
    interrupt = StopOnSignal("rl", os.environ.get(STOP_FILE_ENV))  # SIGTERM / SIGINT: stop after the step
    halted = False
    try:
        for index in range(run.start, g.steps):
            step = Step(index, tasks_for_step(run.order, index, g.prompts_per_step))
            t0 = time.time()
            rollout_stage(run, step)
            monitor_stage(run, step)
            update_stage(run, step)
            signals_stage(run, step)
            ctx = alarm_stage(run, step)
            log_stage(run, step, bar, seconds=time.time() - t0)
            # after the step's row: a resumed run starts past it, without redoing its phase or recovery
            halted = interrupt.requested and index + 1 < g.steps  # read once: the save and the break agree
            if (ctx.stop or ctx.saved or (index + 1) % g.checkpoint_every == 0 or index + 1 == g.steps
                    or ctx.events or "ets/steps" in step.metrics or halted):
                run.save(index + 1)
            if ctx.stop or halted:
                break
    except Exception as err:  # a full disk or a directory made read-only surfaces as whatever the writer raises
        cause = storage_problem(run_dir, err)
        if cause is None:
            raise
        raise StorageError(run_dir, cause) from None
    finally:
        interrupt.restore()
    bar.close()
    run.writer.close()
    if halted:  # asked to stop before the last step (a request after it: the run is simply done)
        interrupt.exit(f"rl: stopped after step {index} with a checkpoint; continue with: toolcollapse rl --resume {run_dir}")
    return run_dir


def start_run(cfg: RunConfig, run_dir: Path, resume: bool, signals: list[Signal],
              on_alarm: AlarmHandler | None) -> Run:
    """The model (from the newest checkpoint of a resumed run), its optimizer, the run directory, the
    environment, probe, engine and phases; the signals started."""
    g = cfg.grpo
    set_threads(cfg.threads)
    seed_everything(cfg.seed)
    done = complete_checkpoints(run_dir) if resume else []
    model, tokenizer, ref_model = _policy_and_reference(cfg, done[-1] if done else Path(cfg.init), fresh=not done)
    optimizer = make_optimizer(model, g.lr, g.weight_decay, g.betas)
    start = load_trainer_state(done[-1], optimizer) if done else 0
    if not resume:
        clear_run_dir(run_dir, "rl")  # a previous run there, which `overwrite` allowed to replace
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / RUN_CONFIG)
    truncate_logs(run_dir, start)
    writer = open_tensorboard(run_dir, start)
    rows = read_jsonl(run_dir / "metrics.jsonl") if start else []
    env = make_env(cfg)
    order = task_order(env.tasks(g.split, g.pool_size), cfg.seed)
    monitor = Monitor.for_run(cfg, env, tokenizer)
    monitor.replay(rows)  # a resumed run does not re-alarm on the steps it took
    handler = on_alarm or next((h for h in (sig.on_alarm() for sig in signals) if h is not None),
                               config_handler(monitor))
    engine = RolloutEngine.from_config(model, tokenizer, env, cfg.rollout)
    engine.prefixes = PrefixCache(model)
    phases = PhaseRunner(run_dir, model, engine.encoder, {t.id: t for t in order}, cfg, read_failures(run_dir),
                         optimizer, decode=engine.decode,
                         generation_prompt_len=len(engine.encoder.encode(generation_prompt())[0]))
    run = Run(cfg, run_dir, model, ref_model, tokenizer, optimizer, engine, phases, signals, order, monitor,
              env.tasks(cfg.eval.split, g.eval_n) if g.eval_every else [], handler, writer, start, fresh=not done,
              rows=rows, sft_tokens_total=sft_tokens_so_far(rows))
    for signal in signals:
        signal.start(run)
    model.train()
    return run


def rollout_stage(run: Run, step: Step) -> None:
    """G rows a task: the policy's samples and the signals' rows."""
    t0 = time.time()
    run.engine.prefixes.clear()  # the weights moved: the rollout runs the system prompt, the probe and validation reuse it
    step.episodes, step.kinds = group_rollouts(run.engine, step.tasks, sampling_params(run.cfg, greedy=False),
                                               run.cfg.grpo.group_size, group_rows(run.signals),
                                               seed=run.cfg.seed * 1_000_003 + step.index)
    step.metrics["seconds_rollout"] = time.time() - t0


def monitor_stage(run: Run, step: Step) -> None:
    """The probe and validation, on the weights the rollouts sampled from, before the update (step 0: the start)."""
    cfg, g, t0 = run.cfg, run.cfg.grpo, time.time()
    if run.monitor.probe_due(step.index):
        step.metrics.update(run.monitor.run_probe(run.model, run.engine.prefixes))
    step.metrics["seconds_probe"] = time.time() - t0
    if run.val_tasks and step.index % g.eval_every == 0:
        t1 = time.time()
        step.metrics.update(validate(run.engine, run.val_tasks, cfg))
        step.metrics["seconds_val"] = time.time() - t1
        run.last_val = f"{step.metrics['val/success']:.2f} ({step.metrics['seconds_val']:.0f}s)"


def update_stage(run: Run, step: Step) -> None:
    """The reward, then the GRPO update with the signals' loss terms."""
    cfg, g, m, t0 = run.cfg, run.cfg.grpo, run.cfg.monitor, time.time()
    lr = lr_at(step.index, g.lr, g.warmup_steps, g.steps, g.min_lr_ratio, g.schedule) * run.lr_scale
    set_lr(run.optimizer, lr)
    step.rewards = rewards_tensor(step.episodes, g.format_reward, g.partial_credit, {t.id: t for t in step.tasks})
    share_rows = m.grad_share_rows if m.grad_share_every and step.index % m.grad_share_every == 0 else 0
    terms = [term for sig in run.signals for term in sig.terms(step)]
    kinds = step.kinds if set(step.kinds) != {"policy"} else ()
    step.metrics.update({"step": step.index, "lr": lr, **policy_step(
        run.model, run.ref_model, run.optimizer, step.episodes, step.rewards, g, run.tokenizer.pad_token_id,
        run.monitor.token_ids, share_rows, cfg.rollout.temperature, kinds, terms), **row_kind_stats(step.episodes, step.kinds)})
    step.metrics["seconds_update"] = time.time() - t0


def signals_stage(run: Run, step: Step) -> None:
    """Each signal between steps (an SFT phase), then what each logs."""
    t0 = time.time()
    for signal in run.signals:
        step.metrics.update(signal.after_update(step))
    for signal in run.signals:
        step.metrics.update(signal.metrics())
    step.metrics["seconds_signals"] = time.time() - t0


def alarm_stage(run: Run, step: Step) -> AlarmContext:
    """The alarm rules on the step's metrics; the handler's actions (a checkpoint, a stop, a recovery)."""
    alarms = run.monitor.observe(step.index, step.metrics)
    ctx = AlarmContext(step.index, run.run_dir, run.model, run.optimizer, recoveries=run.recoveries)
    if alarms:
        ctx.rollback = functools.partial(_rollback, run.run_dir, step.index, run.model, run.optimizer)
        ctx.scale_lr = functools.partial(_scale_lr, run)
        ctx.sft_phase = functools.partial(run.phases.run, step=step.index,
                                          failures=latest_per_task(run.phases.failures))
        _raise(alarms, ctx, run.on_alarm)
        if ctx.recovered:  # a recovery: the rules watch the recovered run afresh
            run.recoveries += 1
            run.monitor.rearm()
        step.metrics.update(ctx.events)
    return ctx


def _scale_lr(run: Run, factor: float) -> float:
    run.lr_scale *= factor
    return run.lr_scale


SFT_TOKENS = ("sup/sft_tokens", "ets/tokens", "adaptive/tokens", "sup/expert_tokens")  # a step's trained ground truth


def log_stage(run: Run, step: Step, bar: Any, seconds: float) -> None:
    """The SFT tokens so far, the step's row (metrics.jsonl, TensorBoard, samples), the progress line."""
    metrics, g = step.metrics, run.cfg.grpo
    tokens = sum(metrics.get(k, 0.0) for k in SFT_TOKENS)
    if tokens or "sup/sft_tokens" in metrics:
        run.sft_tokens_total += tokens
        metrics["sup/sft_tokens_total"] = run.sft_tokens_total
    metrics["alarms_total"] = len(run.monitor.alarms)
    metrics["seconds"] = seconds
    log_step(run.run_dir, run.writer, metrics, sample_records(step.index, step.episodes, step.rewards,
                                                              run.engine.decode, g.samples_per_step, step.kinds))
    bar.update(1)
    bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", healthy=f"{metrics['healthy_rate']:.2f}",
                    informative=f"{metrics['frac_groups_informative']:.2f}", alarms=len(run.monitor.alarms),
                    **({"val": run.last_val} if run.val_tasks else {}), refresh=False)


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
    encoder = PieceEncoder(tokenizer, cfg.rollout.call_end)
    examples, tokens = [], 0
    for task in task_order(make_env(cfg).tasks(g.split, g.pool_size), cfg.seed):  # one epoch's tokens x epochs reach the target
        if tokens * s.phase.epochs >= target:
            break
        example = encode_tasks(encoder, [task])[0]
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
