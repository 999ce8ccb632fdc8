"""The tool world as a TRL environment (`environment_factory`), and our chat format in TRL's tool loop."""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from typing import Any

from datasets import Dataset
from trl.chat_template_utils import _SUPPORTS_RESPONSE_TEMPLATE, qwen3_schema, qwen3_template

from toolcollapse.chat import CHAT_TEMPLATE, IM_END, stop_tags
from toolcollapse.config import RunConfig
from toolcollapse.envs import make_env
from toolcollapse.envs.toolworld import answer_matches
from toolcollapse.records import ToolCall


def speak_toolcollapse_chat(tokenizer: Any, model: Any, call_end: str = "template",
                            use_vllm: bool = False) -> int | None:
    """Let TRL's tool loop run a model trained by toolcollapse, in its own chat format (`chat.CHAT_TEMPLATE`:
    ChatML with Qwen's `<tool_call>` JSON; the tools are documented in the prompt's system message, see
    `tool_world_dataset(system_prompt=True)`). TRL parses calls only for chat templates it knows: this sets
    Qwen's response parser on the tokenizer (the same call syntax), and with `call_end` template adds
    `</tool_call>` to the model's generation config's end tokens (kept in checkpoints saved from it), as in
    our rollouts. Returns the <|im_end|> id the tool reply must then start with (TRL's suffix begins after
    it), else None. Any other chat template is left to TRL. `MonitoredGRPOTrainer` calls this itself.

    For well-formed turns TRL's loop then shows the model exactly the tokens our rollouts show it (greedy,
    the same episodes). Malformed turns are TRL's own: a call it cannot parse ends the rollout (ours answers
    it with an error and goes on), an unknown tool gets TRL's error text, arguments are typed by the tool's
    schema before the call (transformers >= 5.15), and no turn has a token cap of its own -- for our exact
    rollouts inside TRL, `engine_rollouts`. vLLM generation takes its end tokens elsewhere: refused."""
    if getattr(tokenizer, "chat_template", None) != CHAT_TEMPLATE:
        return None
    if call_end not in ("template", "sampled"):
        raise ValueError(f"call_end {call_end!r}: template or sampled (the checkpoint's rollout.call_end)")
    if use_vllm:
        raise ValueError("a toolcollapse chat model in TRL's tool loop with vLLM generation: not supported yet (vLLM "
                         "would not stop at </tool_call>); generate with transformers, or use engine_rollouts")
    if getattr(model, "generation_config", None) is None:  # a path; a PreTrainedModel or a PeftModel has one
        raise ValueError("a toolcollapse chat model in TRL's tool loop: pass the model object "
                         "(toolcollapse.model.load_model(path)), not a path, so its stop tokens can be set")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        if _SUPPORTS_RESPONSE_TEMPLATE:  # transformers >= 5.13; before, only the legacy schema is read
            tokenizer.response_template = dict(qwen3_template)
        else:
            tokenizer.response_schema = dict(qwen3_schema)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in stop_tags(call_end)]
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    model.generation_config.eos_token_id = eos + [i for i in stops if i not in eos]  # TRL cuts completions there
    return tokenizer.convert_tokens_to_ids(IM_END) if call_end == "template" else None


_JSON_TYPES = {"string": str, "number": float, "integer": int, "boolean": bool, "array": list, "object": dict}


def _tool_method(spec: Any) -> Any:
    """A method `name(self, **arguments) -> str` whose signature, type hints and Google-style docstring say what
    `spec.parameters` (JSON schema) says, so `transformers.utils.get_json_schema` renders the same tool."""
    props, required = spec.parameters.get("properties", {}), set(spec.parameters.get("required", ()))

    def method(self: Any, **arguments: Any) -> str:
        return self._call(spec.name, arguments)

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {"return": str}
    lines = []
    for name, schema in props.items():
        kind = _JSON_TYPES.get(schema.get("type", "string"), str)
        optional = name not in required
        annotations[name] = kind | None if optional else kind
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotations[name],
                                        default=None if optional else inspect.Parameter.empty))
        doc = schema.get("description") or name.replace("_", " ")
        lines.append(f"    {name}: {doc}" + (f" (choices: {json.dumps(schema['enum'])})" if "enum" in schema else ""))
    method.__name__ = method.__qualname__ = spec.name
    method.__signature__ = inspect.Signature(params, return_annotation=str)
    method.__annotations__ = annotations
    method.__doc__ = (f"{spec.description}\n\n" + ("Args:\n" + "\n".join(lines) + "\n\n" if lines else "")
                      + "Returns:\n    The tool's result, as JSON.")
    return method


