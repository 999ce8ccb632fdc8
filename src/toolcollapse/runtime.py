"""Process-level helpers: seeding, threads, run directories, JSONL files, progress bars."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Iterable

from tqdm.auto import tqdm

from toolcollapse.config import ConfigError


def seed_everything(seed: int) -> None:
    import numpy as np  # here, not at the top: the CLI's checks import this module before any torch
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_threads(threads: int | None) -> None:
    if threads:
        import torch  # (as in seed_everything)

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


_HELD: dict[Path, int] = {}  # lock file -> the descriptor this process holds it with


def lock_file(path: str | Path) -> Path:
    """Where the lock of a run or study directory lives: beside it, `.<name>.lock` (so --overwrite can clear the
    directory under a held lock)."""
    p = Path(path).resolve()
    return p.parent / f".{p.name}.lock"


def lock_dir(path: str | Path, what: str) -> None:
    """Hold an exclusive OS lock (flock) on `path`, a run's or a study's directory, for the rest of this process:
    a second job on it is a ConfigError at once, naming the directory and the holder's pid. The kernel releases
    the lock when the process ends, however it ends, so a crashed run leaves none behind. Taking it again in the
    same process is a no-op."""
    lock = lock_file(path)
    if lock in _HELD:
        return
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError(f"cannot write in {lock.parent} ({err.strerror}), where {path} and its lock would go; "
                          "choose another directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(f"{path} is in use by another {what} (pid {holder}, lock {lock}); wait for it to end, "
                          "or write to another directory") from None
    try:  # the holder's pid, for the message of a second job; a full disk leaves it out, not the lock
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass
    _HELD[lock] = fd


def unlock_dir(path: str | Path) -> None:
    fd = _HELD.pop(lock_file(path), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the flock


def check_writable(path: str | Path, need_bytes: int = 0) -> None:
    """ConfigError before any work when `path` (or, if it does not exist yet, its nearest existing parent)
    cannot take a file, or has less than `need_bytes` free: as root, mode bits say nothing (an immutable or
    read-only file system does), so a file is really created and removed."""
    target = Path(path)
    while not target.exists():
        target = target.parent
    probe = target / f".toolcollapse-write-check-{os.getpid()}"
    try:
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write in {target} ({err.strerror}): the run could not save its logs or "
                          "checkpoints; choose another directory") from None
    free = shutil.disk_usage(target).free
    if free < need_bytes:
        raise ConfigError(f"{target} has {free / 2**20:.0f} MiB free; a checkpoint needs about "
                          f"{need_bytes / 2**20:.0f} MiB: free some space or write elsewhere")


STORAGE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


def storage_problem(path: str | Path, err: BaseException) -> OSError | None:
    """The storage fault behind `err`, raised while writing under `path`, or None when it was something else:
    `err` itself when it is one (no space, no permission, a read-only file system), else what a probe write in
    `path` meets now (torch and safetensors report a full disk as their own errors)."""
    if isinstance(err, OSError) and err.errno in STORAGE_ERRORS:
        return err
    probe = Path(path) / f".toolcollapse-write-check-{os.getpid()}"
    try:
        probe.write_bytes(b"x" * 4096)
        probe.unlink()
    except OSError as found:
        return found if found.errno in STORAGE_ERRORS else None
    if shutil.disk_usage(path).free < (1 << 20):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return None


STOP_FILE_ENV = "TOOLCOLLAPSE_STOP_FILE"  # a sweep's runs stop after their step once this file exists


class StopOnSignal:
    """SIGTERM and SIGINT ask a loop to stop once its current step is done (the loop reads `requested`, saves a
    checkpoint and calls `exit`); a second signal stops at once. `stop_file`: a file whose existence asks the
    same (a study's runs in other processes). Handlers are installed only in the main thread, and `restore`
    puts back the ones before."""

    def __init__(self, what: str, stop_file: str | Path | None = None):
        self.what, self.signum = what, None
        self.stop_file = Path(stop_file) if stop_file else None
        self._old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            self.restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.signum = signum
        again = "Ctrl-C" if signum == signal.SIGINT else "a second signal"
        tqdm.write(f"{self.what}: {signal.Signals(signum).name}: stopping after this step, with a checkpoint "
                   f"({again} stops at once)")

    @property
    def requested(self) -> bool:
        if self.signum is None and self.stop_file is not None and self.stop_file.exists():
            self.signum = signal.SIGTERM
        return self.signum is not None

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def exit(self, message: str) -> None:
        """Print `message` (what to run to continue) and end the process with 128 + the signal's number. A
        further signal from here on is ignored (SIG_IGN, which the interpreter's shutdown keeps, where it resets
        a Python handler to the default): the run has stopped with its checkpoint, and a second Ctrl-C just after
        must not kill the ending process (exit -2, no message)."""
        self.restore()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
        tqdm.write(message)
        raise SystemExit(128 + int(self.signum or 15))


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
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+0085, U+2028 may sit inside a string
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
