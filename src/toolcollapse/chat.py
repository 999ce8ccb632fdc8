"""ChatML as Qwen2.5 uses it, at the level of tokens.

    <|im_start|>system\n{system}<|im_end|>\n
    <|im_start|>user\n{question}<|im_end|>\n
    <|im_start|>assistant\n<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n
    <|im_start|>assistant\nThe answer is 42.<|im_end|>\n

A conversation is a list of `Piece`s: control tags (one special token each) and text
runs between them. Text runs are encoded one by one, never merged across a tag or
across the policy/template boundary, so the tokens SFT trains on are exactly the
tokens the rollout engine produces by appending a turn's pieces to the history
(token-in/token-out: the history is never decoded and re-encoded).

What the policy generates in an assistant turn (`trainable=True`): everything after
`<|im_start|>assistant\\n` up to and including the stop token, `</tool_call>` for a
call and `<|im_end|>` for an answer. The `<|im_end|>` that closes a call turn is, by
`call_end`:
  template  appended by the pipeline after a sampled `</tool_call>`, as a template token
            (never trained: its probability is whatever the model makes of it);
  sampled   written by the policy, as Qwen2.5 and the paper's verl pipeline have it: the
            turn stops on `<|im_end|>` only, and that token is trained.
The rendered text is the same either way; what is trained and where a turn stops differ.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from toolcollapse.records import CallEnd, Message

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
ENDOFTEXT = "<|endoftext|>"
CONTROL_TAGS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END, TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END)
# each tag's name in metric keys (`probe/<short>/...`, `ctrl/<short>/...`)
SHORT = {TOOL_CALL: "tool_call", TOOL_CALL_END: "tool_call_end", IM_END: "im_end", IM_START: "im_start",
         TOOL_RESPONSE: "tool_response", TOOL_RESPONSE_END: "tool_response_end", ENDOFTEXT: "endoftext"}
STOP_TAGS: tuple[str, ...] = (TOOL_CALL_END, IM_END, ENDOFTEXT)  # a sampled one ends the assistant turn


def stop_tags(call_end: CallEnd = "template") -> tuple[str, ...]:
    """The tokens that end an assistant turn: with call_end `sampled`, </tool_call> does not."""
    return (IM_END, ENDOFTEXT) if call_end == "sampled" else STOP_TAGS

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message.content -%}{{- message.content -}}{%- endif -%}"
    "{%- if message.tool_calls -%}"
    "{%- for tool_call in message.tool_calls -%}"
    "{%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set fn = tool_call.function if tool_call.function is defined else tool_call -%}"
    "{{- '<tool_call>\\n' -}}"
    "{{- {'name': fn.name, 'arguments': fn.arguments} | tojson -}}"
    "{{- '\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` with each unpaired surrogate replaced by U+FFFD. A model writes one as a JSON escape
    (`"\\ud800"`); a tool can echo it; a tokenizer cannot encode it (no UTF-8 form)."""
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


@dataclass(frozen=True)
class Piece:
    text: str
    special: bool = False  # a control tag: exactly one token
    trainable: bool = False  # sampled by the policy in a rollout; SFT puts its loss here
    literal: bool = False  # tool output: a tag written in it stays text (no control-token injection)


def tag(name: str, trainable: bool = False) -> Piece:
    return Piece(name, special=True, trainable=trainable)


def message_pieces(message: Message, call_end: CallEnd = "template") -> list[Piece]:
    """One message as it sits in the history, trainable parts marked."""
    if message.role == "tool":
        return [tag(IM_START), Piece("user\n"), tag(TOOL_RESPONSE), Piece("\n" + message.content + "\n", literal=True),
                tag(TOOL_RESPONSE_END), tag(IM_END), Piece("\n")]
    if message.role == "assistant":
        return (generation_prompt() + assistant_body(message, call_end)
                + turn_suffix(message.tool_call is not None, call_end))
    return [tag(IM_START), Piece(f"{message.role}\n{message.content}"), tag(IM_END), Piece("\n")]


def assistant_body(message: Message, call_end: CallEnd = "template") -> list[Piece]:
    """What the policy generates in an assistant turn, stop token included."""
    if message.tool_call is None:
        return [Piece(message.content, trainable=True), tag(IM_END, trainable=True)]
    prefix = [Piece(message.content + "\n", trainable=True)] if message.content else []
    end = [tag(IM_END, True)] if call_end == "sampled" else []
    return prefix + [tag(TOOL_CALL, True), Piece("\n" + message.tool_call.to_json() + "\n", trainable=True),
                     tag(TOOL_CALL_END, True)] + end


