"""Typed configs: dataclasses built from recipe files and dotted command-line overrides.

Every component owns a plain ``@dataclass`` whose defaults are the recipe's. This module turns
nested mappings (a YAML recipe) and ``section.key=value`` overrides (``trainer.optim.lr=1e-4``,
as verl users expect) into those dataclasses, strictly:

- an unknown key fails with the dotted path, the closest valid names and the full list;
- a value of the wrong type fails with the path, the expected type and the value given;
- after building, every dataclass that defines ``validate(self) -> None`` is asked to check its
  cross-field rules (a batch not divisible by the group size, ...), deepest first.

Override values are parsed as YAML scalars or flow collections (``x=3``, ``x=[1, 2]``,
``x=null``), then checked against the field type. Supported field types: bool, int, float,
str, Enum, Literal, X | None, list[X], tuple[X, ...], dict[str, X], nested dataclasses and
tagged unions of them.

A tagged union (``trainer.algorithm``: one section per algorithm) is a union of dataclasses
that each have a ``name: Literal["..."]`` field: the mapping's ``name`` picks the class, whose
keys alone are valid under it (``trainer.algorithm.beta`` exists where the algorithm has a
beta). The name alone is short for its section with defaults (``trainer.algorithm=awm``); an
override naming the section's current algorithm keeps its settings, another resets them.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from flowgrpo.fields import FieldError, check_ranges
from flowgrpo.fileio import atomic_write
from flowgrpo.yamlfile import YamlError, brief, parse_yaml, read_yaml_file

T = TypeVar("T")


class ConfigError(ValueError):
    """A recipe or override names an unknown key, has a wrong type or breaks a cross-field rule."""


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; missing keys keep their defaults."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping of keys, got {type(data).__name__}")
    fields = _fields(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(_unknown_key(cls, _key_name(key), path))
    hints = typing.get_type_hints(cls)
    kwargs = {key: _coerce(hints[key], value, _join(path, key)) for key, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a field without default that the recipe did not set
        raise ConfigError(f"{path or cls.__name__}: {exc}") from None
    except ValueError as exc:  # a check the class runs as it is built (__post_init__)
        raise ConfigError(bounded_message(str(exc))) from None


def to_dict(obj: Any) -> Any:
    """The plain-data form of a config (what a recipe file holds)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


SECRET_FIELDS = frozenset({"token", "secret", "api_key", "password"})


def redacted(cfg: T) -> T:
    """A copy of ``cfg`` with every secret field (:data:`SECRET_FIELDS`) emptied: what may be
    written to a run folder, a log, a report or W&B. Secrets come from the environment or files
    (``FLOWGRPO_TOKEN``, ``FLOWGRPO_BUS_SECRET``, their ``_FILE`` forms), so the copy still loads
    and runs where they are set."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        return cfg
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in SECRET_FIELDS and value:
            changes[f.name] = None if value is None or f.default is None else ""
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes[f.name] = redacted(value)
        elif isinstance(value, list) and any(dataclasses.is_dataclass(v) for v in value):
            changes[f.name] = [redacted(v) for v in value]
    return dataclasses.replace(cfg, **changes)


def apply_overrides(cfg: T, overrides: Sequence[str]) -> T:
    """Return a copy of ``cfg`` with ``a.b.c=value`` overrides applied, then validated."""
    data = to_dict(cfg)  # a copy: the caller's config is never mutated
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {brief(item)} is not of the form section.key=value")
        _set_path(type(cfg), data, key.strip().split("."), _parse_value(raw, item), item)
    return validate(from_dict(type(cfg), data))


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Build ``cls`` from an optional YAML recipe plus overrides, validated. The file is read
    within the bounds of :mod:`flowgrpo.yamlfile` (size, aliases, depth)."""
    data: Mapping[str, Any] = {}
    if path is not None:
        if not Path(path).exists():  # not is_file: /dev/null or a pipe is a recipe too
            raise ConfigError(_no_recipe(Path(path)))
        try:
            data = read_yaml_file(path) or {}
        except YamlError as exc:
            raise ConfigError(str(exc)) from None
    try:
        cfg = from_dict(cls, data)
    except ConfigError as exc:
        if path is None:
            raise
        raise ConfigError(f"{path}: {exc}") from None
    return apply_overrides(cfg, overrides)  # validates the result, with or without overrides


