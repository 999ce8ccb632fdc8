"""`toolcollapse study CONFIG`: the whole study in one command -- SFT (or reuse a finished one), the
sweep of methods x learning rates x seeds, the evaluations, the report.

A study file is a sweep file (sweep.py) with one more key, `sft_config`: the SFT recipe that
trains `init` when `init` holds no finished checkpoint. Every stage skips what is done, so
killing the study and running the same command again finishes it without redoing work: a
finished SFT (its `SFT_COMPLETE` marker) is reused if `sft_config` would train the same one (an
unfinished one starts over: SFT has no checkpoints of its own), a finished run is not run
again, an interrupted one resumes from its last checkpoint, an evaluation already there under
the same limits is kept, and the report is rewritten from the run directories. Results are never
mixed across starting checkpoints: the study records a fingerprint of `init`'s weights in
`<out_dir>/start/init.sha256` and refuses to continue from another. One progress bar covers the
study: its stage, runs done of all, and an ETA.

    toolcollapse study configs/study/quick.yaml
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from toolcollapse.checkpoint import complete_checkpoints
from toolcollapse.config import ConfigError, RunConfig, dump_config, first_difference, load_config
from toolcollapse.report import write_provenance, write_report
from toolcollapse.runtime import check_new_run_dir, check_writable, lock_dir
from toolcollapse.sft import CONFIG_FILE, FINISHED, run_sft
from toolcollapse.sweep import SweepConfig, check_start, load_sweep, run_sweep, start_eval_dir
from toolcollapse.tries import SELECTION_FILE, base_name, choose, expand, pending, read_selection

FINGERPRINT = "init.sha256"  # <out_dir>/start/init.sha256: the weights every run of the study started from
STUDY_FILE = "study.yaml"  # <out_dir>/study.yaml: the study as it ran (its file with the overrides applied)


@dataclass(frozen=True)
class StudyConfig(SweepConfig):
    sft_config: str | None = None  # the SFT recipe that trains `init` when it holds no finished checkpoint


LEGACY_SFT_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json")


def sft_finished(path: Path) -> bool:
    """`run_sft` finished there: its marker, or (an SFT from before the marker) every file it saves, the
    tokenizer's last."""
    path = Path(path)
    return (path / FINISHED).is_file() or all((path / name).is_file() for name in LEGACY_SFT_FILES)


