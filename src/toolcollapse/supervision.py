"""Supervision signals mixed into GRPO (arXiv 2606.26027; docs/DESIGN.md, "Supervision signals").

Each signal is a module of signals/ (its rows, loss terms, phases, alarm handler); here are the pieces they
share with the TRL integration and the SFT phases: the SFT term's NLL, HBG's hints, unlikelihood's positions.

Two terms are added to the GRPO loss. The synchronous SFT term: every GRPO step also minimises

    sft_coef * NLL(ground-truth conversations of the step's tasks)

token-mean over their assistant tokens (the tokens `sft` trains), in the same optimizer step
as the policy loss -- the joint loss of CHORD (arXiv 2508.11408) with a fixed weight. It
keeps supervision on the format and on copying while RL moves the policy, at the price of
SFT tokens, which every step logs (`sup/sft_tokens`, and their running total) so that a
gain can be told apart from "more SFT" (docs/LOG.md).

Unlikelihood (not in the paper; arXiv 1908.04319): in each of the policy's own failed turns,
the first control token the grammar rejects (`parser.first_rejected_control`: `<|im_end|>`
inside a call, a stray `</tool_call>`, `<tool_response>` ...) adds
`unlikelihood_coef * -log(1 - p)` (mean over such tokens of the batch), computed from the
update's own forward: the collapse's spike pushed down where it happened.

Two signals change the rows of a GRPO group (signals/rows.py); a group of G is, in order,
the policy's own samples, then HBG's hinted rows, then OPS's expert rows:

- OPS (off-policy supervision): `ops.rows` of each group are the task's ground-truth
  trajectory, fed turn by turn through the environment (`RolloutEngine.replay`: real
  observations, the same encoder, masks and limits) and rewarded like the others; the
  advantages are over the mixed group. Their tokens' loss is LUFFY's shaped -A * p/(p + gamma)
  (`ops.shaping: luffy`, the paper's text) or the clipped surrogate with old log-probs from a
  forward pass (`none`, the released scripts). The KL term to the reference covers their tokens
  too, and the monitor's update-forward statistics (`ctrl/*`) leave them out.
- HBG (hint-based guidance): `hbg.rows` of each group sample with a hint appended to the system
  message (`hint`: templated from the ground truth -- the format reminder, the tools to call,
  the first calls -- never the answer); the update trains those rows on the hint-free prompt
  (`without_hint`), their old log-probs recomputed there, so their first ratio is 1.

Rows that are not the policy's own (hinted, expert) do not count in the training success the
step reports (`success`, `healthy_rate`, the states: on-policy rows only); theirs is logged
apart (`sup/expert_success`, `sup/hinted_success`).

The interleaved signals -- ETS, PRS, the adaptive schedule -- and the `sft_only` control run
SFT phases between steps instead: interleave.py.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch.nn.functional as F

from toolcollapse.chat_models import answering_chat_model, from_factory
from toolcollapse.encoding import Example, batch_logits
from toolcollapse.parser import first_rejected_control
from toolcollapse.records import CallEnd, Episode, Message, Task

@dataclass(frozen=True)
class SFTTerm:
    """`coef` * token-mean NLL of `examples`, accumulated into the parameters' .grad in micro-batches."""

    coef: float
    micro_batch_size: int
    pad_id: int

    def backward(self, model: Any, examples: Sequence[Example]) -> tuple[float, int]:
        """Add the term's gradient to .grad; the examples' summed NLL (at temperature 1, as `sft` trains) and
        their trained tokens."""
        n_tokens = sum(sum(m[1:]) for _, m in examples)
        total = 0.0
        for start in range(0, len(examples), self.micro_batch_size):
            logits, targets = batch_logits(model, examples[start:start + self.micro_batch_size], self.pad_id)
            nll = F.cross_entropy(logits, targets, reduction="sum")
            (self.coef * nll / max(1, n_tokens)).backward()
            total += nll.item()
        return total, n_tokens


def sft_tokens_so_far(rows: Sequence[dict[str, Any]]) -> float:
    """The running total of SFT tokens in a run's metric rows (0 before any)."""
    return next((r["sup/sft_tokens_total"] for r in reversed(rows) if "sup/sft_tokens_total" in r), 0.0)



# ----------------------------------------------------------------------------- HBG: hints


FORMAT_HINT = ("Hint: make one tool call per turn, a JSON object within <tool_call></tool_call> tags; "
               "once the tools have given you what you need, reply with the answer alone.")


def hint(task: Task, level: str = "plan", calls: int = 1) -> str:
    """The hint HBG appends to the system message, templated from the ground truth (no LLM). `format`:
    the call-format reminder; `plan`: and the tools to call, in order; `calls`: and the first `calls`
    ground-truth calls. A call whose JSON holds the answer is never shown, nor any after it."""
    tool_calls = [m.tool_call for m in task.reference if m.role == "assistant" and m.tool_call is not None]
    lines = [FORMAT_HINT]
    if level in ("plan", "calls") and tool_calls:
        lines.append("Plan: call " + ", then ".join(c.name for c in tool_calls) + ".")
    if level == "calls":
        shown = []
        for call in tool_calls[:calls]:
            if task.answer and task.answer in call.to_json():
                break
            shown.append(f"<tool_call>\n{call.to_json()}\n</tool_call>")
        if shown:
            lines.append("Start with:\n" + "\n".join(shown))
    return "\n".join(lines)


