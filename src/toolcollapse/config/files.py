"""Config files: YAML read (with `base:` inheritance), overrides applied, validated into the dataclasses;
configs compared and written back."""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from toolcollapse.config.schema import ConfigError, RunConfig



def load_config(path: str | Path | None, overrides: typing.Sequence[str] = (), cls: type = RunConfig,
                inherit: bool = True) -> Any:
    """Read a YAML file (or the defaults when `path` is None), apply overrides, validate.
    `inherit`: a top-level `base:` names a file to start from (False for sweep files, whose
    `base:` is the run config of their runs)."""
    raw: dict[str, Any] = read_yaml(Path(path), inherit) if path is not None else {}
    for item in overrides:
        apply_override(raw, item)
    migrate_legacy_keys(raw)
    return from_dict(cls, raw)


def read_yaml(path: Path, inherit: bool = True, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file as a mapping, with its `base:` file merged underneath."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" + (f" (the base of {_chain[-1]})" if _chain else ""))
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start} is 0x{data[err.start]:02x}); save it as UTF-8") \
            from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}")
    base = raw.pop("base", None) if inherit else None
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: expected the path of another config file, got {base!r}")
    chain = (*_chain, path.resolve())
    if Path(base).resolve() in chain:
        raise ConfigError(f"{path}: base: {base} leads back to {path}")
    return deep_merge(read_yaml(Path(base), True, chain), raw)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice in one mapping (lines {seen[key]} and {line}); "
                    "keep one", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep)


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`: sections merge key by key; any other value (a list included) replaces."""
    out = dict(base)
    for key, value in top.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


LEGACY_WARMUP_KEYS = {"copy_warmup_content": "content", "copy_warmup_steps": "steps",
                      "copy_warmup_batch_size": "batch_size"}


# switches of the paths before the speed work, removed in issue 19 (their settings, always on, are kept in
# older configs and run directories); the paths before are compared in bench/behaviour_vs_rev.py
REMOVED_SWITCHES = {"rollout": ("shared_prefix_attention", "share_group_prompt", "compact_finished_rows"),
                    "grpo": ("sort_micro_batches", "prefix_once")}


def migrate_legacy_keys(raw: dict[str, Any]) -> None:
    """Rewrite keys of older configs and checkpoints in place: the single copy warm-up phase
    `sft.copy_warmup_{content,steps,batch_size}` (defaults first_call, 0, 64) is now one item of
    `sft.copy_warmup`; `supervision.prs.judge: deterministic | module:callable` is now a mapping; the removed
    speed switches go where they are on (what every run had), and refuse to be turned off."""
    for section, keys in REMOVED_SWITCHES.items():
        node = raw.get(section)
        for key in keys if isinstance(node, dict) else ():
            if key in node and node.pop(key) is not True:
                raise ConfigError(f"{section}.{key}: the switch is gone (issue 19), its speed-up always on; the "
                                  "path before it runs at revision b6b1319 (bench/behaviour_vs_rev.py --rev)")
    prs = (raw.get("supervision") or {}).get("prs") if isinstance(raw.get("supervision"), dict) else None
    if isinstance(prs, dict) and isinstance(prs.get("judge"), str):
        spec = prs["judge"]
        prs["judge"] = {"kind": "deterministic"} if spec == "deterministic" else {"kind": "factory", "factory": spec}
    sft = raw.get("sft")
    if not isinstance(sft, dict) or not LEGACY_WARMUP_KEYS.keys() & sft.keys():
        return
    if "copy_warmup" in sft:
        raise ConfigError("sft.copy_warmup and the older sft.copy_warmup_steps / _batch_size / _content "
                          "describe the same thing; give only sft.copy_warmup")
    phase = {"content": "first_call", "steps": 0, "batch_size": 64}
    phase.update({new: sft.pop(old) for old, new in LEGACY_WARMUP_KEYS.items() if old in sft})
    sft["copy_warmup"] = [phase]


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like key.subkey=value")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def from_dict(cls: type, raw: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping, checking keys and types recursively."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(cls, include_extras=True)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]!s} (known keys of {where}: {', '.join(sorted(names))})")
    kwargs = {name: _coerce(value, hints[name], f"{prefix}{name}") for name, value in raw.items()}
    try:
        return cls(**kwargs)
    except ConfigError as err:  # a range or cross-key check of this dataclass (Checked)
        raise ConfigError(f"{prefix}{err}") from None


def _coerce(value: Any, tp: Any, key: str) -> Any:
    if typing.get_origin(tp) is Annotated:  # the Range is checked by the dataclass (Checked)
        tp = typing.get_args(tp)[0]
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {tp}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return {str(k): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{key}: {value!r} is not one of {[m.value for m in tp]}") from None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"config field {key} has an unsupported type {tp}")  # a bug in this module, not user input


# keys a resumed run may change: how fast, not what is computed (a device changes float rounding only)
RESULT_NEUTRAL = ("threads", "device")


def differences(a: Any, b: Any, ignore: typing.Sequence[str] = RESULT_NEUTRAL) -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) of every leaf where two configs differ."""

    def walk(x: Any, y: Any, prefix: str):
        if isinstance(x, dict) and isinstance(y, dict):
            for k in dict.fromkeys([*x, *y]):
                yield from walk(x.get(k), y.get(k), f"{prefix}{k}.")
        elif x != y and prefix.rstrip(".") not in ignore:
            yield prefix.rstrip("."), x, y

    return list(walk(to_dict(a), to_dict(b), ""))


def first_difference(a: Any, b: Any, ignore: typing.Sequence[str] = RESULT_NEUTRAL) -> tuple[str, Any, Any] | None:
    """(dotted key, value in a, value in b) of the first leaf where two configs differ, or None."""
    found = differences(a, b, ignore)
    return found[0] if found else None


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain YAML-safe dict (tuples become lists, enums their values)."""

    def plain(v: Any) -> Any:
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


def dump_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
