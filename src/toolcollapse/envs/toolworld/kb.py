"""The knowledge base of the synthetic tool world: entities of five kinds with attributes.

Entity names are invented from syllables, and their shape tells the kind (`Mount X`,
`X Labs`, `Xland`, two-word people), so a model can learn which attribute key a
question means. Relations (a country's capital, a company's CEO) point to entities
of the same pool, so chains of lookups stay inside the pool they started in: the
`ood` pool's names never occur in training. `counterfactual` re-draws every fact of the
main pool: the names a model has read, in a world it has not.
"""

from __future__ import annotations

import datetime as dt
import math
import random
from dataclasses import dataclass
from typing import Union

Value = Union[int, float, str]


@dataclass(frozen=True)
class Attr:
    key: str  # as the kb_lookup tool takes it
    phrase: str  # as questions say it
    type: str  # "int" | "float" | "date" | an entity kind (a relation)
    unit: str | None = None
    low: float = 0
    high: float = 0

    @property
    def numeric(self) -> bool:
        return self.type in ("int", "float")

    @property
    def relation(self) -> bool:
        return self.type in KINDS


def _a(key: str, phrase: str, type_: str, unit: str | None = None, low: float = 0, high: float = 0) -> Attr:
    return Attr(key, phrase, type_, unit, low, high)


SCHEMA: dict[str, tuple[Attr, ...]] = {
    "country": (
        _a("capital", "capital", "city"),
        _a("population", "population", "int", None, 200_000, 90_000_000),
        _a("area_km2", "area", "int", "km2", 500, 2_000_000),
        _a("independence_date", "independence date", "date"),
    ),
    "city": (
        _a("country", "country", "country"),
        _a("mayor", "mayor", "person"),
        _a("population", "population", "int", None, 5_000, 9_000_000),
        _a("elevation_m", "elevation", "int", "m", 2, 4_500),
        _a("founded", "founding date", "date"),
    ),
    "mountain": (
        _a("country", "country", "country"),
        _a("height_m", "height", "int", "m", 900, 8_800),
        _a("first_ascent", "first ascent date", "date"),
    ),
    "person": (
        _a("home_city", "home city", "city"),
        _a("employer", "employer", "company"),
        _a("birth_date", "birth date", "date"),
        _a("height_cm", "height", "int", "cm", 150, 205),
        _a("weight_kg", "weight", "float", "kg", 45, 130),
    ),
    "company": (
        _a("headquarters", "headquarters", "city"),
        _a("ceo", "chief executive", "person"),
        _a("founded", "founding date", "date"),
        _a("revenue_musd", "revenue in million dollars", "float", None, 5, 90_000),
        _a("employees", "number of employees", "int", None, 10, 400_000),
    ),
}
KINDS = tuple(SCHEMA)
POOL_SIZES = {"country": 16, "city": 60, "mountain": 30, "person": 80, "company": 30}
DATE_RANGES = {"birth_date": (1935, 2004), "independence_date": (1750, 1995), "founded": (1600, 2015),
               "first_ascent": (1850, 2010)}

_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t",
           "tr", "v", "z", "sh", "th", "qu")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou", "ea")
_CODAS = ("", "", "", "n", "r", "l", "s", "m", "x", "nd", "rk", "th")
_COUNTRY_ENDS = ("ia", "land", "stan")
_COMPANY_ENDS = ("Labs", "Corp", "Systems", "Foods", "Motors", "Group", "Works")


def _word(rng: random.Random, min_syl: int = 2, max_syl: int = 3) -> str:
    n = rng.randint(min_syl, max_syl)
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n))
    return word.capitalize()


def _name(kind: str, rng: random.Random) -> str:
    if kind == "country":
        return _word(rng, 1, 2) + rng.choice(_COUNTRY_ENDS)
    if kind == "mountain":
        return "Mount " + _word(rng)
    if kind == "person":
        return _word(rng, 1, 2) + " " + _word(rng)
    if kind == "company":
        return _word(rng) + " " + rng.choice(_COMPANY_ENDS)
    while True:  # city: must not look like a country
        w = _word(rng)
        if not w.endswith(_COUNTRY_ENDS):
            return w


