"""PRS's judge: what went wrong in a failed rollout, turn by turn against the ground truth.

The paper (arXiv 2606.26027) asks an LLM to read a failed rollout next to the ground-truth
actions and write an analysis -- the mistake, its cause, the corrected call. Here the default
judge is deterministic: it has the ground truth and the parser's verdict of every turn, so it
names the first turn that departs from the reference and how --

    malformed           the parser rejected the turn (its error type and detail)
    wrong_tool          a well-formed call to another tool than the reference's
    miscopied_argument  an argument whose reference value stands in the context (the question,
                        a tool's reply) but was written otherwise
    wrong_argument      an argument whose reference value is computed, written otherwise
    stopped_early       an answer (or the end of the episode) where the reference still calls
    extra_call          a call where the reference answers
    wrong_answer        an answer other than the reference's

-- and writes a reflection with the corrected turn. Turns after the first mistake are not
compared: their context is no longer the reference's.

Any callable with `Judge`'s signature replaces it (`supervision.prs.judge: "module:factory"`,
or `run_rl(judge=...)`); `ChatJudge` wraps a chat model (e.g. a Hugging Face pipeline) that
writes the reflection while the deterministic judge still locates the turn.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from toolcollapse.chat_models import answering_chat_model, from_factory
from toolcollapse.config import ChatModelConfig
from toolcollapse.parser import parse_turn
from toolcollapse.records import Episode, Message, Task, ToolCall

MISTAKES = ("malformed", "wrong_tool", "miscopied_argument", "wrong_argument", "stopped_early", "extra_call",
            "wrong_answer", "none")


@dataclass(frozen=True)
class Verdict:
    turn: int | None  # index of the first assistant turn that went wrong (None: no turn-level mistake found)
    mistake: str  # one of MISTAKES
    reflection: str  # what went wrong and the corrected turn, in words


class Judge(Protocol):
    def __call__(self, task: Task, episode: Episode, decode: Callable[[Sequence[int]], str]) -> Verdict: ...


def reference_turns(task: Task) -> list[Message]:
    return [m for m in task.reference if m.role == "assistant"]


def written(message: Message) -> str:
    """An assistant turn as the reflection quotes it."""
    if message.tool_call is not None:
        return f"<tool_call>\n{message.tool_call.to_json()}\n</tool_call>"
    return message.content


def _context(task: Task, episode: Episode, upto: int) -> str:
    """The text the policy could copy from before turn `upto`: the prompt and the tool replies."""
    replies = [t.observation or "" for t in episode.turns[:upto]]
    return "\n".join([m.content for m in task.prompt] + replies)


def _value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _compare_calls(got: ToolCall, want: ToolCall, context: str) -> tuple[str, str] | None:
    """(mistake, what went wrong) between two well-formed calls, or None if they agree."""
    if got.name != want.name:
        return "wrong_tool", f"it called {got.name} where {want.name} was needed"
    for key, expected in want.arguments.items():
        if key not in got.arguments:
            return "wrong_argument", f"{want.name} lacks the argument {key!r} (it should be {_value(expected)})"
        if got.arguments[key] != expected:
            copied = _value(expected) in context
            how = "miscopied" if copied else "computed wrongly"
            where = ", which the context states" if copied else ""
            what = (f"argument {key!r} of {want.name} was {how}: {_value(got.arguments[key])} instead of "
                    f"{_value(expected)}{where}")
            return ("miscopied_argument" if copied else "wrong_argument"), what
    extra = sorted(set(got.arguments) - set(want.arguments))
    if extra:
        return "wrong_argument", f"{want.name} got arguments it does not need: {', '.join(map(repr, extra))}"
    return None


def deterministic_judge(task: Task, episode: Episode, decode: Callable[[Sequence[int]], str] | None = None) -> Verdict:
    """The first turn of `episode` that departs from `task`'s reference, and a reflection on it."""
    ref = reference_turns(task)
    for i, (turn, want) in enumerate(zip(episode.turns, ref)):
        p = turn.parsed
        found: tuple[str, str] | None
        if not p.state.healthy:
            error = p.errors[0].value if p.errors else "malformed"
            found = "malformed", f"the turn is malformed ({error}{': ' + p.detail if p.detail else ''})"
        elif p.call is not None and want.tool_call is not None:
            found = _compare_calls(p.call, want.tool_call, _context(task, episode, i))
        elif p.call is None and want.tool_call is not None:
            found = "stopped_early", f"it answered before calling {want.tool_call.name}"
        elif p.call is not None:
            found = "extra_call", f"it called {p.call.name} where the tool replies already held the answer"
        elif not task.answer:  # judged on state (BFCL): a closing text is not compared word for word
            found = None
        else:
            found = None if p.text.strip() == want.content.strip() else (
                "wrong_answer", f"the answer {p.text.strip()!r} is not the expected one")
        if found is not None:
            return Verdict(i, found[0], _reflection(i, found[1], want))
    if len(episode.turns) < len(ref):
        i = len(episode.turns)
        why = {"max_turns": "it ran out of turns", "context_limit": "it ran out of context"}.get(
            episode.finish, "the episode ended")
        return Verdict(i, "stopped_early", _reflection(i, f"{why} before this turn", ref[i]))
    return Verdict(None, "none", "Every turn matches the reference; the failure is not in a single turn.")


