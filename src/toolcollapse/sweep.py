"""Sweeps: one base experiment, named settings x seeds, run in a local process pool.

A sweep file names the base config, the settings (each a set of `--set` style
overrides) and the seeds; every (setting, seed) becomes the run directory
`<out_dir>/<setting>/seed<seed>` -- deterministic, so re-running the command skips
finished runs and resumes interrupted ones from their last checkpoint. After
training, each run's final checkpoint is evaluated greedily on `eval_split`
(`eval_n` tasks), and so is the starting checkpoint, once, for comparison -- all of
them under one set of rollout limits, the base config's with the sweep's `overrides`
(`eval_config`), whatever a setting or the starting checkpoint's own config says: a
comparison whose sides ran with different turn or token budgets measures the budgets.
Each evaluation records its limits, and the table pairs only evaluations whose limits agree.

    toolcollapse sweep configs/study/collapse.yaml
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import signal
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from transformers.utils import logging as hf_logging

from toolcollapse.checkpoint import complete_checkpoints
from toolcollapse.config import (
    Checked,
    ConfigError,
    Count,
    NonNegInt,
    Positive,
    RunConfig,
    Split,
    checkpoint_problems,
    first_difference,
    load_config,
    rl_problems,
)
from toolcollapse.envs import make_env
from toolcollapse.evaluate import rollout_limits, run_eval
from toolcollapse.rl import matched_tokens, run_rl
from toolcollapse.rundir import RUN_CONFIG
from toolcollapse.runtime import STOP_FILE_ENV, StopOnSignal, hide_progress, lock_dir
from toolcollapse.tries import (
    MATCH_KEY,
    base_name,
    check_selection,
    chosen,
    expand,
    match_target,
    read_selection,
    run_seeds,
)

START_DIR = "start"  # <out_dir>/start/eval/: the sweep's evaluation of its starting checkpoint
STOP_FILE = ".stop"  # <out_dir>/.stop: written on SIGTERM / SIGINT, read by every run of the sweep
NOT_STARTED = "not started: "


@dataclass(frozen=True)
class SweepConfig(Checked):
    base: str  # experiment YAML every run starts from
    init: str  # starting checkpoint of every run (an SFT directory)
    out_dir: str
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {dotted key: value}
    overrides: dict[str, Any] = field(default_factory=dict)  # {dotted key: value} for every run
    seeds: tuple[NonNegInt, ...] = (0, 1, 2)
    workers: Count = 2  # runs at once
    threads_per_worker: Count = 1
    eval_split: Split = "test"
    eval_extra_splits: tuple[Split, ...] = ()  # also evaluated, same tasks count and limits (ood_content, ood_format)
    eval_n: NonNegInt = 0  # tasks evaluated after training (0: no evaluation); a split with fewer: all of them
    # sampled episodes per task on eval_split at eval_temperature (pass@1: their mean success), besides greedy
    eval_samples: NonNegInt = 0
    eval_temperature: Positive = 1.0  # the sampled evaluation's, whatever temperature the runs trained at
    eval_settings: tuple[str, ...] | None = None  # settings whose final checkpoints are evaluated (None: all)
    select_split: Split = "val"  # where a setting's `tries` are compared (tries.py); evaluated for every run then
    # local: `workers` processes here. ray: one Ray task per run, threads_per_worker CPUs each, on the Ray
    # cluster at ray_address (None: a local Ray started for the sweep; "auto": the cluster this machine is in;
    # ignored when this process has connected to Ray already). Every node must have toolcollapse and see the
    # directory the sweep is started from, and every path in the sweep, at the same path (a shared filesystem)
    backend: Literal["local", "ray"] = "local"
    ray_address: str | None = None

    def extra_problems(self) -> list[str]:
        problems = [] if self.seeds else ["seeds: give at least one seed"]
        if self.backend == "ray" and importlib.util.find_spec("ray") is None:
            problems.append("backend: ray needs Ray installed: pip install 'toolcollapse[ray]'")
        return problems


@dataclass(frozen=True)
class RunSpec:
    setting: str
    seed: int
    run_dir: Path
    cfg: RunConfig


def load_sweep(path: str | Path, overrides: list[str] = (), cls: type = SweepConfig,
               init_ready: bool = True) -> tuple[Any, list[RunSpec]]:
    """Read the sweep file and build (and so validate) every run's config before any work.
    `init_ready` False: the starting checkpoint is trained later (a study's SFT stage), so it is
    not looked for; `check_start` does that once it is there."""
    sweep = load_config(path, overrides, cls=cls, inherit=False)
    if not sweep.settings:
        raise ConfigError(f"{path}: settings is empty; name at least one set of overrides")
    unknown = sorted(set(sweep.eval_settings or ()) - set(sweep.settings))
    if unknown:
        raise ConfigError(f"eval_settings: {unknown[0]!r} is not one of the settings ({', '.join(sweep.settings)})")
    if init_ready and not (Path(sweep.init) / "config.json").is_file():
        raise ConfigError(f"init checkpoint not found: {sweep.init} (no config.json there); train it first with "
                          f"`toolcollapse sft`, or run the study with `toolcollapse study`, which trains it")
    settings = expand(sweep.settings, sweep.seeds)
    selection = read_selection(sweep.out_dir)
    check_selection(settings, selection, sweep.out_dir)
    specs = []
    for setting in settings:
        match, decided, inherited = match_target(setting.sets, settings, selection, sweep.out_dir)
        sets = {**inherited, **setting.sets, **({MATCH_KEY: match} if match is not None else {})}
        for seed in run_seeds(setting, selection):
            spec = _run_spec(sweep, setting.name, seed, sets)
            if decided:  # a control of a setting whose try is not chosen yet: validated, run once it is
                specs.append(spec)
    check_tries(sweep, settings, specs)
    check_against_runs_there(specs)
    check_evaluations(sweep, specs)
    check_matches(specs)
    if init_ready:
        check_start(sweep)
    return sweep, specs


def check_tries(sweep: SweepConfig, settings: list[Any], specs: list[RunSpec]) -> None:
    """Tries can be chosen fairly: scored on a split that is neither the reported one nor test, evaluated, and
    no run trains on the tasks they are scored on."""
    tried = sorted({s.base for s in settings if s.try_index is not None})
    if not tried:
        return
    if sweep.select_split in ("test", sweep.eval_split):
        raise ConfigError(f"select_split: tries chosen on {sweep.select_split!r} would be chosen on the split the "
                          "report compares; choose them on val")
    if not sweep.eval_n or (sweep.eval_settings is not None and set(tried) - set(sweep.eval_settings)):
        raise ConfigError(f"settings {', '.join(tried)} have tries, which are chosen on their evaluation on "
                          f"{sweep.select_split}: set eval_n and evaluate them (eval_settings)")
    for spec in specs:
        if spec.cfg.grpo.split in ("train", sweep.select_split):
            raise ConfigError(f"settings.{spec.setting}: grpo.split {spec.cfg.grpo.split!r} holds the "
                              f"{sweep.select_split} tasks the tries are chosen on; train on `rl`")


def _run_spec(sweep: SweepConfig, name: str, seed: int, sets: dict[str, Any]) -> RunSpec:
    """A run of the grid, its config built (and so validated) from the base, the sweep's overrides and `sets`."""
    run_dir = Path(sweep.out_dir) / name / f"seed{seed}"
    items = [f"{k}={v}" for k, v in {**sweep.overrides, **sets}.items()] + [
        f"seed={seed}", f"init={sweep.init}", f"threads={sweep.threads_per_worker}",
        f"name={name}-seed{seed}", f"out_dir={run_dir}"]
    try:
        cfg = load_config(sweep.base, items)
    except ConfigError as err:
        raise ConfigError(f"settings.{name}: {err}") from None
    if rl_problems(cfg):
        raise ConfigError(f"settings.{name}: {rl_problems(cfg)[0]}")
    return RunSpec(name, seed, run_dir, cfg)


def check_against_runs_there(specs: list[RunSpec]) -> None:
    """A run the sweep would resume must have been started with the config it would get now."""
    for spec in specs:
        saved = spec.run_dir / RUN_CONFIG
        if saved.is_file():
            difference = first_difference(load_config(saved), spec.cfg)
            if difference:
                key, was, now = difference
                raise ConfigError(f"{spec.run_dir} was started with {key}={was!r}; the sweep now says {now!r}. "
                                  f"Give the sweep another out_dir, or move that run away")


def check_matches(specs: list[RunSpec]) -> None:
    """An `sft_only` control's `match` is a run of this grid (it waits for it) or a finished one elsewhere."""
    after = run_after(specs)
    for spec in specs:
        match = spec.cfg.supervision.sft_only.match
        if match is not None and spec.run_dir not in after:
            try:
                matched_tokens(match.replace("{seed}", str(spec.seed)), spec.cfg)
            except ConfigError as err:
                raise ConfigError(f"settings.{spec.setting}: {err}") from None


def check_evaluations(sweep: SweepConfig, specs: list[RunSpec]) -> None:
    """Every evaluation runs under `eval_config`: an evaluated setting may not change what it measures,
    and the starting checkpoint must suit it."""
    cfg = eval_config(sweep)
    for spec in specs:
        if evaluated(sweep, spec):
            for key in ("env", "rollout.call_end"):
                here, there = (_get(c, key) for c in (spec.cfg, cfg))
                if here != there:
                    raise ConfigError(f"settings.{spec.setting}: {key}={here!r} differs from the evaluations' "
                                      f"{there!r} (the base config with the sweep's overrides); set it in overrides")


def evaluated(sweep: SweepConfig, spec: RunSpec) -> bool:
    """The run's final checkpoint is evaluated: eval_n > 0 and its setting (a try: the setting it tries) is in
    eval_settings (None: all)."""
    return bool(sweep.eval_n) and (sweep.eval_settings is None or base_name(spec.setting) in sweep.eval_settings)


def check_start(sweep: SweepConfig) -> None:
    """The starting checkpoint suits the evaluations' config."""
    cfg = eval_config(sweep)
    if sweep.eval_n and checkpoint_problems(cfg, sweep.init):
        raise ConfigError(f"eval of init: {checkpoint_problems(cfg, sweep.init)[0]}")


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def eval_splits(sweep: SweepConfig) -> list[str]:
    """The splits every evaluated checkpoint is scored on greedily: eval_split first, then the extra ones, and
    select_split where a setting has tries."""
    has_tries = any(isinstance(s, dict) and "tries" in s for s in sweep.settings.values())
    return list(dict.fromkeys((sweep.eval_split, *sweep.eval_extra_splits, *([sweep.select_split] if has_tries else []))))


def eval_config(sweep: SweepConfig, split: str | None = None, samples: int = 0) -> RunConfig:
    """The config every evaluation of the sweep runs with: the base config with the sweep's
    `overrides` (not a setting's), on `eval_n` tasks of `split` (default `eval_split`), greedy, or
    `samples` episodes per task at the rollout temperature."""
    items = [f"{k}={v}" for k, v in sweep.overrides.items()] + [
        f"threads={sweep.threads_per_worker}", f"eval.split={split or sweep.eval_split}",
        f"eval.greedy={'false' if samples else 'true'}", f"eval.samples={max(1, samples)}",
        f"eval.n_tasks={sweep.eval_n or 'null'}"] + ([f"rollout.temperature={sweep.eval_temperature}"] if samples else [])
    try:
        return load_config(sweep.base, items)
    except ConfigError as err:
        raise ConfigError(f"overrides: {err}") from None


def run_after(specs: list[RunSpec]) -> dict[Path, Path]:
    """{run dir: the run dir of this grid it must wait for}: an `sft_only` control whose `match` is a run of
    the same grid starts once that run has finished (it spends as many SFT tokens as that run did)."""
    dirs = {Path(s.run_dir).resolve(): s.run_dir for s in specs}  # a match may be written relative or absolute
    after = {}
    for spec in specs:
        match = spec.cfg.supervision.sft_only.match
        if match is None:
            continue
        target = dirs.get(Path(match.replace("{seed}", str(spec.seed))).resolve())
        if target == spec.run_dir:
            raise ConfigError(f"settings.{spec.setting}: supervision.sft_only.match names the run itself")
        if target is not None:
            after[spec.run_dir] = target
    for first, then in after.items():
        if then in after:
            raise ConfigError(f"{first} would wait for {then}, which waits for {after[then]}: an sft_only control "
                              "matches a run that trains, not another control")
    return after


def run_sweep(sweep: SweepConfig, specs: list[RunSpec], on_done: Callable[[str], None] | None = None,
              quiet: bool = False) -> list[Path]:
    """Every run (and the starting checkpoint's evaluation) in `sweep.workers` processes, each run once the
    run it waits for (`run_after`) is done; `on_done(what)` as each finishes (default: a line on stdout).
    `quiet`: no progress bars from the workers."""
    lock_dir(sweep.out_dir, "sweep or study")  # (a study holds it already)
    jobs = [(spec, sweep, quiet, os.getcwd()) for spec in specs]
    if sweep.eval_n:
        jobs.append((None, sweep, quiet, os.getcwd()))
    t0 = time.time()
    report = on_done or (lambda done: print(f"sweep: {done} done ({time.time() - t0:.0f}s)", flush=True))
    if sweep.backend == "ray":
        _run_on_ray(jobs, sweep, report, quiet)
        return [s.run_dir for s in specs]
    after = run_after(specs)
    waiting = [job for job in jobs if job[0] is not None and job[0].run_dir in after]
    # SIGTERM / SIGINT: the stop file asks every run to stop after its step with a checkpoint (run_rl reads it,
    # through the environment its worker inherits), and the jobs not started yet not to start
    stop_file = Path(sweep.out_dir) / STOP_FILE
    stop_file.unlink(missing_ok=True)
    os.environ[STOP_FILE_ENV] = str(stop_file.resolve())
    interrupt = StopOnSignal("sweep")
    stopped = None
    # fresh interpreters (spawn, one run each): torch threads and RNG state do not leak across runs; a worker
    # killed outright (the OOM killer) breaks the pool, which raises here instead of waiting for it forever
    # workers ignore Ctrl-C's SIGINT (sent to the whole process group): the stop file carries the request, and
    # an idle worker killed by it would break the pool, which then SIGTERMs every run in flight (their second
    # signal: no checkpoint); a run's own handler replaces SIG_IGN once its loop starts
    with ProcessPoolExecutor(sweep.workers, mp_context=mp.get_context("spawn"), max_tasks_per_child=1,
                             initializer=_ignore_sigint) as pool:
        pending = {pool.submit(_run_one, job) for job in jobs if job not in waiting}
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED, timeout=1.0)
                if interrupt.requested and not stop_file.exists():
                    stop_file.parent.mkdir(parents=True, exist_ok=True)
                    stop_file.write_text(f"{os.getpid()}\n")
                for future in done:
                    try:
                        finished = future.result()  # a run's error (or BrokenProcessPool) stops the sweep
                    except SystemExit as err:  # a run stopped by the signal, with its checkpoint
                        stopped = err.code
                        continue
                    if finished.startswith(NOT_STARTED):
                        continue
                    report(finished)
                    for job in [j for j in waiting if str(after[j[0].run_dir]) == finished]:
                        waiting.remove(job)
                        pending.add(pool.submit(_run_one, job))
        except BaseException:  # the runs in flight stop too (re-running the sweep resumes them)
            pool.shutdown(wait=False, cancel_futures=True)
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.terminate()
            raise
        finally:
            interrupt.restore()
            os.environ.pop(STOP_FILE_ENV, None)
            stop_file.unlink(missing_ok=True)
    if interrupt.requested or stopped is not None:
        interrupt.signum = interrupt.signum or (int(stopped) - 128 if isinstance(stopped, int) else 15)
        interrupt.exit("sweep: stopped; every run in flight saved a checkpoint. Run the same command to continue.")
    return [s.run_dir for s in specs]


