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

import importlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

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


def load_judge(spec: str) -> Judge:
    """`deterministic`, or `package.module:factory` -- a zero-argument callable returning a Judge."""
    if spec == "deterministic":
        return deterministic_judge
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"supervision.prs.judge: {spec!r} is neither 'deterministic' nor 'module:factory'")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"supervision.prs.judge: cannot load {spec!r} ({type(err).__name__}: {err})") from None
    return factory()
