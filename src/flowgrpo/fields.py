"""Checks of the values that come in from outside (requests, recipes): each names the field and
the range it must lie in, so a bad value is refused before any work with an error a user can act
on. Torch-free: the coordinator and the reward service use them too."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from flowgrpo.yamlfile import brief

MAX_ID_CHARS = 256  # prompt uids, release tags, weight names
SEED_MAX = 2**63 - 1  # seeds: what torch.manual_seed and numpy take


class FieldError(ValueError):
    """A field outside what the service takes; the message names it and its range."""


def check_int(field: str, value: int, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise FieldError(f"{field}={value} is out of range: need {lo} <= {_leaf(field)} <= {hi}")
    return value


def check_float(field: str, value: float, lo: float, hi: float) -> float:
    if not (math.isfinite(value) and lo <= value <= hi):
        raise FieldError(
            f"{field}={brief(value)} is out of range: need a finite {lo:g} <= {_leaf(field)} <= {hi:g}"
        )
    return value


def knob(default: Any, lo: float, hi: float, *, infinite: bool = False) -> Any:
    """A numeric dataclass field and its range: each number it holds (each end of a pair) must
    lie in [lo, hi]; floats finite unless ``infinite`` (then +-inf passes where an end is
    infinite: "no limit"). :func:`check_ranges` checks every such field of a config."""
    return dataclasses.field(default=default, metadata={"range": (lo, hi), "infinite": infinite})


def check_ranges(cfg: Any, where: str) -> None:
    """Check every :func:`knob` field of the dataclass ``cfg`` (not nested ones), naming each
    ``where.field``; raises FieldError at the first out of range."""
    for f in dataclasses.fields(cfg):
        if "range" not in f.metadata:
            continue
        lo, hi = f.metadata["range"]
        value, name = getattr(cfg, f.name), f"{where}.{f.name}" if where else f.name
        if isinstance(value, tuple | list):  # a pair: each end, named by its index
            for i, number in enumerate(value):
                _check_number(f"{name}[{i}]", number, lo, hi, f.metadata["infinite"])
        else:
            _check_number(name, value, lo, hi, f.metadata["infinite"])


def _check_number(name: str, number: float, lo: float, hi: float, infinite: bool) -> None:
    if infinite and math.isinf(number) and number in (lo, hi):
        return
    if isinstance(number, int) and not isinstance(number, bool):
        check_int(name, number, int(lo), int(hi))  # an int field's ends are finite
    else:
        check_float(name, number, lo, hi)


def check_choice(field: str, value: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise FieldError(f"{field}={brief(value)} is not one of {', '.join(choices)}")
    return value


def check_id(field: str, value: str, most: int = MAX_ID_CHARS) -> str:
    """A non-empty printable name of at most ``most`` characters (uids, tags, tensor names)."""
    if not value or len(value) > most or not value.isprintable():
        raise FieldError(f"{field}={brief(value)}: need 1 to {most} printable characters")
    return value


def _leaf(field: str) -> str:
    return field.rpartition(".")[2]
