"""The tool world's functions: their JSON-schema docs and their implementations.

Six tools solve tasks (lookup, arithmetic, unit conversion, two date tools, list
aggregation); three more are documented distractors that no task needs. Every
failure -- unknown entity, bad unit, malformed date, a result too large to write or
not a finite number -- comes back as a JSON error observation; `execute` never raises.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from typing import Any, Callable

from toolcollapse.envs.toolworld.kb import KnowledgeBase, Value
from toolcollapse.records import ToolCall
from toolcollapse.tools import ToolSpec, validate_arguments

UNITS = ("m", "ft", "km", "mi", "km2", "mi2", "cm", "in", "kg", "lb")
_FACTORS = {("m", "ft"): 3.28084, ("km", "mi"): 0.621371, ("m", "km"): 0.001, ("km2", "mi2"): 0.386102,
            ("cm", "in"): 0.393701, ("kg", "lb"): 2.20462}
CONVERSIONS = {**_FACTORS, **{(b, a): 1 / f for (a, b), f in _FACTORS.items()}}
UNIT_WORDS = {"ft": "feet", "mi": "miles", "km": "kilometres", "m": "metres", "mi2": "square miles",
              "km2": "square kilometres", "in": "inches", "cm": "centimetres", "lb": "pounds", "kg": "kilograms"}


def _obj(required: list[str], **props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required}


SOLVING_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("kb_lookup", "Look up an attribute of an entity.",
             _obj(["entity", "attribute"], entity={"type": "string"}, attribute={"type": "string"})),
    ToolSpec("calculator", "Arithmetic on two numbers.",
             _obj(["operation", "a", "b"],
                  operation={"type": "string", "enum": ["add", "subtract", "multiply", "divide"]},
                  a={"type": "number"}, b={"type": "number"})),
    ToolSpec("convert_units", "Convert a value between units.",
             _obj(["value", "from_unit", "to_unit"], value={"type": "number"},
                  from_unit={"type": "string", "enum": list(UNITS)},
                  to_unit={"type": "string", "enum": list(UNITS)})),
    ToolSpec("date_add", "Add days (negative: go back) to a YYYY-MM-DD date.",
             _obj(["date", "days"], date={"type": "string"}, days={"type": "integer"})),
    ToolSpec("date_diff", "Days from start_date to end_date.",
             _obj(["start_date", "end_date"], start_date={"type": "string"}, end_date={"type": "string"})),
    ToolSpec("aggregate", "Max, min, sum or mean of numbers.",
             _obj(["values", "function"], values={"type": "array", "items": {"type": "number"}, "minItems": 1},
                  function={"type": "string", "enum": ["max", "min", "sum", "mean"]})),
)
DISTRACTOR_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("weather_forecast", "Weather forecast for a city on a date.",
             _obj(["city", "date"], city={"type": "string"}, date={"type": "string"})),
    ToolSpec("currency_rate", "Exchange rate between two currencies.",
             _obj(["base", "quote"], base={"type": "string"}, quote={"type": "string"})),
    ToolSpec("send_message", "Send a text message to a person.",
             _obj(["recipient", "text"], recipient={"type": "string"}, text={"type": "string"})),
)


class ToolError(Exception):
    """A tool's refusal; becomes an {"error": ...} observation."""


def _round(x: float) -> Value:
    if isinstance(x, int):
        return x
    r = round(x, 2)
    return int(r) if r.is_integer() and abs(r) < 1e15 else r


def _date(s: Any) -> dt.date:
    try:
        return dt.date.fromisoformat(s)
    except (TypeError, ValueError):
        raise ToolError(f"{s!r} is not a date in YYYY-MM-DD form") from None