def _run_on_ray(jobs: list[tuple], sweep: SweepConfig, report: Callable[[str], None], quiet: bool) -> None:
    """One Ray task per job, each in a fresh worker process (max_calls=1, as the local pool's
    maxtasksperchild), `threads_per_worker` CPUs each: the cluster decides how many run at once; a run
    that waits for another (`run_after`) is submitted once that one is done."""
    import ray

    if not ray.is_initialized():
        ray.init(address=sweep.ray_address, include_dashboard=False, log_to_driver=not quiet)
    # no retries: a run that fails says so (re-running the sweep resumes it from its last checkpoint)
    # a run on a GPU asks Ray for one (Ray hides the GPUs from tasks that did not): device cuda, or auto on a
    # cluster that has GPUs
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    task = ray.remote(num_cpus=sweep.threads_per_worker, max_calls=1, max_retries=0)(_run_one)
    on_gpu = task.options(num_gpus=1)

    def submit(job: tuple) -> Any:
        device = job[0].cfg.device if job[0] is not None else eval_config(sweep).device
        return (on_gpu if device == "cuda" or (device == "auto" and gpus) else task).remote(job)

    after = run_after([job[0] for job in jobs if job[0] is not None])
    waiting = [job for job in jobs if job[0] is not None and job[0].run_dir in after]
    pending = [submit(job) for job in jobs if job not in waiting]
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            done = ray.get(ready[0])
            report(done)
            for job in [j for j in waiting if str(after[j[0].run_dir]) == done]:
                waiting.remove(job)
                pending.append(submit(job))
    finally:
        for ref in pending:  # after a failure, the runs not finished yet stop too
            ray.cancel(ref, force=True)


