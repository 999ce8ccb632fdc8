"""Process-level helpers: seeding, threads, run directories, JSONL files, progress bars."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable

from tqdm.auto import tqdm


def seed_everything(seed: int) -> None:
    import numpy as np  # here, not at the top: the CLI's checks import this module before any torch
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


# What marks a directory as holding a run of each kind: the files `rl` and `sft` write first.
# `--overwrite` replaces only such a directory: a folder that merely has a config.yaml is no run.
RUN_KINDS = {"rl": ("config.yaml", ("metrics.jsonl", "checkpoints", "tb")), "sft": ("toolcollapse.yaml", ())}


def holds_run(path: Path, kind: str) -> bool:
    must, any_of = RUN_KINDS[kind]
    return (path / must).exists() and (not any_of or any((path / name).exists() for name in any_of))


def check_new_run_dir(path: Path, overwrite: bool, kind: str, resume_hint: str = "") -> None:
    """Refuse an output directory that is not empty, before anything is written: it holds another
    run (unless `overwrite`, which replaces a run of the same kind and nothing else) or other files.
    Raises ConfigError naming what is there and the ways out."""
    from toolcollapse.config import ConfigError

    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise ConfigError(f"{path} exists and is not a directory")
    contents = sorted(p.name for p in path.iterdir())
    if not contents:
        return
    if overwrite and holds_run(path, kind):
        return
    other = [k for k in RUN_KINDS if holds_run(path, k)]
    if not other:
        raise ConfigError(f"{path} is not empty and holds no {kind} run ({', '.join(contents[:4])}"
                          f"{', ...' if len(contents) > 4 else ''}); write the run to a new or empty directory"
                          + ("" if not overwrite else " (--overwrite replaces only a run)"))
    if overwrite:
        raise ConfigError(f"{path} holds an {other[0]} run, not an {kind} run; --overwrite will not replace it")
    raise ConfigError(f"{path} already holds a run ({', '.join(contents[:4])}{', ...' if len(contents) > 4 else ''}); "
                      f"{resume_hint}choose another directory, or pass --overwrite to replace it")


def clear_run_dir(path: Path, kind: str) -> None:
    """Delete a previous run of `kind` that `check_new_run_dir(..., overwrite=True)` accepted."""
    if Path(path).is_dir() and holds_run(Path(path), kind):
        shutil.rmtree(path)


def json_line(record: dict[str, Any]) -> str:
    """One line of JSON, valid UTF-8 whatever strings it holds. A model can write a lone surrogate
    (the six characters `\\ud800` in a call's JSON decode to one); it is written back as that same
    escape, so the file stays valid and reads back to the same string."""
    return json.dumps(record, ensure_ascii=False).encode("utf-8", "backslashreplace").decode("utf-8") + "\n"


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json_line(record))


def write_jsonl(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json_line(r))


MAX_LINE_BYTES = 16 << 20  # a JSONL record longer than this is not one of ours: skipped as bad


class NotTextError(ValueError):
    """A file read as JSON lines that is not UTF-8 text."""


def jsonl_lines(path: str | Path) -> list[tuple[int, str, dict[str, Any] | None]]:
    """(line number, text, record or None) for every non-blank line of a JSON-lines file; None where the line is
    not a JSON object -- the torn last line of a process that died mid-write, garbage, a line nested past
    Python's recursion limit or longer than MAX_LINE_BYTES. A file that is not UTF-8 text is a NotTextError
    naming the first bad byte."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise NotTextError(f"{path}: not a JSON-lines text file (byte {err.start} is 0x{data[err.start]:02x}, "
                           "not UTF-8)") from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        record = None
        if len(line) <= MAX_LINE_BYTES:
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                pass
        out.append((number, line, record if isinstance(record, dict) else None))
    return out


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; a line that is not a JSON object is skipped with a warning naming the
    file and line (the torn last line of a killed run, garbage), a file that is not text is a NotTextError."""
    records = []
    for number, line, record in jsonl_lines(path):
        if record is None:
            print(f"warning: {path}:{number}: not a JSON record, skipped ({line[:60]!r}"
                  f"{'...' if len(line) > 60 else ''})", file=sys.stderr)
        else:
            records.append(record)
    return records


_PROGRESS = {"shown": True}


def hide_progress() -> None:
    """No progress bars from `progress` in this process (a study's workers: the study shows one bar)."""
    _PROGRESS["shown"] = False


def progress(total: int, desc: str, initial: int = 0) -> tqdm:
    """A progress bar on stderr (step, postfix metrics, ETA); quiet when stderr is not a TTY
    except for a line every ~10 %."""
    interactive = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=True,
                mininterval=0.5 if interactive else 30.0, file=sys.stderr, disable=not _PROGRESS["shown"])
