"""Process-level helpers: seeding, threads, JSONL files, progress bars."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from tqdm.auto import tqdm


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")


def write_jsonl(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def progress(total: int, desc: str, initial: int = 0) -> tqdm:
    """A progress bar on stderr (step, postfix metrics, ETA); quiet when stderr is not a TTY
    except for a line every ~10 %."""
    interactive = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=True,
                mininterval=0.5 if interactive else 30.0, file=sys.stderr)