def turn_suffix(closed_on_call: bool, call_end: CallEnd = "template") -> list[Piece]:
    """Template tokens after the stop token: a call turn still needs its <|im_end|>, unless the
    policy wrote it (call_end `sampled`)."""
    return [tag(IM_END), Piece("\n")] if closed_on_call and call_end != "sampled" else [Piece("\n")]


def generation_prompt() -> list[Piece]:
    return [tag(IM_START), Piece("assistant\n")]


def conversation_pieces(messages: Iterable[Message], add_generation_prompt: bool = False,
                        call_end: CallEnd = "template") -> list[Piece]:
    pieces = [p for m in messages for p in message_pieces(m, call_end)]
    return pieces + generation_prompt() if add_generation_prompt else pieces


def render_text(messages: Iterable[Message], add_generation_prompt: bool = False) -> str:
    """The same string `tokenizer.apply_chat_template(..., tokenize=False)` renders."""
    return "".join(p.text for p in conversation_pieces(messages, add_generation_prompt))


class PieceEncoder:
    """Encodes pieces to ids with a cache: system prompts repeat across thousands of tasks.

    Text is encoded as `apply_chat_template` + tokenize would (a tag written in a
    system prompt becomes its control token, as in Qwen2.5's tool prompt), except
    `literal` pieces -- tool output -- where special-token matching is off, so a tool
    result containing "<|im_end|>" stays text and cannot inject a control token. An
    unpaired surrogate (no character, no UTF-8 form) is encoded as U+FFFD (`valid_text`). `call_end`: who
    writes a call turn's <|im_end|> (the module's docstring), for every conversation it encodes.
    """

    def __init__(self, tokenizer: Any, call_end: CallEnd = "template"):
        if call_end not in ("template", "sampled"):
            raise ValueError(f"call_end {call_end!r}: template or sampled")
        self.tokenizer = tokenizer
        self.call_end = call_end
        vocab = tokenizer.get_vocab()  # not `== unk_token_id`: SmolLM2's unk token is <|endoftext|> itself
        missing = [t for t in CONTROL_TAGS if t not in vocab]
        self.special_ids = {t: vocab.get(t) for t in CONTROL_TAGS}
        if missing:
            raise ValueError(f"tokenizer lacks control tokens {missing}: load pretrained models through "
                             "model.source (toolcollapse.tags.add_control_tokens adds them)")
        self._cache: dict[bool, dict[str, list[int]]] = {False: {}, True: {}}
        self.max_cached_chars = 8192
        self.max_cache_entries = 200_000

    def encode_texts(self, texts: Sequence[str], literal: bool = False) -> list[list[int]]:
        cache = self._cache[literal]
        todo = list(dict.fromkeys(t for t in texts if t not in cache))
        fresh: dict[str, list[int]] = {}
        if todo:
            batch = self.tokenizer([valid_text(t) for t in todo], add_special_tokens=False,
                                   split_special_tokens=literal)["input_ids"]
            fresh = dict(zip(todo, batch))
            if len(cache) > self.max_cache_entries:
                cache.clear()
            cache.update((t, ids) for t, ids in fresh.items() if len(t) <= self.max_cached_chars)
        return [fresh[t] if t in fresh else cache[t] for t in texts]

    def encode(self, pieces: Sequence[Piece]) -> tuple[list[int], list[int]]:
        """(ids, trainable mask) for a list of pieces."""
        encoded = {
            literal: iter(self.encode_texts([p.text for p in pieces if not p.special and p.literal == literal],
                                            literal))
            for literal in (False, True)
        }
        ids: list[int] = []
        mask: list[int] = []
        for p in pieces:
            piece_ids = [self.special_ids[p.text]] if p.special else next(encoded[p.literal])
            ids += piece_ids
            mask += [int(p.trainable)] * len(piece_ids)
        return ids, mask

    def encode_conversation(self, messages: Sequence[Message]) -> tuple[list[int], list[int]]:
        return self.encode(conversation_pieces(messages, call_end=self.call_end))