def _reflection(i: int, what: str, want: Message) -> str:
    return f"Turn {i + 1}: {what}. The correct turn {i + 1} is:\n{written(want)}"


# ----------------------------------------------------------------------------- other judges


def transcript(task: Task, episode: Episode, decode: Callable[[Sequence[int]], str], upto: int | None = None) -> str:
    """The rollout after its prompt as text (sampled turns and tool replies), through turn `upto`."""
    end = len(episode.tokens)
    if upto is not None and upto + 1 < len(episode.turns):
        end = episode.turns[upto + 1].start
    return decode(episode.tokens[episode.prompt_len:end])


JUDGE_PROMPT = ("You review a tool-using assistant's attempt at a task. Compare each of its turns with the "
                "reference turns, name the first mistake and its cause, and give the corrected turn.")


def judge_messages(task: Task, episode: Episode, decode: Callable[[Sequence[int]], str],
                   upto: int | None = None) -> list[dict[str, str]]:
    """A chat-model judge's input: the task, the attempt (through turn `upto`) and the reference turns."""
    reference = "\n".join(f"Turn {i + 1}: {written(m)}" for i, m in enumerate(reference_turns(task)))
    question = task.prompt[-1].content
    return [{"role": "system", "content": JUDGE_PROMPT},
            {"role": "user", "content": f"Task: {question}\n\nAttempt:\n{transcript(task, episode, decode, upto)}"
                                        f"\n\nReference turns:\n{reference}"}]


@dataclass(frozen=True)
class ChatJudge:
    """A chat model writes the reflection (`generate`: chat messages -> text, e.g. a wrapped HF
    pipeline); the deterministic judge locates the turn and names the mistake."""

    generate: Callable[[list[dict[str, str]]], str]

    def __call__(self, task: Task, episode: Episode, decode: Callable[[Sequence[int]], str]) -> Verdict:
        located = deterministic_judge(task, episode, decode)
        text = self.generate(judge_messages(task, episode, decode, located.turn)).strip()
        return Verdict(located.turn, located.mistake, text or located.reflection)


# ----------------------------------------------------------------------------- LLM judges (PRS as in the paper)


LLM_JUDGE_PROMPT = (
    "You review a tool-using assistant's failed attempt at a task, beside the reference turns that solve it. "
    "Write exactly four parts, each starting on its own line with its label:\n"
    "Intent: what the task asks.\n"
    "Mistake: the first turn that went wrong, and how.\n"
    "Root cause: why the assistant made that mistake.\n"
    "Corrected calls: the tool calls from that turn on, each as <tool_call>{\"name\": ..., \"arguments\": {...}}"
    "</tool_call>, one per line (write none if the reference answers there instead).")
PARTS = ("intent", "mistake", "root cause", "corrected calls")
_PART = re.compile(r"^\s*\**\s*(intent|mistake|root cause|corrected calls)\s*\**\s*:", re.I | re.M)
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def llm_judge_messages(task: Task, episode: Episode, decode: Callable[[Sequence[int]], str],
                       upto: int | None = None) -> list[dict[str, str]]:
    """The paper's PRS judge's input: the task, the failed attempt and the ground truth, and the four parts."""
    messages = judge_messages(task, episode, decode, upto)
    return [{"role": "system", "content": LLM_JUDGE_PROMPT}, messages[1]]


def read_reflection(text: str, task: Task, turn: int | None, tools: Any = None) -> tuple[str | None, str]:
    """(the reflection in our words, None) for a reply that has the four parts and whose corrected calls parse
    (our parser) and equal the reference's calls from `turn` on; (None, why) otherwise."""
    found = {m.group(1).lower(): m for m in _PART.finditer(text)}
    missing = [p for p in PARTS if p not in found]
    if missing:
        return None, f"no {missing[0]!r} part"
    order = sorted(found.values(), key=lambda m: m.start())
    parts = {m.group(1).lower(): text[m.end():(order[i + 1].start() if i + 1 < len(order) else len(text))].strip()
             for i, m in enumerate(order)}
    if any(not parts[p] for p in PARTS[:3]):
        return None, f"an empty {next(p for p in PARTS[:3] if not parts[p])!r} part"
    calls = []
    for block in _CALL.findall(parts["corrected calls"]):
        parsed = parse_turn(f"<tool_call>{block}</tool_call>", tools)
        if parsed.call is None or not parsed.state.healthy:
            return None, f"a corrected call that does not parse ({parsed.errors[0].value if parsed.errors else '?'})"
        calls.append(parsed.call)
    want = [m.tool_call for m in reference_turns(task)[turn or 0:] if m.tool_call is not None]
    if [(c.name, c.arguments) for c in calls] != [(c.name, c.arguments) for c in want]:
        return None, f"corrected calls {[c.name for c in calls]} are not the reference's {[c.name for c in want]}"
    written_calls = "\n".join(f"<tool_call>\n{c.to_json()}\n</tool_call>" for c in want) or "none"
    return (f"Intent: {parts['intent']}\nMistake: {parts['mistake']}\nRoot cause: {parts['root cause']}\n"
            f"Corrected calls:\n{written_calls}"), ""


