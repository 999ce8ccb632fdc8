"""BFCL's executable backends (file system, trading bot, ...): instances, dispatch, results.

A `World` is one entry's live instances (loaded from its `initial_config`, as BFCL's
`execute_multi_turn_func_call` does) and an allow-list of bound methods: only
functions named in the involved classes' docs, present on the instance as public
methods. A name that maps to two classes goes to the later class in
`involved_classes`, as in BFCL's method-name mapping. Nothing else is ever called:
an unknown, private or dunder name, or a non-string argument name, is an error result
and nothing runs. Arguments are deep-copied into each call, as BFCL's `eval()` of a call
string builds fresh values: a backend that stores an argument list (post_tweet's tags)
and later mutates it must not reach back into the caller's record of the call. An exception raised by a backend method becomes
"Error during execution: <message>" (BFCL's wording); it never propagates.

Results are serialised as BFCL does -- a str as is, a dict through `json.dumps`,
anything else through `str()` -- except that sets (whose `str()` depends on the hash
seed) are written in sorted order. mpmath's and decimal's global precision, which
MathAPI sets per call, is restored after each call, so one call cannot change
another's results or anything else in the process. An argument whose cost grows with
its value is refused, a guard BFCL does not have: `exponent`, `precision` and
`decimal_places` above 1000 in size (`ARGUMENT_LIMITS`), and any integer of more than
100 digits (`MAX_INT_DIGITS`: `power(7**4000, 1000)` takes seconds). The tool process's
time limit (`toolcollapse.sandbox`) stops whatever else would run too long.
"""

from __future__ import annotations

import contextlib
import copy
import decimal
import importlib
import inspect
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import mpmath

from toolcollapse.envs.bfcl.calls import LiteralCall

BACKEND_PACKAGE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
MODULES: dict[str, str] = {  # BFCL's CLASS_FILE_PATH_MAPPING, offline classes
    "GorillaFileSystem": "gorilla_file_system", "MathAPI": "math_api", "MessageAPI": "message_api",
    "TwitterAPI": "posting_api", "TicketAPI": "ticket_api", "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking", "VehicleControlAPI": "vehicle_control",
}
STATELESS = frozenset({"MathAPI"})  # BFCL's STATELESS_CLASSES: no `_load_scenario`
ERROR_PREFIX = "Error during execution: "


@dataclass
class World:
    instances: dict[str, Any]  # class name -> live backend instance
    methods: dict[str, Callable[..., Any]]  # allow-listed function name -> bound method


def load_world(classes: Sequence[str], initial_config: Mapping[str, Any], long_context: bool,
               allowed: Mapping[str, Sequence[str]]) -> World:
    """Fresh instances of `classes`; `allowed[c]` names the documented functions of class c."""
    instances: dict[str, Any] = {}
    methods: dict[str, Callable[..., Any]] = {}
    for name in classes:
        instance = _backend_class(name)()
        if name not in STATELESS:
            instance._load_scenario(copy.deepcopy(initial_config.get(name, {})), long_context=long_context)
        instances[name] = instance
        for fn in allowed[name]:
            method = getattr(instance, fn, None) if not fn.startswith("_") else None
            if inspect.ismethod(method):
                methods[fn] = method
    return World(instances, methods)


def _backend_class(name: str) -> type:
    if name not in MODULES:
        raise ValueError(f"BFCL backend class {name!r} is not supported offline; supported: {', '.join(MODULES)}")
    return getattr(importlib.import_module(f"{BACKEND_PACKAGE}.{MODULES[name]}"), name)


# Departure from BFCL, which has no such guard: MathAPI computes `base ** exponent`, sets mpmath's and
# decimal's precision to the model's value, and `round(number, decimal_places)` of an int computes
# 10 ** -decimal_places (-10**12: it never returns). Refused in a few microseconds instead of stopped at
# the time limit. No ground-truth call comes near these limits (bench/bfcl_parity.py replays them all).
ARGUMENT_LIMITS = {"exponent": 1000, "precision": 1000, "decimal_places": 1000}
MAX_INT_DIGITS = 100  # no ground-truth integer comes near 10**100 either


def execute(world: World, call: LiteralCall) -> tuple[str, bool]:
    """(result text, whether a backend method ran). Never raises."""
    method = world.methods.get(call.name) if isinstance(call.name, str) else None
    if method is None:
        return f"Error: {str(call.name)[:80]!r} is not one of the available functions.", False
    if not all(isinstance(k, str) for k in call.kwargs):
        return "Error: argument names must be strings.", False
    for name, limit in ARGUMENT_LIMITS.items():
        value = call.kwargs.get(name)
        if isinstance(value, (int, float)) and not abs(value) <= limit:
            return f"Error: {name}={str(value)[:40]} exceeds {limit} (a toolcollapse guard; it would stall the run).", False
    if _huge_int((call.args, call.kwargs)):
        return f"Error: an integer argument has more than {MAX_INT_DIGITS} digits (a toolcollapse guard).", False
    with _numeric_context():
        try:
            args, kwargs = copy.deepcopy((call.args, call.kwargs))  # fresh values, as BFCL's eval() makes
            return serialize(method(*args, **kwargs)), True
        except Exception as err:  # a backend failure is an observation, as in BFCL
            return f"{ERROR_PREFIX}{err}", True


def _huge_int(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() > MAX_INT_DIGITS * 3.33  # log2(10) bits a digit
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_huge_int(v) for v in value)
    if isinstance(value, dict):
        return any(_huge_int(v) for v in value.values())
    return False


@contextlib.contextmanager
def _numeric_context() -> Iterator[None]:
    """Restores mpmath's and decimal's global precision after a call (MathAPI sets them)."""
    prec = mpmath.mp.prec
    try:
        with decimal.localcontext():
            yield
    finally:
        mpmath.mp.prec = prec


def serialize(result: Any) -> str:
    """BFCL's `execute_multi_turn_func_call` serialisation, with sets in sorted order."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            pass
    return str(_sorted_sets(result))


class _SortedSet(list):
    def __repr__(self) -> str:
        return "{" + ", ".join(sorted(map(repr, self))) + "}" if self else "set()"


def _sorted_sets(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return _SortedSet(_sorted_sets(v) for v in value)
    if type(value) is dict:
        return {k: _sorted_sets(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_sorted_sets(v) for v in value)
    return value