class WorldTools:
    """Executes calls against a knowledge base. `tools` is the documented set."""

    def __init__(self, kb: KnowledgeBase, distractors: bool = True):
        self.kb = kb
        self.tools = SOLVING_TOOLS + (DISTRACTOR_TOOLS if distractors else ())
        self.by_name = {t.name: t for t in self.tools}
        self._impl: dict[str, Callable[..., Value]] = {
            "kb_lookup": self.kb_lookup, "calculator": self.calculator, "convert_units": self.convert_units,
            "date_add": self.date_add, "date_diff": self.date_diff, "aggregate": self.aggregate,
            "weather_forecast": self.weather_forecast, "currency_rate": self.currency_rate,
            "send_message": self.send_message,
        }

    def execute(self, call: ToolCall) -> tuple[Value | None, str]:
        """(result value or None on error, observation JSON). Never raises."""
        spec = self.by_name.get(call.name)
        if spec is None:
            return None, _error(f"unknown tool {str(call.name)[:80]!r}; available: {', '.join(self.by_name)}")
        problems = validate_arguments(spec, call.arguments)
        if problems:
            return None, _error("bad arguments: " + "; ".join(problems))
        try:
            value = self._impl[call.name](**call.arguments)
            if isinstance(value, float) and not math.isfinite(value):
                raise ToolError(f"the result is not a finite number ({value})")
            return value, json.dumps({"result": value}, ensure_ascii=False)
        except ToolError as err:
            return None, _error(str(err))
        except ValueError as err:  # also an int result over Python's 4300-digit str() limit
            return None, _error(f"{call.name} failed: {str(err)[:200]}")
        except Exception as err:  # ArithmeticError, MemoryError, ...: an observation, never a crash
            return None, _error(f"{call.name} failed: {type(err).__name__}: {str(err)[:200]}")

    # ------------------------------------------------------------------ tools

    def kb_lookup(self, entity: str, attribute: str) -> Value:
        e = self.kb.get(entity)
        if e is None:
            raise ToolError(f"unknown entity {entity!r}")
        if attribute not in e.attrs:
            raise ToolError(f"{entity} has no attribute {attribute!r}; it has: {', '.join(e.attrs)}")
        return e.attrs[attribute]

    def calculator(self, operation: str, a: float, b: float) -> Value:
        if operation == "divide" and b == 0:
            raise ToolError("division by zero")
        ops = {"add": a + b, "subtract": a - b, "multiply": a * b, "divide": a / b if b else 0.0}
        return _round(ops[operation])

    def convert_units(self, value: float, from_unit: str, to_unit: str) -> Value:
        if from_unit == to_unit:
            return _round(value)
        factor = CONVERSIONS.get((from_unit, to_unit))
        if factor is None:
            raise ToolError(f"cannot convert {from_unit} to {to_unit}")
        return _round(float(value) * factor)

    def date_add(self, date: str, days: int) -> Value:
        try:
            return (_date(date) + dt.timedelta(days=int(days))).isoformat()
        except OverflowError:
            raise ToolError("date out of range") from None

    def date_diff(self, start_date: str, end_date: str) -> Value:
        return (_date(end_date) - _date(start_date)).days

    def aggregate(self, values: list[float], function: str) -> Value:
        if function == "max":
            return max(values)
        if function == "min":
            return min(values)
        if function == "sum":
            return _round(sum(values))
        return _round(sum(values) / len(values))

    def weather_forecast(self, city: str, date: str) -> Value:
        _date(date)
        h = int(hashlib.sha256(f"{city}|{date}".encode()).hexdigest(), 16)
        return f"{('sunny', 'cloudy', 'rain', 'snow', 'windy')[h % 5]}, {h % 35 - 5} C"

    def currency_rate(self, base: str, quote: str) -> Value:
        h = int(hashlib.sha256(f"{base}|{quote}".encode()).hexdigest(), 16)
        return round(0.2 + (h % 10000) / 2000, 4)

    def send_message(self, recipient: str, text: str) -> Value:
        return f"message to {recipient} queued"


def _error(message: str) -> str:
    """An error observation; a message quoting a huge argument is cut (a model can write 100 k chars)."""
    if len(message) > 500:
        message = message[:500] + " ..."
    return json.dumps({"error": message}, ensure_ascii=False)