def _task_lookup(env: Any, cfg: RunConfig) -> Any:
    """task_id -> the environment's Task (each split loaded when first needed: the tool world's ids name
    theirs, <split>-<index>; otherwise the splits are searched in order)."""
    tasks: dict[str, Any] = {}

    def task(task_id: str) -> Any:
        guess = task_id.rsplit("-", 1)[0]
        searched = [s for s in env.splits if s not in getattr(env, "carved", ())]  # val, rl: train tasks
        for split in ([guess] if guess in searched else []) + [s for s in searched if s != guess]:
            if task_id in tasks:
                break
            tasks.update({t.id: t for t in env.tasks(split)})
        if task_id not in tasks:
            raise KeyError(f"task {task_id!r} is not a task of this {env.name} environment (see the run config)")
        return tasks[task_id]

    return task


def tool_world_environment(cfg: RunConfig) -> Any:
    """A factory of environments for TRL's `environment_factory`, on the tool world of `cfg` (its world and
    tools sections): `reset(task_id=...)` starts a task of the dataset row (`tool_world_dataset`), one method
    per tool runs a call in the world's sandbox, with the task's facts (`ood_facts`: the counterfactual
    world). Every instance shares one world (its tool process, its tasks)."""
    world = make_env(cfg)
    if getattr(world, "name", "") != "toolworld":
        raise ValueError(f"tool_world_environment needs env: toolworld, not {cfg.env!r}")
    task = _task_lookup(world, cfg)

    def reset(self: Any, task_id: str, **row: Any) -> None:
        self.task, self.calls = task(task_id), []
        return None  # the question is the dataset row's prompt

    def _call(self: Any, name: str, arguments: dict[str, Any]) -> str:  # private: TRL offers public methods as tools
        arguments = {k: v for k, v in arguments.items() if v is not None}  # optional arguments not given
        self.calls.append((name, arguments))
        return world.run_call(ToolCall(name, arguments), self.task.meta.get("facts", "real"))

    methods = {spec.name: _tool_method(spec) for spec in world.tool_table.values()}
    cls = type("ToolWorldEnvironment", (), {"reset": reset, "_call": _call, "world": world, "task": None, **methods,
                                           "__doc__": "The tool world, one task at a time (toolcollapse)."})
    return cls




def task_rows(tasks: Sequence[Any], system_prompt: bool = True) -> Any:
    """Our Tasks as TRL rows: `prompt` (the task's messages: its system prompt documenting the tools and the
    first user turn; without `system_prompt`, the user turn alone, for a chat template that renders the
    tools itself), `task_id` (what `engine_rollouts` and the environment's `reset` look up) and `answer`."""
    return Dataset.from_list([{"prompt": [{"role": m.role, "content": m.content}
                                          for m in (t.prompt if system_prompt else t.prompt[-1:])],
                               "task_id": t.id, "answer": t.answer} for t in tasks])


def task_dataset(cfg: RunConfig, split: str = "train", n: int | None = None) -> Any:
    """The split's tasks of any of our environments (the tool world, BFCL multi-turn) as TRL rows for
    `engine_rollouts` (`task_rows`)."""
    return task_rows(make_env(cfg).tasks(split, n))




def tool_world_dataset(cfg: RunConfig, split: str = "train", n: int | None = None,
                       system_prompt: bool = False) -> Any:
    """The split's tasks as TRL rows for the environment (`task_rows`): the question alone, TRL's chat
    template rendering the tools; with `system_prompt`, after the task's own system message, which
    documents them as our rollouts do (a model in toolcollapse's chat format, whose template does not
    render `tools`)."""
    return task_rows(make_env(cfg).tasks(split, n), system_prompt)


def tool_world_reward(completions: list[Any], environments: list[Any] | None = None, **_: Any) -> list[float]:
    """1 when the completion's last assistant message states the task's answer (`answer_matches`), else 0."""
    if environments is None:
        raise ValueError("tool_world_reward needs the environments: train with environment_factory")
    out = []
    for completion, env in zip(completions, environments):
        messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        last = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        out.append(float(env.task is not None and answer_matches(last, env.task.answer)))
    return out