def fingerprint(checkpoint: Path) -> str:
    """sha256 over the checkpoint's weight files, in name order."""
    digest = hashlib.sha256()
    for weights in sorted(Path(checkpoint).glob("*.safetensors")):
        with open(weights, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def check_same_start(study: StudyConfig, need_sft: bool) -> None:
    """The study's runs so far started from the `init` there now (or none ran yet)."""
    recorded = start_eval_dir(study).parent / FINGERPRINT
    if not recorded.is_file():
        return
    fix = f"give the study another out_dir, or move {study.out_dir} away"
    if need_sft:
        raise ConfigError(f"{study.out_dir} holds runs started from an earlier {study.init}, which is gone or "
                          f"unfinished: a new SFT would start the rest from other weights; {fix}")
    if recorded.read_text().strip() != fingerprint(Path(study.init)):
        raise ConfigError(f"{study.out_dir} holds runs started from other weights than {study.init}'s now; {fix}")


@dataclass
class StudyPlan:
    study: StudyConfig
    specs: list[Any]
    sft: RunConfig | None  # None: `init` is finished already
    path: Path | None = None  # the study file and its overrides: read again once tries are chosen
    overrides: tuple[str, ...] = ()


def choose_tries(study: StudyConfig) -> bool:
    """Choose every setting's try that can be chosen now (tries.choose); True if a choice was made."""
    settings = expand(study.settings, study.seeds)
    before = pending(settings, read_selection(study.out_dir))
    if not before:
        return False
    after = pending(settings, choose(settings, study.out_dir, study.select_split, lambda name, seed, split:
                                     greedy_success(Path(study.out_dir) / name / f"seed{seed}", split)))
    return len(after) < len(before)


def passed_over(study: StudyConfig, spec: Any) -> bool:
    """A try that was not chosen: its run at the first seed is all it gets (scored on select_split only)."""
    record = read_selection(study.out_dir).get(base_name(spec.setting))
    return record is not None and record["tries"][record["chosen"]]["setting"] != spec.setting


def greedy_success(run_dir: Path, split: str) -> float | None:
    """The greedy success of a run's final checkpoint on `split` (None: not evaluated there)."""
    done = complete_checkpoints(run_dir)
    summary = done[-1] / "eval" / f"{split}.summary.json" if done else None
    if summary is None or not summary.is_file():
        return None
    return json.loads(summary.read_text())["success_rate"]


def finished_run(spec: Any) -> bool:
    done = complete_checkpoints(spec.run_dir)
    return bool(done) and done[-1].name == f"step_{spec.cfg.grpo.steps:06d}"


def plan_study(path: str | Path, overrides: list[str] = ()) -> StudyPlan:
    """Validate everything before any work: the study file, every run's config, the SFT recipe
    when `init` must be trained."""
    raw = load_config(path, overrides, cls=StudyConfig, inherit=False)
    # without sft_config, init is any checkpoint there (load_sweep checks); with it, the SFT it trains
    need_sft = raw.sft_config is not None and not sft_finished(Path(raw.init))
    study, specs = load_sweep(path, overrides, cls=StudyConfig, init_ready=not need_sft)
    check_same_start(study, need_sft)
    sft = None
    if study.sft_config is not None:
        try:
            sft = load_config(study.sft_config)
        except ConfigError as err:
            raise ConfigError(f"sft_config: {err}") from None
    lock_dir(study.out_dir, "study")  # before any work: a second study on the same out_dir stops here
    check_writable(study.out_dir, 64 << 20)
    if need_sft:
        lock_dir(study.init, "sft run")
        check_new_run_dir(Path(study.init), overwrite=True, kind="sft")  # a directory holding anything else
        return StudyPlan(study, specs, sft, Path(path), tuple(overrides))
    if sft is not None:
        check_trained_by(Path(study.init), sft, study.sft_config)
    return StudyPlan(study, specs, None, Path(path), tuple(overrides))


def check_trained_by(checkpoint: Path, sft: RunConfig, source: str) -> None:
    """A finished SFT checkpoint is the one `sft` (read from `source`) would train."""
    difference = first_difference(load_config(checkpoint / CONFIG_FILE), sft, ("threads", "device", "out_dir", "name"))
    if difference:
        key, was, now = difference
        raise ConfigError(f"{checkpoint} was trained with {key}={was!r}; sft_config {source} says {now!r}. Give the "
                          f"study another init, or delete that one to have the study train it")


def run_study(plan: StudyPlan) -> Path:
    """Run the study's stages; the report's path."""
    study, specs = plan.study, plan.specs
    lock_dir(study.out_dir, "study")
    Path(study.out_dir).mkdir(parents=True, exist_ok=True)
    dump_config(study, Path(study.out_dir) / STUDY_FILE)
    write_provenance(Path(study.out_dir), " ".join(["toolcollapse study", str(plan.path or ""),
                                                     *(f"--set {o}" for o in plan.overrides)]))
    total = len(specs) + (1 if study.eval_n else 0)
    bar = tqdm(total=total, desc="study", unit="run", dynamic_ncols=True)
    t0 = time.time()
    if plan.sft is not None:
        bar.set_postfix_str(f"stage: SFT -> {study.init}")
        bar.write(f"study: {study.init} holds no finished SFT; training it ({study.sft_config})")
        run_sft(plan.sft, study.init, overwrite=True)
        check_start(study)
        bar.reset(total)  # the ETA of the runs should not count the SFT's time
    recorded = start_eval_dir(study).parent / FINGERPRINT
    if not recorded.is_file():
        recorded.parent.mkdir(parents=True, exist_ok=True)
        recorded.write_text(fingerprint(Path(study.init)) + "\n")
    bar.set_postfix_str("stage: runs and evaluations")

    def done(what: str) -> None:
        bar.update(1)
        bar.write(f"study: {what} done ({time.time() - t0:.0f}s)")

    run_sweep(study, specs, on_done=done, quiet=True)
    while choose_tries(study):  # a setting's try was chosen on select_split: its other seeds and controls now
        study, specs = load_sweep(plan.path, plan.overrides, cls=StudyConfig)
        todo = [spec for spec in specs if not passed_over(study, spec) and (
            not finished_run(spec) or greedy_success(spec.run_dir, study.eval_split) is None
            or (study.eval_samples and greedy_success(spec.run_dir, f"{study.eval_split}-sampled") is None))]
        bar.total = bar.n + len(todo) + 1
        bar.write(f"study: tries chosen on {study.select_split} ({Path(study.out_dir) / SELECTION_FILE}); "
                  f"{len(todo)} runs to go")
        run_sweep(study, todo, on_done=done, quiet=True)
    bar.set_postfix_str("stage: report")
    report = write_report(study, specs, command=f"toolcollapse report {study.out_dir}")
    bar.close()
    print(f"study: done in {time.time() - t0:.0f}s; report {report} and {report.with_suffix('.html')}")
    return report


def study_file(path: str | Path) -> Path:
    """A study or sweep file, or a study's output directory (its study.yaml)."""
    path = Path(path)
    if path.is_dir():
        if not (path / STUDY_FILE).is_file():
            raise ConfigError(f"{path} holds no {STUDY_FILE}: give the study or sweep file it ran from")
        return path / STUDY_FILE
    return path


def report(path: str | Path, overrides: list[str] = (), out_dir: str | Path | None = None) -> Path:
    """`toolcollapse report`: the report of the runs a study or sweep file (or a study directory) names."""
    study, specs = load_sweep(study_file(path), overrides, cls=StudyConfig, init_ready=False)
    return write_report(study, specs, Path(out_dir) if out_dir else None)
