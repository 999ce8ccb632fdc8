"""Control-token statistics: where the paper's collapse shows first (arXiv 2606.26027).

Collapse in multi-turn tool RL is a probability spike on the tokens that drive the
pipeline -- `<tool_call>`, `<|im_end|>` -- at positions where the grammar forbids
them, or their disappearance where it requires them. This module measures both as
pure functions of next-token log-probs.

Every trained position of an assistant turn sits in one grammar **slot**, read off the
oracle tokens it predicts:

    call_open     the turn's first token when a call is due (target <tool_call>)
    call_body     inside the call, before its last JSON token
    call_close    right after the call's JSON (target </tool_call>)
    answer_start  the first token of the final answer ("where the answer belongs")
    answer_body   inside the answer text
    answer_end    right after the answer (target <|im_end|>)
    call_turn_end right after </tool_call> (target <|im_end|>), a trained position only
                  with `rollout.call_end: sampled` (else that <|im_end|> is a template token)

For each control token c and slot s the probe reports the mean probability
`probe/<c>/p@<s>`; from these, `miss_required` is 1 - p(c) where c is the target
(`<tool_call>` at call_open, `</tool_call>` at call_close, `<|im_end|>` at answer_end),
`probe/im_end/miss_after_call` is 1 - p(`<|im_end|>`) at call_turn_end,
and `p_forbidden_{mean,max,p99}` is c's probability over the slots where emitting it
makes the parser reject the turn (FORBIDDEN below). `<tool_call>` at answer_start is
not forbidden (a call instead of an answer is well-formed) but it is the paper's
spike, so it has its own series.

The **probe set** is a fixed batch of oracle conversations teacher-forced through the
policy: its inputs never change, so its statistics move only when the policy does.

The same forward also watches the skill (`content_stats`): every trained token of an
oracle turn carries a `Content` label -- the tool's name, an argument value copied from
the question or a tool result, any other argument value, the answer text -- and per
label the probe reports the ground truth's mean log-prob (`probe/content/<c>/logp`) and
how often it is the greedy choice (`.../acc`). A policy can keep every control token in
place while it forgets which entity to look up (docs/LOG.md, "the silent collapse").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from toolcollapse.chat import (
    CONTROL_TAGS,
    ENDOFTEXT,
    IM_END,
    IM_START,
    SHORT,
    TOOL_CALL,
    TOOL_CALL_END,
    TOOL_RESPONSE,
    TOOL_RESPONSE_END,
    PieceEncoder,
)
from toolcollapse.config import RunConfig
from toolcollapse.encoding import Example, collate, encode_tasks
from toolcollapse.model import PrefixCache, device_of, logits_after, logits_at, shared_prefix_len
from toolcollapse.monitor.content import NO_CONTENT, content_labels, content_stats


class Slot(enum.IntEnum):
    CALL_OPEN = 0
    CALL_BODY = 1
    CALL_CLOSE = 2
    ANSWER_START = 3
    ANSWER_BODY = 4
    ANSWER_END = 5
    CALL_TURN_END = 6


SLOT_NAMES = {s: s.name.lower() for s in Slot}
REQUIRED: dict[str, Slot] = {TOOL_CALL: Slot.CALL_OPEN, TOOL_CALL_END: Slot.CALL_CLOSE, IM_END: Slot.ANSWER_END}
REQUIRED_AFTER_CALL = IM_END  # ... and at CALL_TURN_END: `miss_after_call`
_ALL = frozenset(Slot)
# Slots where sampling the token makes the turn malformed (parser.py). <|im_end|> inside answer text only
# truncates the answer, and <tool_call> where the answer belongs is a well-formed (wrong) move: not forbidden.
FORBIDDEN: dict[str, frozenset[Slot]] = {
    TOOL_CALL: frozenset({Slot.CALL_BODY, Slot.CALL_CLOSE, Slot.ANSWER_BODY, Slot.ANSWER_END, Slot.CALL_TURN_END}),
    TOOL_CALL_END: _ALL - {Slot.CALL_CLOSE},
    IM_END: frozenset({Slot.CALL_OPEN, Slot.CALL_BODY, Slot.CALL_CLOSE, Slot.ANSWER_START}),
    IM_START: _ALL,
    TOOL_RESPONSE: _ALL,
    TOOL_RESPONSE_END: _ALL,
    ENDOFTEXT: _ALL,
}


def slots(ids: Sequence[int], mask: Sequence[int], tool_call_id: int, tool_call_end_id: int,
          im_end_id: int) -> list[Slot]:
    """The slot of every trained target token of one oracle conversation, in order.

    ids, mask: the conversation and its trainable mask (chat.PieceEncoder.encode). A
    call turn is `<tool_call> body </tool_call>`; an answer turn is `text <|im_end|>`.
    """
    out: list[Slot] = []
    in_call, turn_start, after_call = False, True, False
    for tok, m in zip(ids, mask):
        if not m:
            turn_start = True
            continue
        if tok == tool_call_id:
            out.append(Slot.CALL_OPEN)
            in_call = True
        elif tok == tool_call_end_id:
            out.append(Slot.CALL_CLOSE)
            in_call = False
        elif in_call:
            out.append(Slot.CALL_BODY)
        elif tok == im_end_id:
            out.append(Slot.CALL_TURN_END if after_call else Slot.ANSWER_END)
        else:
            out.append(Slot.ANSWER_START if turn_start else Slot.ANSWER_BODY)
        turn_start, after_call = False, tok == tool_call_end_id
    return out


def control_token_stats(logp: torch.Tensor, slot_of: torch.Tensor, token_ids: Mapping[str, int],
                        prefix: str = "probe") -> dict[str, float]:
    """Per-token statistics over positions. logp: [M, V] next-token log-probs (or any columns of them,
    `token_ids` naming each token's column); slot_of: [M] Slot values.

    A slot with no positions contributes no series (absent, not NaN).
    """
    out: dict[str, float] = {}
    for name, tid in token_ids.items():
        p = logp[:, tid].exp()  # [M]
        key = f"{prefix}/{SHORT.get(name, name)}"
        for slot in Slot:
            here = slot_of == slot
            if here.any():
                out[f"{key}/p@{SLOT_NAMES[slot]}"] = p[here].mean().item()
        if name in REQUIRED and (slot_of == REQUIRED[name]).any():
            out[f"{key}/miss_required"] = 1.0 - p[slot_of == REQUIRED[name]].mean().item()
        if name == REQUIRED_AFTER_CALL and (slot_of == Slot.CALL_TURN_END).any():
            out[f"{key}/miss_after_call"] = 1.0 - p[slot_of == Slot.CALL_TURN_END].mean().item()
        forbidden = torch.zeros_like(slot_of, dtype=torch.bool)
        for slot in FORBIDDEN.get(name, _ALL):
            forbidden |= slot_of == slot
        if forbidden.any():
            pf = p[forbidden]
            out[f"{key}/p_forbidden_mean"] = pf.mean().item()
            out[f"{key}/p_forbidden_max"] = pf.max().item()
            out[f"{key}/p_forbidden_p99"] = torch.quantile(pf, 0.99).item()
    return out


def resolve_token_ids(tokenizer: Any, names: Sequence[str]) -> dict[str, int]:
    """Ids of control tokens by their text; an unknown one is an error naming it."""
    vocab = tokenizer.get_vocab()  # membership, not `!= unk_token_id`: SmolLM2's unk is <|endoftext|> itself
    ids = {n: vocab.get(n) for n in names}
    missing = [n for n, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"control tokens {missing} are not single tokens of this tokenizer")
    return ids


# ----------------------------------------------------------------------------- the probe set


PROBE_CHUNK = 8  # rows a forward: with rows sorted by length, 8 pad far less than the whole set (and run faster)


@dataclass
class ProbeSet:
    """Fixed oracle conversations, teacher-forced through the policy every few steps."""

    input_ids: torch.Tensor  # [B, T] right-padded
    select: torch.Tensor  # [B, T] bool: positions whose next token is a trained target
    slot_of: torch.Tensor  # [M] Slot of each selected position, row-major
    prefix_len: int  # shared prefix (the system prompt), run once a probe for all chunks; no target inside
    targets: torch.Tensor  # [M] the oracle's next token there
    content_of: torch.Tensor  # [M] Content of that token (NO_CONTENT for structure)


def build_probe(examples: Sequence[Example], pad_id: int, token_ids: Mapping[str, int],
                content: Sequence[Sequence[int]] | None = None) -> ProbeSet:
    """The probe set, its rows sorted by length (`run_probe` runs them in chunks of similar length).
    `content`: each example's `content_labels` (None: no content statistics)."""
    if content is None:
        content = [[NO_CONTENT] * sum(m[1:]) for _, m in examples]
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    examples, content = [examples[i] for i in order], [content[i] for i in order]
    ids, select = collate(examples, pad_id)
    slot_of = [s for x, m in examples
               for s in slots(x, m, token_ids[TOOL_CALL], token_ids[TOOL_CALL_END], token_ids[IM_END])]
    targets = ids[:, 1:][select[:, :-1]]
    content_of = torch.tensor([c for labels in content for c in labels], dtype=torch.long)
    if content_of.shape != targets.shape:
        raise ValueError(f"content labels for {len(content_of)} trained tokens, the probe set has {len(targets)}")
    first_target = int(select.any(dim=0).nonzero().min())  # the prefix run alone predicts nothing
    prefix_len = min(shared_prefix_len([x for x, _ in examples]), first_target)
    return ProbeSet(ids, select, torch.tensor(slot_of, dtype=torch.long), prefix_len, targets, content_of)


@torch.no_grad()
def run_probe(model: Any, probe: ProbeSet, token_ids: Mapping[str, int], temperature: float = 1.0,
              prefixes: PrefixCache | None = None) -> dict[str, float]:
    """Control-token and content statistics of the probe set under the sampling distribution (logits / temperature).
    `prefixes`: where the probe's shared prefix may already have been run under these weights (`rl`: the step's rollout).

    Per chunk only what the statistics read leaves the [rows, V] logits: the control tokens' and the
    targets' log-probs (logit - logsumexp) and whether the target is the argmax. A full log_softmax of
    the ~3,000 x V logits, materialized and concatenated, was 15 % of the probe (docs/BENCHMARKS.md)."""
    was_training = model.training
    model.eval()
    device = device_of(model)
    control = torch.tensor(list(token_ids.values()), dtype=torch.long, device=device)
    cols, truth, greedy = [], [], []
    p, done = probe.prefix_len, 0
    prefixes = prefixes if prefixes is not None else PrefixCache(model)
    prefix = prefixes(probe.input_ids[0, :p].tolist()) if p else None  # once for every chunk
    for start in range(0, len(probe.input_ids), PROBE_CHUNK):  # rows sorted by length: little padding a chunk
        select = probe.select[start:start + PROBE_CHUNK]
        width = int(select.any(dim=0).nonzero().max()) + 1
        ids, select = probe.input_ids[start:start + PROBE_CHUNK, p:width].to(device), select[:, p:width].to(device)
        logits = logits_after(model, prefix, ids, select) if p else logits_at(model, ids, select)  # [m, V]
        if temperature != 1.0:
            logits = logits / temperature
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        targets = probe.targets[done:done + len(logits), None].to(device)
        cols.append((logits[:, control] - lse).cpu())
        truth.append((logits.gather(1, targets) - lse).squeeze(1).cpu())
        greedy.append((logits.argmax(dim=-1, keepdim=True) == targets).squeeze(1).cpu())
        done += len(logits)
    model.train(was_training)
    column_of = {name: k for k, name in enumerate(token_ids)}  # the control tokens' columns in `cols`
    return {**control_token_stats(torch.cat(cols), probe.slot_of, column_of),
            **content_stats(torch.cat(truth), torch.cat(greedy), probe.content_of)}


def probe_for(cfg: RunConfig, env: Any, tokenizer: Any) -> tuple[ProbeSet | None, dict[str, int]]:
    """The run's probe set (the first `monitor.probe_size` training tasks' oracle conversations, with their
    content labels; None when the probe is off) and the ids of the control tokens it reports."""
    m = cfg.monitor
    token_ids = resolve_token_ids(tokenizer, m.control_tokens)
    if m.probe_every <= 0 or m.probe_size <= 0:
        return None, token_ids
    tasks = env.tasks(cfg.grpo.split)[:m.probe_size]
    encoder = PieceEncoder(tokenizer, cfg.rollout.call_end)
    examples = encode_tasks(encoder, tasks)
    content = [content_labels(encoder, [*t.prompt, *t.reference]) for t in tasks]
    return build_probe(examples, tokenizer.pad_token_id, resolve_token_ids(tokenizer, CONTROL_TAGS), content), token_ids