@dataclass(frozen=True)
class Entity:
    name: str
    kind: str
    pool: str  # "main" (train and test) or "ood" (content-OOD only)
    attrs: dict[str, Value]


class KnowledgeBase:
    def __init__(self, entities: dict[str, Entity]):
        self.entities = entities

    def pool(self, kind: str, pool: str) -> list[Entity]:
        return [e for e in self.entities.values() if e.kind == kind and e.pool == pool]

    def get(self, name: str) -> Entity | None:
        return self.entities.get(name)


def generate_kb(seed: int, pool_scale: float = 1.0) -> KnowledgeBase:
    """Two disjoint pools of entities, `main` and `ood`, deterministic in `seed`; `pool_scale`
    multiplies the number of entities of each kind."""
    rng = random.Random(f"kb-{seed}")
    used: set[str] = set()
    names: dict[tuple[str, str], list[str]] = {}
    for pool in ("main", "ood"):
        for kind in KINDS:
            batch = []
            while len(batch) < max(2, round(POOL_SIZES[kind] * pool_scale)):
                name = _name(kind, rng)
                if name not in used and not any(name.lower() in u.lower() or u.lower() in name.lower()
                                                for u in batch):
                    used.add(name)
                    batch.append(name)
            names[(kind, pool)] = batch
    entities: dict[str, Entity] = {}
    for pool in ("main", "ood"):
        for kind in KINDS:
            for name in names[(kind, pool)]:
                attrs = {a.key: _value(a, rng, names, pool) for a in SCHEMA[kind]}
                entities[name] = Entity(name, kind, pool, attrs)
    _assign_capitals(entities, rng, ("main", "ood"))
    return KnowledgeBase(entities)


def counterfactual(kb: KnowledgeBase, seed: int) -> KnowledgeBase:
    """`kb` with every attribute of the main pool's entities drawn again, from a stream of its
    own (relations stay in the pool, each country gets a capital again); the ood pool as is."""
    rng = random.Random(f"kb-{seed}-counterfactual")
    names = {(kind, "main"): [e.name for e in kb.pool(kind, "main")] for kind in KINDS}
    entities = dict(kb.entities)
    for e in kb.entities.values():
        if e.pool == "main":
            entities[e.name] = Entity(e.name, e.kind, e.pool,
                                      {a.key: _value(a, rng, names, "main") for a in SCHEMA[e.kind]})
    _assign_capitals(entities, rng, ("main",))
    return KnowledgeBase(entities)


def _value(attr: Attr, rng: random.Random, names: dict[tuple[str, str], list[str]], pool: str) -> Value:
    if attr.relation:
        return rng.choice(names[(attr.type, pool)])
    if attr.type == "date":
        lo, hi = DATE_RANGES[attr.key]
        start = dt.date(lo, 1, 1).toordinal()
        return dt.date.fromordinal(rng.randint(start, dt.date(hi, 12, 31).toordinal())).isoformat()
    if attr.type == "int":
        return int(round(_loguniform(rng, attr.low, attr.high)))
    return round(_loguniform(rng, attr.low, attr.high), 1)


def _loguniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _assign_capitals(entities: dict[str, Entity], rng: random.Random, pools: tuple[str, ...]) -> None:
    """Each country gets its own capital, and that city's country is the country."""
    for pool in pools:
        countries = [e for e in entities.values() if e.kind == "country" and e.pool == pool]
        cities = [e for e in entities.values() if e.kind == "city" and e.pool == pool]
        for country, city in zip(countries, rng.sample(cities, len(countries))):
            entities[country.name] = Entity(country.name, "country", pool, dict(country.attrs, capital=city.name))
            entities[city.name] = Entity(city.name, "city", pool, dict(city.attrs, country=country.name))
