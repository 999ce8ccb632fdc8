"""Chat models that write text for the supervision signals: PRS's judge, HBG's hint writer.

    chat = chat_model(spec)                  # spec: config.ChatModelConfig (kind hf or openai)
    reply = chat([{"role": "user", "content": "..."}])   # -> Reply(text, tokens_in, tokens_out, cached)

Two backends, as users of this field run judges:
  hf      a local Hugging Face causal LM (`source`: a directory, or a packaged model such as `smollm2-135m`),
          generating with its own chat template, greedy at temperature 0;
  openai  any OpenAI-compatible chat-completions server (vLLM, SGLang, llama.cpp's server, Ollama, OpenAI)
          through the official client: `base_url`, `model`, the key read from the environment variable
          `api_key_env` (never written to a config, log or checkpoint), `timeout_s` a call, `retries` with
          exponential backoff on 429, 5xx, timeouts and refused connections.
Every reply is cached on disk under `cache_dir` (default <toolcollapse cache>/chat), keyed by the model's
identity, the messages and the sampling parameters, so a resumed run or a second seed never pays twice.
`ChatStats` counts calls, cache hits, failures, tokens and seconds."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from toolcollapse.config import ChatModelConfig, ConfigError
from toolcollapse.model import load_model, load_tokenizer
from toolcollapse.sources import cache_root, resolve_source

Messages = list[dict[str, str]]


class ChatModelError(RuntimeError):
    """A call that failed after its retries (unreachable server, HTTP error, a reply without text)."""


@dataclass(frozen=True)
class Reply:
    text: str
    tokens_in: int
    tokens_out: int
    cached: bool = False


@dataclass
class ChatStats:
    calls: int = 0  # calls that reached the model (cache misses), failed ones included
    cache_hits: int = 0
    failures: int = 0  # calls that failed after their retries
    tokens_in: int = 0
    tokens_out: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, reply: Reply | None, seconds: float) -> None:
        with self._lock:
            if reply is not None and reply.cached:
                self.cache_hits += 1
                return
            self.calls += 1
            self.seconds += seconds
            if reply is None:
                self.failures += 1
            else:
                self.tokens_in += reply.tokens_in
                self.tokens_out += reply.tokens_out

    def as_dict(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/{k}": getattr(self, k) for k in ("calls", "cache_hits", "failures", "tokens_in",
                                                             "tokens_out", "seconds")}


class ReplyCache:
    """One JSON file per reply, written atomically: the key is a sha256 of (model identity, messages,
    sampling parameters)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def key(self, identity: dict[str, Any], messages: Messages) -> str:
        blob = json.dumps({"model": identity, "messages": messages}, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()

    def get(self, key: str) -> Reply | None:
        path = self.root / key[:2] / f"{key}.json"
        try:
            row = json.loads(path.read_text())
            return Reply(row["text"], row["tokens_in"], row["tokens_out"], cached=True)
        except (OSError, ValueError, KeyError, TypeError):  # absent, or torn by a crash: asked again
            return None

    def put(self, key: str, reply: Reply) -> None:
        path = self.root / key[:2] / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.partial")
        tmp.write_text(json.dumps({"text": reply.text, "tokens_in": reply.tokens_in, "tokens_out": reply.tokens_out}))
        os.replace(tmp, path)


class ChatModel:
    """Messages -> Reply, through the cache; `ask` is the backend's one uncached call."""

    def __init__(self, spec: ChatModelConfig, identity: dict[str, Any], ask: Callable[[Messages], Reply]):
        self.spec, self.identity, self.ask = spec, identity, ask
        self.cache = ReplyCache(Path(spec.cache_dir) if spec.cache_dir else cache_root() / "chat")
        self.stats = ChatStats()

    def __call__(self, messages: Messages) -> Reply:
        key = self.cache.key(self.identity, messages)
        hit = self.cache.get(key)
        if hit is not None:
            self.stats.add(hit, 0.0)
            return hit
        start = time.perf_counter()
        try:
            reply = self.ask(messages)
        except ChatModelError:
            self.stats.add(None, time.perf_counter() - start)
            raise
        self.stats.add(reply, time.perf_counter() - start)
        self.cache.put(key, reply)
        return reply

    def check(self) -> None:
        """One call that must succeed (uncached): a run stops here, before any work, on a wrong base_url, model
        name or key, or a model that does not load."""
        try:
            self.ask([{"role": "user", "content": "Reply with the word ready."}])
        except ChatModelError as err:
            raise ConfigError(f"the {self.spec.kind} chat model {self.describe()} does not answer: {err}") from None

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.identity.items() if k not in ("temperature", "max_new_tokens"))


