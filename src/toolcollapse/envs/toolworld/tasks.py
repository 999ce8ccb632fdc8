"""Task templates, the oracle solver, and the four splits of the tool world.

A task is a small program of 2-6 tool calls whose later arguments are earlier
results (`Ref`), so a model must read each tool response to make the next call.
The oracle runs the program through the real tools and writes the ground-truth
conversation; the last result is the answer ("The answer is <value>.").

Splits (all deterministic in the world seed):
  train        main entity pool, TRAIN_TEMPLATES (2-5 calls), Qwen tool prompt
  test         same distribution, programs disjoint from train
  ood_content  unseen entities (the `ood` pool); half the tasks use OOD_TEMPLATES:
               unseen compositions and longer chains (3-6 calls)
  ood_format   test's distribution under other system prompts and shuffled tools
The content shift one axis at a time (ood_content mixes them; the model copies names it never
saw poorly, so that mix can sit at 0 % and hide what a method costs on the other axes):
  ood_entities      unseen entities alone: the `ood` pool, TRAIN_TEMPLATES
  ood_facts         unseen facts alone: the main pool's entities in the counterfactual world
                    (`kb.counterfactual`: every attribute drawn again; the tools answer from
                    it), TRAIN_TEMPLATES, programs disjoint from train. What the model read in
                    training is wrong here: an answer recalled instead of read fails
  ood_compositions  unseen compositions alone: the main pool, OOD_TEMPLATES of at most 5 calls
  ood_chains        longer chains alone: the main pool, OOD_TEMPLATES of 6 calls
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable

from toolcollapse.envs.toolworld.functions import CONVERSIONS, UNIT_WORDS, WorldTools
from toolcollapse.envs.toolworld.kb import SCHEMA, Attr, Entity, KnowledgeBase, Value
from toolcollapse.envs.toolworld.prompts import ANSWER_PREFIX, OOD_STYLES, system_prompt
from toolcollapse.records import Message, Task, ToolCall


@dataclass(frozen=True)
class Ref:
    step: int  # index of the earlier step whose result goes here


@dataclass(frozen=True)
class Step:
    tool: str
    args: dict[str, Any]  # values may be Ref, or lists holding Refs


@dataclass(frozen=True)
class Plan:
    question: str
    steps: tuple[Step, ...]
    key: tuple  # identity of the program, wording excluded: test and train never share one


class _Draw:
    """Random choices over one entity pool."""

    def __init__(self, kb: KnowledgeBase, pool: str, rng: random.Random, quote_entities: bool = True):
        self.kb, self.pool, self.rng, self.quote = kb, pool, rng, quote_entities

    def ref(self, entity: Entity) -> str:
        """How a question names an entity: quoted, as it must be passed to kb_lookup."""
        return f'"{entity.name}"' if self.quote else entity.name

    def entities(self, kind: str, n: int = 1) -> list[Entity]:
        return self.rng.sample(self.kb.pool(kind, self.pool), n)

    def attr(self, ok: Callable[[str, Attr], bool]) -> tuple[str, Attr]:
        return self.rng.choice([(k, a) for k, attrs in SCHEMA.items() for a in attrs if ok(k, a)])

    def relation_to(self, ok: Callable[[Attr], bool]) -> tuple[str, Attr, Attr]:
        """(kind, relation attr, attr of the related entity satisfying `ok`)."""
        options = [(k, r, t) for k, attrs in SCHEMA.items() for r in attrs if r.relation
                   for t in SCHEMA[r.type] if ok(t)]
        return self.rng.choice(options)

    def unit_target(self, unit: str) -> str:
        return self.rng.choice(sorted(b for (a, b) in CONVERSIONS if a == unit))

    def say(self, *phrasings: str, **fields: Any) -> str:
        return self.rng.choice(phrasings).format(**fields)


def _numeric(_k: str, a: Attr) -> bool:
    return a.numeric


def _convertible(_k: str, a: Attr) -> bool:
    return a.unit is not None


def _dated(_k: str, a: Attr) -> bool:
    return a.type == "date"


def _lookup(entity: str | Ref, attr: Attr) -> Step:
    return Step("kb_lookup", {"entity": entity, "attribute": attr.key})


def _convert(value: Ref, unit: str, to: str) -> Step:
    return Step("convert_units", {"value": value, "from_unit": unit, "to_unit": to})


def _calc(op: str, a: Ref, b: Ref) -> Step:
    return Step("calculator", {"operation": op, "a": a, "b": b})


# ---------------------------------------------------------------- templates (2-5 calls)


def lookup_convert(d: _Draw) -> Plan:
    kind, a = d.attr(_convertible)
    (e,), to = d.entities(kind), d.unit_target(a.unit)
    q = d.say("What is the {p} of {e} in {u}?", "Convert the {p} of {e} to {u}.", "How many {u} is the {p} of {e}?",
              p=a.phrase, e=d.ref(e), u=UNIT_WORDS[to])
    return Plan(q, (_lookup(e.name, a), _convert(Ref(0), a.unit, to)), ("lookup_convert", e.name, a.key, to))


def relation_lookup(d: _Draw) -> Plan:
    kind, r, t = d.relation_to(lambda t: not t.relation)
    (e,) = d.entities(kind)
    q = d.say("What is the {t} of the {r} of {e}?", "Tell me the {t} of the {r} of {e}.",
              "Find the {t} of {e}'s {r}.", t=t.phrase, r=r.phrase, e=d.ref(e))
    return Plan(q, (_lookup(e.name, r), _lookup(Ref(0), t)), ("relation_lookup", e.name, r.key, t.key))


def date_shift(d: _Draw) -> Plan:
    kind, a = d.attr(_dated)
    (e,), n, after = d.entities(kind), d.rng.randint(2, 3000), d.rng.random() < 0.5
    q = d.say("What date is {n} days {w} the {p} of {e}?", "Which date falls {n} days {w} the {p} of {e}?",
              n=n, w="after" if after else "before", p=a.phrase, e=d.ref(e))
    days = n if after else -n
    return Plan(q, (_lookup(e.name, a), Step("date_add", {"date": Ref(0), "days": days})),
                ("date_shift", e.name, a.key, days))


def _pair(d: _Draw, op: str) -> tuple[str, Attr, Entity, Entity, str]:
    kind, a = d.attr(_numeric)
    x, y = d.entities(kind, 2)
    if op == "subtract":
        q = d.say("What is the {p} of {x} minus the {p} of {y}?", "By how much does the {p} of {x} exceed that of {y}?",
                  "Subtract the {p} of {y} from the {p} of {x}.", p=a.phrase, x=d.ref(x), y=d.ref(y))
    else:
        q = d.say("What is the combined {p} of {x} and {y}?", "Add the {p} of {x} to the {p} of {y}.",
                  "What is the sum of the {p} of {x} and the {p} of {y}?", p=a.phrase, x=d.ref(x), y=d.ref(y))
    return kind, a, x, y, q


def difference(d: _Draw) -> Plan:
    _, a, x, y, q = _pair(d, "subtract")
    return Plan(q, (_lookup(x.name, a), _lookup(y.name, a), _calc("subtract", Ref(0), Ref(1))),
                ("difference", x.name, y.name, a.key))


def total(d: _Draw) -> Plan:
    _, a, x, y, q = _pair(d, "add")
    return Plan(q, (_lookup(x.name, a), _lookup(y.name, a), _calc("add", Ref(0), Ref(1))),
                ("total", x.name, y.name, a.key))


def date_gap(d: _Draw) -> Plan:
    (k1, a1), (k2, a2) = d.attr(_dated), d.attr(_dated)
    (x,), (y,) = d.entities(k1), d.entities(k2)
    while (x.name, a1.key) == (y.name, a2.key):
        (y,) = d.entities(k2)
    q = d.say("How many days passed from the {p} of {x} to the {s} of {y}?",
              "Count the days from the {p} of {x} to the {s} of {y}.", p=a1.phrase, x=d.ref(x), s=a2.phrase, y=d.ref(y))
    steps = (_lookup(x.name, a1), _lookup(y.name, a2),
             Step("date_diff", {"start_date": Ref(0), "end_date": Ref(1)}))
    return Plan(q, steps, ("date_gap", x.name, a1.key, y.name, a2.key))


def relation_convert(d: _Draw) -> Plan:
    kind, r, t = d.relation_to(lambda t: t.unit is not None)
    (e,), to = d.entities(kind), d.unit_target(t.unit)
    q = d.say("What is the {t} of the {r} of {e} in {u}?", "Convert the {t} of the {r} of {e} to {u}.",
              t=t.phrase, r=r.phrase, e=d.ref(e), u=UNIT_WORDS[to])
    return Plan(q, (_lookup(e.name, r), _lookup(Ref(0), t), _convert(Ref(1), t.unit, to)),
                ("relation_convert", e.name, r.key, t.key, to))


def _aggregate_over(d: _Draw, n: int, function: str, name: str) -> Plan:
    kind, a = d.attr(_numeric)
    es = d.entities(kind, n)
    names = ", ".join(d.ref(e) for e in es[:-1]) + " and " + d.ref(es[-1])
    word = {"max": "largest", "min": "smallest", "mean": "average", "sum": "total"}[function]
    q = d.say("What is the {w} {p} among {names}?", "Among {names}, what is the {w} {p}?",
              w=word, p=a.phrase, names=names)
    steps = tuple(_lookup(e.name, a) for e in es) + (
        Step("aggregate", {"values": [Ref(i) for i in range(n)], "function": function}),)
    return Plan(q, steps, (name, tuple(e.name for e in es), a.key, function))


def extreme_of_three(d: _Draw) -> Plan:
    return _aggregate_over(d, 3, d.rng.choice(["max", "min"]), "extreme_of_three")


def mean_of_four(d: _Draw) -> Plan:
    return _aggregate_over(d, 4, "mean", "mean_of_four")


def total_convert(d: _Draw) -> Plan:
    kind, a = d.attr(_convertible)
    x, y = d.entities(kind, 2)
    to = d.unit_target(a.unit)
    q = d.say("What is the combined {p} of {x} and {y} in {u}?", "Add the {p} of {x} and {y} and give it in {u}.",
              p=a.phrase, x=d.ref(x), y=d.ref(y), u=UNIT_WORDS[to])
    steps = (_lookup(x.name, a), _lookup(y.name, a), _calc("add", Ref(0), Ref(1)), _convert(Ref(2), a.unit, to))
    return Plan(q, steps, ("total_convert", x.name, y.name, a.key, to))


def relation_difference(d: _Draw) -> Plan:
    kind, r, t = d.relation_to(lambda t: t.numeric)
    x, y = d.entities(kind, 2)
    q = d.say("What is the {t} of the {r} of {x} minus the {t} of the {r} of {y}?",
              "By how much does the {t} of the {r} of {x} exceed that of the {r} of {y}?",
              t=t.phrase, r=r.phrase, x=d.ref(x), y=d.ref(y))
    steps = (_lookup(x.name, r), _lookup(Ref(0), t), _lookup(y.name, r), _lookup(Ref(2), t),
             _calc("subtract", Ref(1), Ref(3)))
    return Plan(q, steps, ("relation_difference", x.name, y.name, r.key, t.key))


# ------------------------------------------- held-out compositions and longer chains (3-6 calls)


def relation_date_shift(d: _Draw) -> Plan:
    kind, r, t = d.relation_to(lambda t: t.type == "date")
    (e,), n = d.entities(kind), d.rng.randint(2, 3000)
    q = d.say("What date is {n} days after the {t} of the {r} of {e}?", t=t.phrase, r=r.phrase, e=d.ref(e), n=n)
    steps = (_lookup(e.name, r), _lookup(Ref(0), t), Step("date_add", {"date": Ref(1), "days": n}))
    return Plan(q, steps, ("relation_date_shift", e.name, r.key, t.key, n))


def difference_convert(d: _Draw) -> Plan:
    kind, a = d.attr(_convertible)
    x, y = d.entities(kind, 2)
    to = d.unit_target(a.unit)
    q = d.say("What is the {p} of {x} minus the {p} of {y}, in {u}?", p=a.phrase, x=d.ref(x), y=d.ref(y),
              u=UNIT_WORDS[to])
    steps = (_lookup(x.name, a), _lookup(y.name, a), _calc("subtract", Ref(0), Ref(1)), _convert(Ref(2), a.unit, to))
    return Plan(q, steps, ("difference_convert", x.name, y.name, a.key, to))


def two_hop(d: _Draw) -> Plan:
    options = [(k, r1, r2, t) for k, attrs in SCHEMA.items() for r1 in attrs if r1.relation
               for r2 in SCHEMA[r1.type] if r2.relation for t in SCHEMA[r2.type] if not t.relation]
    kind, r1, r2, t = d.rng.choice(options)
    (e,) = d.entities(kind)
    q = d.say("What is the {t} of the {r2} of the {r1} of {e}?", t=t.phrase, r2=r2.phrase, r1=r1.phrase, e=d.ref(e))
    steps = (_lookup(e.name, r1), _lookup(Ref(0), r2), _lookup(Ref(1), t))
    return Plan(q, steps, ("two_hop", e.name, r1.key, r2.key, t.key))


def extreme_of_five(d: _Draw) -> Plan:
    return _aggregate_over(d, 5, d.rng.choice(["max", "min"]), "extreme_of_five")


def relation_total_convert(d: _Draw) -> Plan:
    kind, r, t = d.relation_to(lambda t: t.unit is not None)
    x, y = d.entities(kind, 2)
    to = d.unit_target(t.unit)
    q = d.say("What is the combined {t} of the {r} of {x} and the {r} of {y} in {u}?",
              t=t.phrase, r=r.phrase, x=d.ref(x), y=d.ref(y), u=UNIT_WORDS[to])
    steps = (_lookup(x.name, r), _lookup(Ref(0), t), _lookup(y.name, r), _lookup(Ref(2), t),
             _calc("add", Ref(1), Ref(3)), _convert(Ref(4), t.unit, to))
    return Plan(q, steps, ("relation_total_convert", x.name, y.name, r.key, t.key, to))


TRAIN_TEMPLATES: dict[str, Callable[[_Draw], Plan]] = {f.__name__: f for f in (
    lookup_convert, relation_lookup, date_shift, difference, total, date_gap, relation_convert,
    extreme_of_three, total_convert, relation_difference, mean_of_four)}
OOD_TEMPLATES: dict[str, Callable[[_Draw], Plan]] = {f.__name__: f for f in (
    relation_date_shift, difference_convert, two_hop, extreme_of_five, relation_total_convert)}


# ---------------------------------------------------------------- oracle


def format_value(value: Value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def solve(plan: Plan, tools: WorldTools) -> tuple[list[Message], Value]:
    """Run the plan through the real tools; the ground-truth conversation and the answer."""
    results: list[Value] = []
    messages: list[Message] = []

    def resolve(v: Any) -> Any:
        if isinstance(v, Ref):
            return results[v.step]
        if isinstance(v, list):
            return [resolve(x) for x in v]
        return v

    for step in plan.steps:
        call = ToolCall(step.tool, {k: resolve(v) for k, v in step.args.items()})
        value, observation = tools.execute(call)
        if value is None:
            raise RuntimeError(f"oracle step failed ({observation}) in plan {plan}")  # a generator bug
        results.append(value)
        messages += [Message("assistant", tool_call=call), Message("tool", observation)]
    messages.append(Message("assistant", f"{ANSWER_PREFIX} {format_value(results[-1])}."))
    return messages, results[-1]


# ---------------------------------------------------------------- splits


@dataclass(frozen=True)
class SplitRecipe:
    pool: str
    ood_template_share: float  # fraction of tasks drawn from OOD_TEMPLATES
    styles: tuple[str, ...]  # system prompt styles, one drawn per task
    shuffle_tools: bool
    ood_templates: tuple[str, ...] | None = None  # the OOD_TEMPLATES drawn from (None: all)
    facts: str = "real"  # the world the tools answer from: "real" or "counterfactual"


RECIPES: dict[str, SplitRecipe] = {
    "train": SplitRecipe("main", 0.0, ("qwen",), False),
    "test": SplitRecipe("main", 0.0, ("qwen",), False),
    "ood_content": SplitRecipe("ood", 0.5, ("qwen",), False),
    "ood_format": SplitRecipe("main", 0.0, OOD_STYLES, True),
    "ood_entities": SplitRecipe("ood", 0.0, ("qwen",), False),
    "ood_facts": SplitRecipe("main", 0.0, ("qwen",), False, facts="counterfactual"),
    "ood_compositions": SplitRecipe("main", 1.0, ("qwen",), False, ("relation_date_shift", "difference_convert",
                                                                    "two_hop")),
    "ood_chains": SplitRecipe("main", 1.0, ("qwen",), False, ("extreme_of_five", "relation_total_convert")),
}


def make_tasks(split: str, n: int, seed: int, kb: KnowledgeBase, tools: WorldTools,
               exclude: frozenset[tuple] = frozenset(), quote_entities: bool = True) -> list[Task]:
    recipe = RECIPES[split]
    rng = random.Random(f"tasks-{seed}-{split}")
    draw = _Draw(kb, recipe.pool, rng, quote_entities)
    prompts: dict[tuple, str] = {}
    tasks: list[Task] = []
    seen: set[tuple] = set()
    attempts = 0
    while len(tasks) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise RuntimeError(f"cannot draw {n} distinct {split} tasks; the world is too small")
        use_ood = rng.random() < recipe.ood_template_share
        templates = ({k: v for k, v in OOD_TEMPLATES.items() if k in (recipe.ood_templates or OOD_TEMPLATES)}
                     if use_ood else TRAIN_TEMPLATES)
        name, template = rng.choice(sorted(templates.items()))
        plan = template(draw)
        if plan.key in exclude or (split != "train" and plan.key in seen):
            continue
        seen.add(plan.key)
        style = rng.choice(recipe.styles)
        order = list(tools.tools)
        if recipe.shuffle_tools:
            rng.shuffle(order)
        sys_key = (style, tuple(t.name for t in order))
        if sys_key not in prompts:
            prompts[sys_key] = system_prompt(order, style)
        reference, answer = solve(plan, tools)
        tasks.append(Task(
            id=f"{split}-{len(tasks):05d}", split=split,
            prompt=(Message("system", prompts[sys_key]), Message("user", plan.question)),
            reference=tuple(reference), answer=format_value(answer),
            meta={"template": name, "n_calls": len(plan.steps), "pool": recipe.pool, "style": style,
                  "key": plan.key, "facts": recipe.facts},
        ))
    return tasks
