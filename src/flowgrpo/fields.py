"""Checks of the values that come in from outside (requests, recipes): each names the field and
the range it must lie in, so a bad value is refused before any work with an error a user can act
on. Torch-free: the coordinator and the reward service use them too."""

from __future__ import annotations

import math
from collections.abc import Sequence

from flowgrpo.yamlfile import brief

MAX_ID_CHARS = 256  # prompt uids, release tags, weight names


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
