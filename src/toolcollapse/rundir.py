"""An RL run's directory: the start checks (config, lock, room, an existing run, a changed config), the config
it resumes with, its logs -- metrics.jsonl, samples.jsonl, TensorBoard events -- cut back to the step a
resumed run starts from, and the error that names the last good checkpoint when a write fails
(docs/OUTPUTS.md lists every file). The checkpoints themselves: checkpoint.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

from toolcollapse.checkpoint import clean_partial, complete_checkpoints
from toolcollapse.config import ConfigError, RunConfig, differences, load_config, rl_start_problems
from toolcollapse.interleave import FAILURES, PHASES
from toolcollapse.model import resolve_device
from toolcollapse.runtime import append_jsonl, check_new_run_dir, check_writable, jsonl_lines, lock_dir

RUN_CONFIG = "config.yaml"



def check_run_start(cfg: RunConfig, run_dir: Path, resume: bool, overwrite: bool,
                    allow_change: Sequence[str] = ()) -> None:
    """ConfigError before anything is loaded or written: an RL-incompatible config, a directory another job
    holds (the lock is taken here and kept for the run's life), one that cannot be written, a new run aimed at
    another run's directory, a resumed run given another config than its checkpoint was saved with (except the
    keys in `allow_change`)."""
    resolve_device(cfg.device)  # ConfigError for a GPU that is not there
    problems = rl_start_problems(cfg)
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


def truncate_logs(run_dir: Path, start: int) -> None:
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


def open_tensorboard(run_dir: Path, start: int):
    from torch.utils.tensorboard import SummaryWriter  # here: 0.2 s that only a starting run needs (not sweep, study)

    return SummaryWriter(str(run_dir / "tb"), purge_step=start if start else None)


def log_step(run_dir: Path, writer, metrics: dict[str, float], samples) -> None:
    append_jsonl(run_dir / "metrics.jsonl", metrics)
    for record in samples:
        append_jsonl(run_dir / "samples.jsonl", record)
    for key, value in metrics.items():
        if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
            writer.add_scalar(key, value, metrics["step"])
    writer.flush()
