"""Autopsy of rollouts dumped by other RL frameworks: four-state and error-type rates per step.

A dump's assistant turns are re-tokenized with the policy's tokenizer and parsed by the
same strict parser as toolcollapse's own rollouts (`parser.parse_turn_ids`), and each
step's rates carry the names `turn_stats.rollout_stats` logs (`healthy_rate`, `state/<state>`,
`error/<error>`, `turns_per_episode`, `response_tokens`), so the diagnose figures read
both kinds of input.

Dumps read (detected per row by its keys, or forced with `fmt`):
  conversations  JSONL of {"step"?, "messages" | "conversation": [{"role", "content",
                 "tool_calls"?}]}; a row without "step" is at row index // batch_size (or 0).
  trl            GRPOTrainer's completions table (`log_completions=True`): columns step,
                 prompt, completion, one per reward function, advantage; as TRL writes it
                 (`<output_dir>/completions/completions_<step>.parquet`), or exported to
                 JSONL / JSON / CSV, or wandb's table JSON ({"columns": [...], "data": [...]}).
                 `completion` is a string, or a list of messages (conversational TRL).
  verl           `trainer.rollout_data_dir`: one `<step>.jsonl` per step of {"input",
                 "output", "gts", "score", "step"}; `output` is the whole response, all
                 its turns with the tool responses between them.
A path may be a directory: every .jsonl/.json/.parquet/.csv file in it is read.

What the parser sees, and where it differs from a live run:
  - Text is split into assistant turns at the chat template's boundaries
    (`<|im_end|>\\n<|im_start|>role\\n`), or, in text decoded with
    `skip_special_tokens=True` -- TRL and verl both dump that way -- at
    `\\nuser\\n<tool_response>...</tool_response>\\nassistant\\n`.
  - A turn with no end token (a message, or such stripped text) gets `<|im_end|>`
    appended, so a turn cut by the token budget counts as finished:
    missing_end_of_turn is undercounted. The notes say how many turns this touched.
    Whether a dump is stripped is decided once for all its text: text rollouts with an
    end token anywhere mean the dump kept them.
  - Structured `tool_calls` (OpenAI/HF format) are rendered back into
    `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` (Qwen2.5's template,
    `chat.CHAT_TEMPLATE`): the parser sees the calls as the framework stored them, after
    its own tool parser, so what that parser dropped or repaired is invisible.
  - A control tag that is not one token of the tokenizer (a model whose `<tool_call>` is
    plain text) is matched as text, and the notes list such tags.
  - Without tool specs (`tools=None`) the parser skips the unknown_tool and
    bad_arguments checks; `load_tools` reads specs from a JSON list.
  - Parquet (TRL's own files) stores one struct type per column, so structured
    arguments come back with the other calls' keys as null (dropped here, at the top
    level only) and integers possibly as floats (the schema check accepts 1.0 for 1).
  - Several calls in one turn are text pollution (multiple_calls), as in toolcollapse's
    own worlds, even for a framework that runs parallel calls.

Bad input: a row that is not JSON, lacks the format's field or has the wrong types
stops the autopsy with `DumpError` (a `ConfigError`: exit status 2 from the CLI) naming
the file and the line (or row): rates over a silently filtered subset would be misread.
A well-formed row with no assistant turn is skipped and counted in the notes.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

from toolcollapse.chat import CONTROL_TAGS, ENDOFTEXT, IM_END, IM_START, TOOL_CALL, TOOL_CALL_END, valid_text
from toolcollapse.config import ConfigError
from toolcollapse.parser import parse_turn, parse_turn_ids
from toolcollapse.records import ErrorType, ParsedTurn, TurnState
from toolcollapse.tools import ToolSpec

DumpFormat = Literal["auto", "conversations", "trl", "verl"]
ROW_KEYS: dict[str, tuple[str, ...]] = {  # the field that carries a row's text, by format
    "conversations": ("messages", "conversation"),
    "trl": ("completion",),
    "verl": ("output",),
}
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
_BOUNDARY = re.compile("(?<=" + re.escape(IM_END) + ")\n" + re.escape(IM_START) + r"(\w+)\n")
_STRIPPED_OBSERVATION = re.compile(r"\s*user\n<tool_response>.*?</tool_response>\s*(?:assistant\n|\Z)", re.S)


class DumpError(ConfigError):
    """A dump that cannot be read; the message names the file and the line or row.

    A ConfigError, so the CLI reports it and exits with status 2, like any bad input path."""


@dataclass(frozen=True)
class DumpedRollout:
    step: int
    assistant_turns: tuple[str, ...]  # each turn as the model wrote it, its end token included
    reward: float | None = None  # the dump's scalar reward ("score", "reward"), if any
    rerendered: int = 0  # turns rebuilt from structured tool_calls
    end_appended: int = 0  # turns whose missing end token was assumed (<|im_end|> appended)
    from_text: bool = True  # split from generated text (else from messages, which carry no end token)


@dataclass
class Dump:
    rollouts: list[DumpedRollout]
    notes: list[str]  # what the reader assumed or skipped, for the report


# ----------------------------------------------------------------------------- reading


def load_dump(path: str | Path, fmt: DumpFormat = "auto", batch_size: int | None = None) -> Dump:
    """Read a dump (file or directory) into rollouts; `batch_size` sets steps for rows without one."""
    if fmt != "auto" and fmt not in ROW_KEYS:
        raise DumpError(f"unknown dump format {fmt!r} (auto, {', '.join(ROW_KEYS)})")
    path = Path(path)
    if not path.exists():
        raise DumpError(f"{path}: no such file or directory")
    files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES) if path.is_dir() else [path]
    if not files:
        raise DumpError(f"{path}: no {', '.join(SUFFIXES)} files in this directory")
    rows = [row for f in files for row in _read_rows(f)]
    read = [_rollout(row, where, i, fmt, batch_size) for i, (where, row) in enumerate(rows)]
    rollouts = [r for r in read if r.assistant_turns]
    texts = [t for r in rollouts if r.from_text for t in r.assistant_turns]
    ends_stripped = not any(IM_END in t or ENDOFTEXT in t for t in texts)
    rollouts = [_end_turns(r) if ends_stripped or not r.from_text else r for r in rollouts]
    return Dump(rollouts, _load_notes(rollouts, len(read) - len(rollouts)))


def split_turns(completion: str) -> list[str]:
    """The assistant turns of a generated text, its control tags kept or stripped (see the module doc)."""
    text = completion.removeprefix(IM_START + "assistant\n")
    if IM_END in text:
        parts = _BOUNDARY.split(text)
        turns = [parts[0]] + [body for role, body in zip(parts[1::2], parts[2::2]) if role == "assistant"]
        turns = [t.rstrip() if t.rstrip().endswith(IM_END) else t for t in turns]
    else:
        turns = _STRIPPED_OBSERVATION.split(text)
    return turns[:-1] if len(turns) > 1 and not turns[-1] else turns


def render_assistant(message: Mapping[str, Any], where: str) -> tuple[str, bool]:
    """An assistant message as the text its model wrote, and whether structured tool_calls were rendered."""
    content = _content_text(message.get("content"), where)
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise DumpError(f"{where}: tool_calls should be a list, got {type(calls).__name__}")
    parts = [content] if content else []
    for call in calls:
        fn = call.get("function", call) if isinstance(call, dict) else None  # OpenAI nests, some don't
        if not isinstance(fn, dict) or "name" not in fn:
            raise DumpError(f"{where}: a tool call should be {{'function': {{'name', 'arguments'}}}}")
        args = fn.get("arguments")
        if isinstance(args, str):  # OpenAI stores the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                pass  # left a string: the parser flags bad_call_schema, as it would the model's text
        body = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
        parts.append(f"{TOOL_CALL}\n{body}\n{TOOL_CALL_END}")
    return "\n".join(parts), bool(calls)


def load_tools(path: str | Path) -> dict[str, ToolSpec]:
    """Tool specs from a JSON list of {"name", "description", "parameters"}, bare or OpenAI-wrapped."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise DumpError(f"{path}: cannot read tool specs: {err}") from None
    specs: dict[str, ToolSpec] = {}
    for i, item in enumerate(raw if isinstance(raw, list) else [None]):
        fn = item.get("function", item) if isinstance(item, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("parameters"), dict)):
            raise DumpError(f"{path}: item {i} should be {{'name': str, 'parameters': {{}}}} in a JSON list")
        specs[fn["name"]] = ToolSpec(fn["name"], fn.get("description", ""), fn["parameters"])
    return specs