HINT_PROMPT = ("You write a short hint for an assistant about to solve a task with tools. From the reference "
               "tool calls, say which tools to call, in which order, and what each call needs, in at most three "
               "sentences. Never state the final answer or any tool's result.")
MAX_HINT_CHARS = 600


class LLMHintWriter:
    """HBG's hints as in the paper: a chat model's summary of the ground-truth calls, after the format reminder.
    The template hint stands in where a call fails or the summary is empty, too long (> MAX_HINT_CHARS) or
    holds the task's answer (one the question does not hold already, as a comparison's). One hint per task, kept for the run (and the chat model's disk cache across runs)."""

    def __init__(self, chat: Any, level: str = "plan", calls: int = 1, max_failures: int = 20,
                 warn: Any = print):
        self.chat, self.level, self.calls, self.max_failures, self.warn = chat, level, calls, max_failures, warn
        self.hints: dict[str, str] = {}
        self.accepted = self.rejected = self.failed = 0

    def __call__(self, task: Task) -> str:
        if task.id not in self.hints:
            self.hints[task.id] = self._write(task)
        return self.hints[task.id]

    def _write(self, task: Task) -> str:
        template = hint(task, self.level, self.calls)
        if self.failed >= self.max_failures:
            self.failed += 1
            return template
        calls = [m.tool_call.to_json() for m in task.reference if m.role == "assistant" and m.tool_call is not None]
        messages = [{"role": "system", "content": HINT_PROMPT},
                    {"role": "user", "content": f"Task: {task.prompt[-1].content}\n\nReference calls:\n"
                                                + "\n".join(calls)}]
        try:
            text = self.chat(messages).text.strip()
        except Exception as err:  # a failed call costs a hint its wording, never the step
            self.failed += 1
            self.warn(f"hint writer: a call failed ({err}); the template hint stands in")
            return template
        question = task.prompt[-1].content
        gives_answer = bool(task.answer) and task.answer in text and task.answer not in question
        if not text or len(text) > MAX_HINT_CHARS or gives_answer:
            self.rejected += 1
            return template
        self.accepted += 1
        return f"{FORMAT_HINT}\n{text}"

    def metrics(self) -> dict[str, float]:
        stats = getattr(self.chat, "stats", None)
        return {"hint/accepted": self.accepted, "hint/rejected": self.rejected, "hint/failed": self.failed,
                **(stats.as_dict("hint") if stats is not None else {})}


def load_hint_writer(hbg: Any) -> Any:
    """`supervision.hbg.hint_writer` as a callable task -> hint: the template, a chat model (asked once now: a
    wrong address, model, key or source stops the run here), or `package.module:factory`'s callable."""
    spec = hbg.hint_writer
    if spec.kind == "template":
        return functools.partial(hint, level=hbg.level, calls=hbg.calls)
    if spec.kind in ("hf", "openai"):
        return LLMHintWriter(answering_chat_model(spec), hbg.level, hbg.calls, spec.max_failures)
    return from_factory(spec, "supervision.hbg.hint_writer")


def with_hint(task: Task, text: str) -> Task:
    """The task with `text` appended to its system message (a new one first if it has none)."""
    prompt = list(task.prompt)
    if prompt and prompt[0].role == "system":
        prompt[0] = Message("system", f"{prompt[0].content}\n\n{text}")
    else:
        prompt.insert(0, Message("system", text))
    return dataclasses.replace(task, prompt=tuple(prompt))


def without_hint(episode: Episode, prompt: Sequence[int]) -> Episode:
    """A hinted episode re-based on the hint-free `prompt` ids: the same sampled turns and
    observations after it, turn records shifted; log-probs zeroed (to be recomputed there)."""
    shift = len(prompt) - episode.prompt_len
    rest = slice(episode.prompt_len, None)
    return dataclasses.replace(
        episode, tokens=list(prompt) + episode.tokens[rest], loss_mask=[0] * len(prompt) + episode.loss_mask[rest],
        logprobs=[0.0] * (len(prompt) + len(episode.tokens) - episode.prompt_len), prompt_len=len(prompt),
        turns=[dataclasses.replace(t, start=t.start + shift, end=t.end + shift) for t in episode.turns])


def rejected_positions(ids: Sequence[int], turns: Sequence[tuple[int, int]], id_to_tag: dict[int, str],
                       call_end: CallEnd = "template") -> list[int]:
    """In each [start, end) turn of `ids`, the position of its first control token the grammar rejects
    (`parser.first_rejected_control`); turns without one add none. Both trainers' unlikelihood marks these."""
    found = [(start, first_rejected_control(list(ids[start:end]), id_to_tag, call_end)) for start, end in turns]
    return [start + i for start, i in found if i is not None]


def unlikely_positions(episodes: Sequence[Episode], id_to_tag: dict[int, str], call_end: CallEnd) -> list[list[int]]:
    """Per episode, the position of the first control token the grammar rejects in each failed turn."""
    return [rejected_positions(ep.tokens, [(t.start, t.end) for t in ep.turns if not t.parsed.state.healthy],
                               id_to_tag, call_end) for ep in episodes]