def answering_chat_model(spec: ChatModelConfig) -> ChatModel:
    """`chat_model(spec)`, asked once before any work (ConfigError when it does not answer)."""
    chat = chat_model(spec)
    chat.check()
    return chat


def from_factory(spec: ChatModelConfig, key: str) -> Any:
    """What `spec.factory` ("package.module:callable", zero arguments) returns; `key` names the config field."""
    module, _, name = spec.factory.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{key}: cannot load {spec.factory!r} ({type(err).__name__}: {err})") from None
    return factory()


def chat_model(spec: ChatModelConfig) -> ChatModel:
    sampling = {"temperature": spec.temperature, "max_new_tokens": spec.max_new_tokens}
    if spec.kind == "openai":
        return ChatModel(spec, {"kind": "openai", "base_url": spec.base_url, "model": spec.model, **sampling},
                         _openai_ask(spec))
    if spec.kind == "hf":
        return ChatModel(spec, {"kind": "hf", "source": spec.source, **sampling}, _hf_ask(spec))
    raise ValueError(f"chat_model: kind {spec.kind!r} is not a chat model (hf or openai)")


def _openai_ask(spec: ChatModelConfig) -> Callable[[Messages], Reply]:
    try:
        import openai
    except ImportError:
        raise ConfigError("kind: openai needs the OpenAI client: pip install 'toolcollapse[judge]' "
                          "(or pip install openai)") from None
    key = "none"  # local servers (vLLM, llama.cpp, Ollama) take any key
    if spec.api_key_env:
        key = os.environ.get(spec.api_key_env, "")
        if not key:
            raise ConfigError(f"api_key_env: the environment variable {spec.api_key_env} is not set")
    client = openai.OpenAI(base_url=spec.base_url, api_key=key, timeout=spec.timeout_s, max_retries=spec.retries)

    def ask(messages: Messages) -> Reply:
        try:
            out = client.chat.completions.create(model=spec.model, messages=messages, temperature=spec.temperature,
                                                 max_tokens=spec.max_new_tokens)
        except openai.APIStatusError as err:
            raise ChatModelError(f"HTTP {err.status_code} from {spec.base_url}: {str(err)[:300]}") from None
        except openai.APIError as err:  # timeouts, refused connections, replies the client cannot read
            raise ChatModelError(f"{type(err).__name__} from {spec.base_url}: {str(err)[:300]}") from None
        except ValueError as err:  # a 200 whose body is not JSON
            raise ChatModelError(f"a reply that is not JSON from {spec.base_url}: {err}") from None
        choices = getattr(out, "choices", None) or []
        text = choices[0].message.content if choices and choices[0].message else None
        if not isinstance(text, str):
            raise ChatModelError(f"a reply from {spec.base_url} without message text: {str(out)[:300]}")
        usage = getattr(out, "usage", None)
        return Reply(text, int(getattr(usage, "prompt_tokens", 0) or 0), int(getattr(usage, "completion_tokens", 0) or 0))

    return ask


def _hf_ask(spec: ChatModelConfig) -> Callable[[Messages], Reply]:
    path = resolve_source(spec.source)
    tokenizer, model = load_tokenizer(path), load_model(path).eval()
    if tokenizer.chat_template is None:
        raise ConfigError(f"source {spec.source}: its tokenizer has no chat template to write the judge's prompt")
    lock = threading.Lock()  # one generation at a time on this process's model

    def ask(messages: Messages) -> Reply:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        sample = spec.temperature > 0
        with lock, torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec.max_new_tokens,
                                 do_sample=sample, temperature=spec.temperature if sample else None, top_p=None,
                                 top_k=None, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        new = out[0, ids.shape[1]:]
        return Reply(tokenizer.decode(new, skip_special_tokens=True), int(ids.shape[1]), int(new.shape[0]))

    return ask