def _read_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) for every row of one file; `where` is how an error names it."""
    if path.suffix in (".parquet", ".csv"):
        return _read_table(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DumpError(f"{path}: cannot read: {err}") from None
    if path.suffix == ".json":
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None  # Hugging Face `Dataset.to_json` writes JSON lines under .json
        if obj is not None:
            return _json_rows(path, obj)
    rows = []
    for n, line in enumerate(text.split("\n"), start=1):  # JSON strings may hold U+0085, U+2028 (splitlines' breaks)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise DumpError(f"{path}:{n}: not JSON ({err})") from None
        if not isinstance(row, dict):
            raise DumpError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        rows.append((f"{path}:{n}", row))
    return rows


def _json_rows(path: Path, obj: Any) -> list[tuple[str, dict[str, Any]]]:
    if isinstance(obj, dict) and isinstance(obj.get("columns"), list) and isinstance(obj.get("data"), list):
        table = [dict(zip(obj["columns"], r)) if isinstance(r, list) else r for r in obj["data"]]  # wandb
    elif isinstance(obj, dict) and obj and all(isinstance(v, dict) for v in obj.values()):
        index = list(next(iter(obj.values())))  # pandas' default orient: {column: {index: value}}
        table = [{c: obj[c].get(i) for c in obj} for i in index]
    else:
        table = obj if isinstance(obj, list) else [obj]
    for i, row in enumerate(table):
        if not isinstance(row, dict):
            raise DumpError(f"{path}: row {i}: expected an object or a list of column values")
    return [(f"{path}: row {i}", row) for i, row in enumerate(table)]


def _read_table(path: Path) -> list[tuple[str, dict[str, Any]]]:
    try:
        import pandas as pd

        df = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    except ImportError as err:
        raise DumpError(f"{path}: reading {path.suffix[1:]} needs pandas and pyarrow "
                        f"(pip install 'toolcollapse[parquet]'): {err}") from None
    except Exception as err:  # pandas raises a dozen types for a bad file
        raise DumpError(f"{path}: cannot read as {path.suffix[1:]}: {err}") from None
    df = df.astype(object).where(df.notna(), None)
    records = [{k: _plain(v) for k, v in r.items()} for r in df.to_dict("records")]
    if path.suffix == ".parquet":  # one struct type per column: a key a row's dict lacks comes back as null
        records = [_drop_null_arguments(r) for r in records]
    return [(f"{path}: row {i}", r) for i, r in enumerate(records)]


def _plain(value: Any) -> Any:
    """numpy arrays and scalars from a parquet file as plain lists, dicts and numbers."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, str):
        return _plain(value.tolist())
    return value


