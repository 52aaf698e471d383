"""Reading YAML that a person wrote (recipes, service configs, ``key=value`` overrides), in
bounded time and memory, with errors of one line that name the file, the line and the key.

YAML can describe far more than its size: an alias (``*a``) repeats a whole anchored subtree,
so nine levels of ten aliases each ("billion laughs") are 130 events on the wire and 10^9 values
once walked (a type check that renders the value, a dump). PyYAML shares the repeated subtree
in memory, so the damage comes later, from whatever walks it. Hence three bounds, checked on
libyaml's event stream before anything is built:

- the file: at most :data:`MAX_BYTES` (a recipe is a few KiB);
- the values: at most :data:`MAX_VALUES` once every alias is expanded (a resolved run config
  has about 400); counted as the events come, so a bomb stops at the first level past it;
- nesting: at most :data:`MAX_DEPTH` levels (the composer recurses per level).

Counting events rather than composing nodes: libyaml emits about 2 million events a second,
PyYAML's pure-Python composer about 15,000 nodes.
"""

from __future__ import annotations

import os
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1 << 20  # 1 MiB
MAX_VALUES = 10_000  # scalars, lists and mappings of the document, aliases expanded
MAX_DEPTH = 32

# libyaml when installed (the wheels ship it), the pure-Python parser otherwise
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 2, 80, 80
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxdict = _BRIEF.maxset = 4
_BRIEF.maxlong = 40


class YamlError(ValueError):
    """A YAML text too large, too deep, expanding past the budget or not valid YAML."""


def brief(value: Any) -> str:
    """``repr(value)`` cut to at most a few hundred characters (long strings and containers are
    shortened with ``...``): how an error message shows a value it did not choose."""
    return _BRIEF.repr(value)


def read_yaml_file(path: str | Path, what: str = "recipe") -> Any:
    """The data of the YAML file ``path`` (``None`` for an empty file), within the bounds above;
    ``what`` names the kind of file in errors. Raises :class:`YamlError` (one line, naming the
    file) or ``OSError``."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_BYTES:
            raise YamlError(f"{path}: {size:,} bytes; a {what} may have at most {MAX_BYTES:,}")
        raw = f.read(MAX_BYTES + 1)  # a device or a pipe reports no size
    if len(raw) > MAX_BYTES:
        raise YamlError(f"{path}: more than {MAX_BYTES:,} bytes; a {what} may have at most that")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise YamlError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})") from None
    return parse_yaml(text, str(path))


def parse_yaml(text: str, where: str) -> Any:
    """The data of a YAML ``text``; ``where`` (a file name, or ``override 'k=v'``) starts every
    error. Bounded like :func:`read_yaml_file` (the caller bounds the text's length)."""
    try:
        _check_expansion(text, where)
        return yaml.load(text, Loader=_LOADER)
    except yaml.MarkedYAMLError as error:
        raise YamlError(f"{where}{_at(error.problem_mark)}: not valid YAML: {error.problem}") from None
    except yaml.YAMLError as error:
        raise YamlError(f"{where}: not valid YAML: {_one_line(str(error))}") from None


@dataclass
class _Open:
    """A list or mapping whose end event has not come yet."""

    anchor: str | None
    mapping: bool
    path: str
    values: int = 1  # itself, plus everything in it, aliases expanded
    items: int = 0  # events directly inside (a mapping alternates key, value)
    key: str = field(default="")


def _check_expansion(text: str, where: str) -> None:
    """Walk the event stream once: raise :class:`YamlError` when the values (aliases expanded)
    pass :data:`MAX_VALUES` or the nesting passes :data:`MAX_DEPTH`, naming the key where."""
    anchors: dict[str, int] = {}  # anchor -> the values its subtree holds, expanded
    stack: list[_Open] = []
    total = 0
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.CollectionStartEvent):
            path = _child_path(stack)
            _note_key(stack, None)
            stack.append(_Open(event.anchor, isinstance(event, yaml.MappingStartEvent), path))
            total += 1
            if len(stack) > MAX_DEPTH:
                raise YamlError(f"{where}{_at(event.start_mark)}: {path or 'the document'} nests more "
                                f"than {MAX_DEPTH} levels deep")  # fmt: skip
        elif isinstance(event, yaml.CollectionEndEvent):
            done = stack.pop()
            if done.anchor is not None:
                anchors[done.anchor] = done.values
            if stack:
                stack[-1].values += done.values
        elif isinstance(event, yaml.ScalarEvent | yaml.AliasEvent):
            path = _child_path(stack)
            values = _values_of(event, anchors, stack, f"{where}{_at(event.start_mark)}: {path}")
            _note_key(stack, event.value if isinstance(event, yaml.ScalarEvent) else "*")
            if stack:
                stack[-1].values += values
            total += values
        else:
            continue
        if total > MAX_VALUES:
            raise YamlError(
                f"{where}{_at(event.start_mark)}: {path or 'the document'}: the YAML expands to more "
                f"than {MAX_VALUES:,} values (an alias *x repeats all of its anchor's values); a recipe "
                "holds a few hundred"
            )


def _values_of(event: yaml.Event, anchors: dict[str, int], stack: list[_Open], where: str) -> int:
    """The values a scalar (1) or an alias (its anchor's, expanded) adds to the document."""
    if isinstance(event, yaml.ScalarEvent):
        if event.anchor is not None:
            anchors[event.anchor] = 1
        return 1
    name = getattr(event, "anchor", None) or ""
    if any(o.anchor == name for o in stack):
        raise YamlError(f"{where}: the alias *{name} repeats a collection that contains it (endless)")
    return anchors.get(name, 1)  # an undefined one: the loader names it


def _child_path(stack: list[_Open]) -> str:
    """The dotted key of the next value inside the innermost open collection."""
    if not stack:
        return ""
    top = stack[-1]
    if top.mapping:
        if top.items % 2 == 0:  # a key: named by its mapping
            return top.path
        return f"{top.path}.{top.key}" if top.path else top.key
    return f"{top.path}[{top.items}]"


def _note_key(stack: list[_Open], scalar: str | None) -> None:
    if not stack:
        return
    top = stack[-1]
    if top.mapping and top.items % 2 == 0:
        top.key = brief(scalar)[1:-1] if scalar is not None and len(scalar) > 80 else (scalar or "?")
    top.items += 1


def _at(mark: Any) -> str:
    return f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""


def _one_line(message: str) -> str:
    return " ".join(message.split())[:500]