@dataclass
class JudgeStats:
    accepted: int = 0  # the model's reflection trained
    rejected: int = 0  # a reply that was not a valid reflection: the deterministic one trained instead
    failed: int = 0  # calls that failed after their retries, or skipped past max_failures: deterministic
    reasons: dict[str, int] = dataclasses.field(default_factory=dict)


class LLMJudge:
    """PRS's judge as in the paper: a chat model reads the failed rollout beside the ground truth and writes
    intent, mistake, root cause and the corrected calls (`read_reflection` validates them); the deterministic
    judge locates the turn and stands in for every reply that is rejected or fails."""

    def __init__(self, chat: Any, max_failures: int = 20, concurrency: int = 1, warn: Callable[[str], None] = print):
        self.chat, self.max_failures, self.concurrency, self.warn = chat, max_failures, concurrency, warn
        self.stats = JudgeStats()
        self._lock = threading.Lock()

    def __call__(self, task: Task, episode: Episode, decode: Callable[[Sequence[int]], str]) -> Verdict:
        located = deterministic_judge(task, episode, decode)
        if located.turn is None:
            return located
        with self._lock:
            give_up = self.stats.failed >= self.max_failures
        if give_up:
            return self._fallback(located, "failed", "past max_failures")
        try:
            reply = self.chat(llm_judge_messages(task, episode, decode, located.turn))
        except Exception as err:  # a failed call never costs the phase: the deterministic reflection trains
            with self._lock:
                if self.stats.failed + 1 == self.max_failures:
                    self.warn(f"judge: {self.max_failures} calls failed; every later reflection is the "
                              "deterministic one")
            self.warn(f"judge: a call failed ({err}); the deterministic reflection stands in")
            return self._fallback(located, "failed", str(err).split(" from ")[0])  # "HTTP 500", "APITimeoutError"
        reflection, why = read_reflection(reply.text, task, located.turn)
        if reflection is None:
            return self._fallback(located, "rejected", why.split(" (")[0])
        with self._lock:
            self.stats.accepted += 1
        return Verdict(located.turn, located.mistake, reflection)

    def _fallback(self, located: Verdict, outcome: str, why: str) -> Verdict:
        with self._lock:
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
            self.stats.reasons[why] = self.stats.reasons.get(why, 0) + 1
        return located

    def many(self, items: Sequence[tuple[Task, Episode]], decode: Callable[[Sequence[int]], str]) -> list[Verdict]:
        """Verdicts on many failures, `concurrency` calls in flight (a server's batch), in their order."""
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(lambda item: self(item[0], item[1], decode), items))

    def metrics(self) -> dict[str, float]:
        """judge/* for a phase's record: the reflections' fate and the chat model's cost."""
        s = self.stats
        out = {"judge/accepted": s.accepted, "judge/rejected": s.rejected, "judge/failed": s.failed}
        chat_stats = getattr(self.chat, "stats", None)
        return {**out, **(chat_stats.as_dict("judge") if chat_stats is not None else {})}


def load_judge(spec: Any) -> Judge:
    """A judge from `supervision.prs.judge` (config.ChatModelConfig; a string: `deterministic` or
    `package.module:callable`, a zero-argument callable returning a Judge). A chat model is asked once
    first: a wrong address, model name, key or source stops the run here (ConfigError)."""
    if isinstance(spec, str):
        spec = {"kind": "deterministic"} if spec == "deterministic" else {"kind": "factory", "factory": spec}
        spec = ChatModelConfig(**spec)
    if spec.kind == "deterministic":
        return deterministic_judge
    if spec.kind in ("hf", "openai"):
        # a server takes `concurrency` calls at once; a local model generates one at a time (its lock)
        return LLMJudge(answering_chat_model(spec), spec.max_failures,
                        spec.concurrency if spec.kind == "openai" else 1)
    return from_factory(spec, "supervision.prs.judge")


def judge_all(judge: Judge, items: Sequence[tuple[Task, Episode]], decode: Callable[[Sequence[int]], str]) -> list[Verdict]:
    """The verdicts on many failures, in order: a chat-model judge (`LLMJudge.many`) asks for them at once,
    `concurrency` calls in flight; any other judge one by one."""
    many = getattr(judge, "many", None)
    return many(items, decode) if many is not None else [judge(task, ep, decode) for task, ep in items]