def _run_one(job: tuple[RunSpec | None, SweepConfig, bool, str]) -> str:
    hf_logging.disable_progress_bar()
    spec, sweep, quiet, cwd = job
    if not os.path.isdir(cwd):
        raise RuntimeError(f"{cwd}, where the sweep was started, is not on this node: its paths are relative to it")
    os.chdir(cwd)  # a sweep's paths are relative to where it was started (a Ray worker starts elsewhere)
    if quiet:
        hide_progress()
    if os.path.exists(os.environ.get(STOP_FILE_ENV, "\0")):  # the sweep was asked to stop before this job began
        return NOT_STARTED + str(spec.run_dir if spec else sweep.init)
    if spec is None:  # the starting checkpoint, evaluated once for comparison
        evaluate_checkpoint(Path(sweep.init), sweep, start_eval_dir(sweep))
        return f"eval of {sweep.init}"
    done = complete_checkpoints(spec.run_dir)
    finished = bool(done) and done[-1].name == f"step_{spec.cfg.grpo.steps:06d}"
    if not finished:  # a run killed before its first checkpoint starts over in its own directory
        run_rl(spec.cfg, spec.run_dir, resume=bool(done), overwrite=not done)
    if evaluated(sweep, spec):
        final = complete_checkpoints(spec.run_dir)[-1]
        evaluate_checkpoint(final, sweep, final / "eval", [sweep.select_split] if undecided_try(sweep, spec) else None)
    return str(spec.run_dir)