def _no_recipe(path: Path) -> str:
    """What a missing recipe file's error says: the path, and the closest recipes beside it."""
    folder = path.parent
    if not folder.is_dir():
        return f"no recipe at {path}: the folder {folder} does not exist"
    names = sorted(p.name for p in folder.iterdir() if p.suffix in (".yaml", ".yml"))
    close = difflib.get_close_matches(path.name, names, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(str(folder / c) for c in close)}?" if close else ""
    return f"no recipe at {path}{hint}"


def validate(cfg: T, path: str = "") -> T:
    """Check ``cfg`` and its nested dataclasses (in lists too), deepest first: the range of every
    numeric field declared with :func:`flowgrpo.fields.knob` (the error names its dotted key),
    then the class's own ``validate()`` method, if any (its cross-field rules)."""
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if _is_config(value):
            validate(value, _join(path, f.name))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if _is_config(item):
                    validate(item, f"{_join(path, f.name)}[{i}]")
    try:
        check_ranges(cfg, path)
    except FieldError as exc:
        raise ConfigError(str(exc)) from None
    check = getattr(cfg, "validate", None)
    if callable(check):
        try:
            check()
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(f"{type(cfg).__name__}: {bounded_message(str(exc))}") from None
    return cfg


def _is_config(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def dump_yaml(cfg: Any, path: str | Path) -> None:
    """Write the resolved config atomically (a reader never sees half a file), secrets emptied
    (:func:`redacted`): no secret is ever written to disk in clear."""
    atomic_write(path, yaml.safe_dump(to_dict(redacted(cfg)), sort_keys=False))


# --- internals -------------------------------------------------------------------------------


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _key_name(key: Any) -> str:
    """A recipe's key as an error names it: a long or odd key shortened, never quoted twice."""
    return brief(key)[1:-1] if isinstance(key, str) else brief(key)


def _fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    return {f.name: f for f in dataclasses.fields(cls)}


def _unknown_key(cls: type, key: str, path: str) -> str:
    moved = getattr(cls, "MOVED_KEYS", {}).get(key)  # a key an older version had, and where it went
    if moved:
        return f"{_join(path, key)!r} is gone: {moved}"
    names = list(_fields(cls))
    # a key that is a field deeper down (`lr` for trainer.optim.lr) is named by its whole path;
    # else the closest names at this level
    deeper = [_join(path, p) for p in _nested_paths(cls, key)][:3]
    close = deeper or [_join(path, c) for c in difflib.get_close_matches(key, names, n=3, cutoff=0.5)]
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    where = f"under {path!r}" if path else "at the top level"
    return f"unknown key {_join(path, key)!r}{hint} (valid keys {where}: {', '.join(names)})"


def _nested_paths(cls: type, key: str, depth: int = 0) -> list[str]:
    """Dotted paths, below ``cls``, of the fields named ``key`` in its nested sections (the
    variants of a tagged section included), shallowest first."""
    if depth > 8:  # configs nest a few levels; a cycle must not recurse for ever
        return []
    found: list[str] = []
    hints = typing.get_type_hints(cls)
    for name in _fields(cls):
        sub = _strip_optional(hints[name])
        sections = list(_tagged_variants(sub).values()) or (
            [sub] if isinstance(sub, type) and dataclasses.is_dataclass(sub) else []
        )
        for section in sections:
            if key in _fields(section):
                found.append(f"{name}.{key}")
            found += [f"{name}.{p}" for p in _nested_paths(section, key, depth + 1)]
    return sorted(dict.fromkeys(found), key=lambda p: p.count("."))


def bounded_message(message: str, most: int = 1000) -> str:
    """``message`` on one line and at most ``most`` characters: a rule's message that quotes a
    value the recipe chose (the key comes first, so it stays)."""
    line = " ".join(message.split())
    return line if len(line) <= most else f"{line[: most - 30]}... ({len(line):,} characters)"


def _parse_value(raw: str, item: str) -> Any:
    if not raw.strip():
        return ""
    try:
        return parse_yaml(raw, f"override {brief(item)}")
    except YamlError as exc:
        if "not valid YAML" in str(exc):
            return raw  # a plain string the YAML reader cannot take, such as `name=a: b`
        raise ConfigError(str(exc)) from None


def _set_path(cls: type, data: dict[str, Any], keys: list[str], value: Any, item: str) -> None:
    path = ""
    for depth, key in enumerate(keys):
        fields = _fields(cls)
        if key not in fields:
            raise ConfigError(f"override {brief(item)}: {_unknown_key(cls, _key_name(key), path)}")
        path = _join(path, key)
        sub = _strip_optional(typing.get_type_hints(cls)[key])
        variants = _tagged_variants(sub)
        if depth == len(keys) - 1:
            data[key] = _chosen(variants, data.get(key), value, path) if variants else value
            return
        if variants:
            data[key] = _tagged_mapping(variants, data.get(key), path)
            sub = variants[data[key]["name"]]
        elif not (isinstance(sub, type) and dataclasses.is_dataclass(sub)):
            raise ConfigError(f"override {brief(item)}: {path!r} is a {_type_name(sub)}, not a section")
        if data.get(key) is None:
            data[key] = to_dict(sub())
        if variants and keys[depth + 1] == "name" and depth + 1 == len(keys) - 1:
            data[key] = _chosen(variants, data[key], value, path)  # `section.name=x`: as `section=x`
            return
        cls, data = sub, data[key]


def _tagged_variants(tp: Any) -> dict[str, type]:
    """``{name: class}`` when ``tp`` is a union of dataclasses tagged by a one-value ``name``
    Literal (a tagged union); ``{}`` for any other type."""
    if not _is_union(tp):
        return {}
    variants: dict[str, type] = {}
    for arg in typing.get_args(tp):
        if not (isinstance(arg, type) and dataclasses.is_dataclass(arg)):
            return {}
        tag = typing.get_type_hints(arg).get("name")
        if typing.get_origin(tag) is not typing.Literal or len(typing.get_args(tag)) != 1:
            return {}
        variants[typing.get_args(tag)[0]] = arg
    return variants


def _tagged_mapping(variants: dict[str, type], value: Any, path: str) -> dict[str, Any]:
    """A tagged union's value as a mapping with its ``name`` (the name alone: its defaults)."""
    if value is None:
        raise ConfigError(f"{path}: null is not a section; name one of {', '.join(variants)}")
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a name ({', '.join(variants)}) or a mapping, got {brief(value)}")
    name = value.get("name")
    if name is None:
        raise ConfigError(f"{path}: the section has no name: add name: (one of {', '.join(variants)})")
    if not isinstance(name, str) or name not in variants:  # a list or a mapping is no name (nor hashable)
        raise ConfigError(f"{path}.name: {brief(name)} is not one of {', '.join(map(repr, variants))}")
    return dict(value)


def _chosen(variants: dict[str, type], current: Any, value: Any, path: str) -> Any:
    """An override's new value of a tagged union: the name of the current section keeps its
    settings, another name its defaults; a mapping replaces the section."""
    if isinstance(value, Mapping):
        return dict(value)
    new = _tagged_mapping(variants, value, path)
    if isinstance(current, Mapping | str) and _tagged_mapping(variants, current, path)["name"] == new["name"]:
        return _tagged_mapping(variants, current, path)
    return new


def _coerce_tagged(variants: dict[str, type], value: Any, path: str) -> Any:
    data = _tagged_mapping(variants, value, path)
    return from_dict(variants[data["name"]], data, path)


def _strip_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if _is_union(tp) and type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None))
    return tp


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against type ``tp`` and convert containers and enums; raise ConfigError."""
    if tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    variants = _tagged_variants(tp)
    if variants:
        return _coerce_tagged(variants, value, path)
    if _is_union(tp):
        return _coerce_union(tp, args, value, path)
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{path}: {brief(value)} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple, Sequence):
        return _coerce_sequence(origin, args, value, path)
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _wrong(path, tp, value)
        return {str(k): _coerce(args[1], v, f"{path}.{brief(k)}") for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{path}: {brief(value)} is not one of {[m.value for m in tp]}") from None
    return _coerce_scalar(tp, value, path)


def _coerce_union(tp: Any, args: tuple[Any, ...], value: Any, path: str) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise _wrong(path, tp, value)
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(arg, value, path)
        except ConfigError as exc:
            errors.append(str(exc))
    raise ConfigError(f"{path}: {brief(value)} does not match {_type_name(tp)} ({'; '.join(errors)})")


def _coerce_sequence(origin: Any, args: tuple[Any, ...], value: Any, path: str) -> Any:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{path}: expected a list, got {brief(value)}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}: {brief(value)}")
        return tuple(_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    item = args[0] if args else Any
    items = [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _coerce_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-4" (no dot) as a string; accept it for float fields
            return float(value)
        except ValueError:
            raise _wrong(path, tp, value) from None
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is bool and isinstance(value, bool):
        return value
    if tp is str and isinstance(value, str):
        return value
    if tp is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)  # `name=123` on the command line means the string "123"
    if tp in (int, float, bool, str):
        raise _wrong(path, tp, value)
    raise ConfigError(f"{path}: unsupported field type {_type_name(tp)}")


def _wrong(path: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {brief(value)}")
