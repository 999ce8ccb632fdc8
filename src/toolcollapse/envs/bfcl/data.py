"""BFCL v4 multi-turn entries from the `bfcl-eval` package's data files, and the train/test split.

An entry is one scenario: the backend classes it involves and their initial state,
the user turns, the ground-truth calls of each turn (`possible_answer/`), and for
`miss_func` the functions held out until a given turn. Files are located with
`importlib.util.find_spec`, so none of bfcl_eval's modules (which pin old numpy and
many API SDKs) is imported.

Split (the paper's): for each category, the entries in file order are shuffled with a
fresh `random.Random(split_seed)`; the first `n_train` are `train`, the next `n_test`
are `test`. The four multi-turn files hold 200 entries each, and entry i of one
category is a variant of the same scenario as entry i of another; equal-length lists
shuffled by equal seeds get the same permutation, so a scenario lands in the same
split in every category and never straddles train and test.
"""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPLITS: tuple[str, ...] = ("train", "test")
CATEGORIES: tuple[str, ...] = ("base", "miss_func", "miss_param", "long_context")  # offline multi-turn
REFUSED: dict[str, str] = {  # BFCL v4 categories this environment cannot run offline
    "web_search": "calls a live search engine (network)",
    "memory": "needs an embedding model (memory_vector) and files written by prerequisite runs",
    "memory_kv": "BFCL's memory suite, not multi-turn; needs prerequisite conversations",
    "memory_vector": "needs a sentence-transformers embedding model and faiss",
    "memory_rec_sum": "BFCL's memory suite, not multi-turn; needs prerequisite conversations",
}


@dataclass(frozen=True)
class Entry:
    id: str  # e.g. multi_turn_base_0
    category: str  # base, miss_func, miss_param, long_context
    classes: tuple[str, ...]  # involved backend classes, in BFCL's order
    initial_config: dict[str, Any]
    user_turns: tuple[str, ...]  # one user message per turn; "" for a held-out-function turn
    ground_truth: tuple[tuple[str, ...], ...]  # per turn, BFCL call strings such as "cd(folder='document')"
    missed: dict[int, tuple[str, ...]] = field(default_factory=dict)  # turn -> functions held out until then

    @property
    def long_context(self) -> bool:
        return self.category == "long_context"


def bfcl_data_dir(data_dir: str | None = None) -> Path:
    """The BFCL `data/` directory: the given one, or the one inside the installed bfcl_eval."""
    if data_dir is not None:
        return Path(data_dir)
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("bfcl-eval is not installed; `pip install --no-deps bfcl-eval` (its data files are used)")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def check_category(category: str) -> None:
    if category in REFUSED:
        raise ValueError(f"BFCL category {category!r} is not supported: it {REFUSED[category]}; "
                         f"choose from {', '.join(CATEGORIES)}")
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL multi-turn category {category!r}; choose from {', '.join(CATEGORIES)}")


def load_entries(data_dir: Path, category: str) -> list[Entry]:
    """Every entry of `multi_turn_<category>`, in file order, with its ground truth."""
    check_category(category)
    questions = _read_jsonl(data_dir / f"BFCL_v4_multi_turn_{category}.json")
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(data_dir / "possible_answer" /
                                                                f"BFCL_v4_multi_turn_{category}.json")}
    return [_entry(q, answers[q["id"]], category) for q in questions]


def _entry(row: dict[str, Any], ground_truth: list[list[str]], category: str) -> Entry:
    if len(ground_truth) != len(row["question"]):
        raise ValueError(f"{row['id']}: {len(row['question'])} user turns but {len(ground_truth)} ground-truth turns")
    return Entry(
        id=row["id"], category=category, classes=tuple(row["involved_classes"]),
        initial_config=row.get("initial_config", {}),
        user_turns=tuple(_user_text(turn, row["id"]) for turn in row["question"]),
        ground_truth=tuple(tuple(t) for t in ground_truth),
        missed=_held_out(row, ground_truth),
    )


def _held_out(row: dict[str, Any], ground_truth: list[list[str]]) -> dict[int, tuple[str, ...]]:
    """miss_func's held-out functions per reveal turn, less any the ground truth itself calls before
    that turn: BFCL's multi_turn_miss_func_49 holds out `tail` until turn 3 but calls it in turn 1."""
    out = {}
    for key, names in row.get("missed_function", {}).items():
        turn = int(key)
        called_before = {s.split("(", 1)[0].strip() for t in ground_truth[:turn] for s in t}
        out[turn] = tuple(n for n in names if n not in called_before)
    return out


def _user_text(messages: list[dict[str, str]], entry_id: str) -> str:
    if any(m["role"] != "user" for m in messages) or len(messages) > 1:
        raise ValueError(f"{entry_id}: a turn should hold at most one user message, got {messages}")
    return messages[0]["content"] if messages else ""


def split_entries(entries: list[Entry], seed: int, n_train: int, n_test: int) -> dict[str, list[Entry]]:
    if n_train + n_test > len(entries):
        raise ValueError(f"bfcl.n_train + bfcl.n_test = {n_train + n_test} exceeds the {len(entries)} entries of "
                         f"{entries[0].category if entries else 'the category'}")
    shuffled = list(entries)
    random.Random(seed).shuffle(shuffled)
    return {"train": shuffled[:n_train], "test": shuffled[n_train:n_train + n_test]}


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