def _drop_null_arguments(value: Any) -> Any:
    if isinstance(value, list):
        return [_drop_null_arguments(v) for v in value]
    if isinstance(value, dict):
        return {k: ({a: x for a, x in v.items() if x is not None} if k == "arguments" and isinstance(v, dict)
                    else _drop_null_arguments(v)) for k, v in value.items()}
    return value


def _rollout(row: dict[str, Any], where: str, index: int, fmt: DumpFormat,
             batch_size: int | None) -> DumpedRollout:
    """One row as a rollout, its turns as the dump holds them (no end token assumed yet)."""
    kinds = ROW_KEYS if fmt == "auto" else {fmt: ROW_KEYS[fmt]}
    key = next((k for keys in kinds.values() for k in keys if row.get(k) is not None), None)
    if key is None:
        wanted = " or ".join(repr(k) for keys in kinds.values() for k in keys)
        raise DumpError(f"{where}: no {wanted} field (keys: {', '.join(map(str, row)) or 'none'})")
    step = _step(row.get("step"), where, index, batch_size)
    reward = next((float(row[k]) for k in ("score", "reward") if _is_number(row.get(k))), None)
    value = _maybe_messages(row[key])
    if isinstance(value, str):
        return DumpedRollout(step, tuple(split_turns(value)), reward)
    if isinstance(value, list):
        turns, rerendered = _message_turns(value, f"{where}: {key}")
        return DumpedRollout(step, tuple(turns), reward, rerendered, from_text=False)
    raise DumpError(f"{where}: {key} should be a string or a list of messages, got {type(value).__name__}")