def undecided_try(sweep: SweepConfig, spec: RunSpec) -> bool:
    """The run is a try not chosen (yet): scored on select_split only (the chosen one gets the rest of its
    evaluations once it is chosen; the others never need them)."""
    setting = next((s for s in expand(sweep.settings, sweep.seeds) if s.name == spec.setting), None)
    return (setting is not None and setting.try_index is not None
            and chosen(read_selection(sweep.out_dir), setting.base) != setting.try_index)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_eval_dir(sweep: SweepConfig) -> Path:
    return Path(sweep.out_dir) / START_DIR / "eval"


def evaluations(sweep: SweepConfig, splits: list[str] | None = None) -> list[tuple[str, RunConfig]]:
    """(file stem, config) of every evaluation of a checkpoint: greedy on each eval split (or `splits`), and
    `eval_samples` sampled episodes a task on eval_split (`<split>-sampled`)."""
    out = [(split, eval_config(sweep, split)) for split in (splits or eval_splits(sweep))]
    if sweep.eval_samples and splits is None:
        out.append((f"{sweep.eval_split}-sampled", eval_config(sweep, sweep.eval_split, sweep.eval_samples)))
    return out


def evaluate_checkpoint(checkpoint: Path, sweep: SweepConfig, eval_dir: Path, splits: list[str] | None = None) -> None:
    """Every evaluation (`evaluations`) under the sweep's one set of limits (`eval_config`), except where
    `eval_dir` already holds one of the same tasks under the same limits."""
    env = None
    for stem, cfg in evaluations(sweep, splits):
        summary_path = eval_dir / f"{stem}.summary.json"
        k = 1 if cfg.eval.greedy else cfg.eval.samples
        if summary_path.is_file():
            env = env or make_env(cfg)
            done = json.loads(summary_path.read_text())
            if (done["n_episodes"] == k * len(env.tasks(cfg.eval.split, cfg.eval.n_tasks))
                    and done.get("limits") == rollout_limits(cfg, cfg.eval.greedy, k)):
                continue
        run_eval(checkpoint, cfg, eval_dir / f"{stem}.jsonl")