def _message_turns(messages: list, where: str) -> tuple[list[str], int]:
    turns, rerendered = [], 0
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise DumpError(f"{where}[{i}]: a message should be an object with a 'role'")
        if m["role"] == "assistant":
            text, structured = render_assistant(m, f"{where}[{i}]")
            turns.append(text)
            rerendered += structured
    return turns, rerendered


def _end_turns(r: DumpedRollout) -> DumpedRollout:
    """`<|im_end|>` appended to each turn without an end token: the dump does not say how it ended."""
    ended = tuple(t if t.rstrip().endswith((IM_END, ENDOFTEXT)) else t + IM_END for t in r.assistant_turns)
    appended = sum(a != b for a, b in zip(ended, r.assistant_turns))
    return replace(r, assistant_turns=ended, end_appended=appended)


def _step(value: Any, where: str, index: int, batch_size: int | None) -> int:
    if value is None:
        return index // batch_size if batch_size else 0
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise DumpError(f"{where}: step should be an integer, got {value!r}")
    return value


def _maybe_messages(value: Any) -> Any:
    """A list of messages written out as text (a CSV cell, a wandb table) back as a list; else the value."""
    if not (isinstance(value, str) and value.lstrip().startswith("[{")):
        return value
    for read in (json.loads, ast.literal_eval):
        try:
            obj = read(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(obj, list) and all(isinstance(m, dict) and "role" in m for m in obj):
            return obj
    return value


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    raise DumpError(f"{where}: content should be a string or a list of parts, got {type(content).__name__}")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _load_notes(rollouts: Sequence[DumpedRollout], skipped: int) -> list[str]:
    n_turns = sum(len(r.assistant_turns) for r in rollouts)
    appended = sum(r.end_appended for r in rollouts)
    rerendered = sum(r.rerendered for r in rollouts)
    notes = []
    if appended:
        notes.append(f"{appended} of {n_turns} assistant turns carry no end token (messages, or text decoded "
                     f"with skip_special_tokens=True as TRL and verl dump it): <|im_end|> was appended, so a "
                     f"turn cut by the token budget counts as finished (missing_end_of_turn is undercounted)")
    if rerendered:
        notes.append(f"{rerendered} assistant turns were re-rendered from structured tool_calls into "
                     f"<tool_call> text: the parser sees the calls as the framework stored them, not as the "
                     f"model wrote them")
    if skipped:
        notes.append(f"{skipped} rows skipped: no assistant turn")
    return notes


# ----------------------------------------------------------------------------- parsing


def control_tag_ids(tokenizer: Any) -> tuple[dict[int, str], list[str]]:
    """id -> tag for the control tags that are one token of `tokenizer`, and the tags that are not."""
    id_to_tag: dict[int, str] = {}
    missing: list[str] = []
    for tag in CONTROL_TAGS:
        ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == tag:
            id_to_tag[ids[0]] = tag
        else:
            missing.append(tag)
    return id_to_tag, missing


def autopsy(rollouts: Iterable[DumpedRollout], tokenizer: Any,
            tools: Mapping[str, ToolSpec] | None = None) -> list[dict[str, float]]:
    """One row per step, sorted: the metrics `turn_stats.rollout_stats` logs for the turns of that step's rollouts."""
    id_to_tag, text_tags = control_tag_ids(tokenizer)
    im_end = [i for i, t in id_to_tag.items() if t == IM_END]

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    by_step: dict[int, list[DumpedRollout]] = defaultdict(list)
    for r in rollouts:
        by_step[r.step].append(r)
    rows = []
    for step, group in sorted(by_step.items()):
        texts = [valid_text(t) for r in group for t in r.assistant_turns]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        # every tag one token: exactly the live parse; otherwise the missing tags can only be matched as text
        parsed = [parse_turn(decode(i), tools) if text_tags else parse_turn_ids(i, id_to_tag, decode, tools)
                  for i in ids]
        # in a live run the <|im_end|> closing a call turn is a template token, not a sampled one
        sampled = sum(len(i) - (p.end == "call" and i[-1:] == im_end) for i, p in zip(ids, parsed))
        rows.append(step_row(step, group, parsed, sampled))
    return rows


def step_row(step: int, group: Sequence[DumpedRollout], parsed: Sequence[ParsedTurn],
             sampled_tokens: int) -> dict[str, float]:
    n_turns = max(1, len(parsed))
    states = Counter(p.state for p in parsed)
    errors = Counter(e for p in parsed for e in p.errors)
    row: dict[str, float] = {
        "step": step,
        "n_rollouts": len(group),
        "n_turns": len(parsed),
        "healthy_rate": sum(states[s] for s in TurnState if s.healthy) / n_turns,
        "turns_per_episode": len(parsed) / len(group),
        "response_tokens": sampled_tokens / len(group),
    }
    row.update({f"state/{s.value}": states[s] / n_turns for s in TurnState})
    row.update({f"error/{e.value}": errors[e] / n_turns for e in ErrorType})
    if all(r.reward is not None for r in group):
        row["reward_mean"] = sum(r.reward for r in group) / len(group)
    return row


def run_autopsy(path: str | Path, tokenizer_path: str | Path, fmt: DumpFormat = "auto",
                tools_path: str | Path | None = None,
                batch_size: int | None = None) -> tuple[list[dict[str, float]], list[str]]:
    """Load a dump and a local tokenizer, autopsy it: (rows, notes) for `format_autopsy`."""
    from transformers import AutoTokenizer  # here: reading and checking a dump needs no torch, so a bad file is refused at once

    dump = load_dump(path, fmt, batch_size)
    tools = load_tools(tools_path) if tools_path is not None else None
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    notes = list(dump.notes)
    missing = control_tag_ids(tokenizer)[1]
    if missing:
        notes.append(f"control tags that are not single tokens of this tokenizer, matched as text: "
                     f"{', '.join(missing)}")
    if tools is None:
        notes.append("no tool specs: unknown_tool and bad_arguments are not checked")
    return autopsy(dump.rollouts, tokenizer, tools), notes


def format_autopsy(rows: Sequence[Mapping[str, float]], notes: Sequence[str] = ()) -> str:
    """A plain-text table of the per-step four-state rates, the two commonest errors, and the notes."""
    states = [f"state/{s.value}" for s in TurnState]
    header = ["step", "rollouts", "turns", "healthy"] + [s.split("/")[1] for s in states] + ["top errors"]
    lines = []
    for r in rows:
        errs = sorted((-v, k.split("/")[1]) for k, v in r.items() if k.startswith("error/") and v > 0)
        top = ", ".join(f"{name} {-v:.2f}" for v, name in errs[:2]) or "-"
        lines.append([str(r["step"]), str(r["n_rollouts"]), str(r["n_turns"]), f"{r['healthy_rate']:.3f}"]
                     + [f"{r[s]:.3f}" for s in states] + [top])
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]

    def line(cells: list[str]) -> str:  # numbers right-aligned, the error list left as is
        return "  ".join(c.rjust(w) for c, w in zip(cells[:-1], widths)) + "  " + cells[-1]

    out = [line(header)] + [line(cells) for cells in lines]
    if not rows:
        out.append("(no rollouts)")
    return "\n".join(out + [f"note: {n}" for n in notes])
