"""User rewards: a Python function named as ``path/to/file.py:function`` or ``package.module:function``.

The function's signature::

    def my_reward(
        images: list[np.ndarray],          # uint8 [H, W, 3] RGB, one per sample
        prompts: list[str],
        ground_truths: list[str],          # caption or target text ("" when the data has none)
        metadata: list[dict[str, str]],    # per-sample metadata of the request
    ) -> Sequence[float] | tuple[Sequence[float], Mapping[str, Sequence[float]]]:

It returns one finite score per sample (a list, tuple or 1-D numpy array) and optionally a
mapping of extras (name -> one value per sample), logged as ``critic/<scorer>/<name>/mean``.
Load models once at module level (or behind ``functools.cache``): the module is imported once.

Failures become per-sample errors, never silent zeros: a wrong number of scores or extras, or
a result of the wrong type, fails every sample of the call; a NaN, an infinity or a non-number
fails its own sample. When the function raises on a batch of several samples, each sample is
tried alone, so only those it raises on fail (a function whose scores depend on the batch
should not raise).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flowgrpo.rewards.base import Outcome, Sample, SampleError, SampleScore, Scorer

log = logging.getLogger(__name__)

RewardFn = Callable[..., Any]
PARAMETERS = 4  # images, prompts, ground_truths, metadata


class PluginError(ValueError):
    """A plug-in cannot be loaded (bad target, missing file or function, wrong signature)."""


def load_plugin(target: str) -> RewardFn:
    """The function ``target`` names: ``path/to/file.py:function`` or ``package.module:function``."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise PluginError(
            f"plug-in {target!r}: expected 'path/to/file.py:function' or 'package.module:function'"
        )
    module = _load_file(Path(module_name)) if module_name.endswith(".py") else _import(module_name, target)
    fn = getattr(module, attr, None)
    if not callable(fn):
        public = ", ".join(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise PluginError(f"plug-in {target!r}: no function {attr!r} in {module_name} (it has: {public})")
    _check_signature(fn, target)
    loaded: RewardFn = fn
    return loaded


def _import(module_name: str, target: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise PluginError(f"plug-in {target!r}: cannot import {module_name}: {error}") from error


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise PluginError(f"plug-in file {path} does not exist (cwd {Path.cwd()})")
    resolved = path.resolve()
    # a unique, stable module name per file: two plug-ins called reward.py do not collide
    name = f"flowgrpo_plugin_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise PluginError(f"plug-in file {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _check_signature(fn: RewardFn, target: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: accept, checked at call time
        return
    try:
        signature.bind(*range(PARAMETERS))
    except TypeError as error:
        raise PluginError(
            f"plug-in {target!r}{signature} cannot be called as (images, prompts, ground_truths, "
            f"metadata): {error}"
        ) from None


class PluginScorer(Scorer):
    """A user reward function as a scorer, its results checked sample by sample."""

    def __init__(self, name: str, fn: RewardFn, target: str = "") -> None:
        self.name = name
        self.fn = fn
        self.target = target or getattr(fn, "__qualname__", repr(fn))

    @classmethod
    def load(cls, name: str, target: str) -> PluginScorer:
        return cls(name, load_plugin(target), target)

    def score(self, samples: Sequence[Sample]) -> list[Outcome]:
        try:
            return self._call(samples)
        except Exception as error:
            if len(samples) == 1:
                log.warning("plug-in %s raised", self.target, exc_info=True)
                return [self._raised(error)]
        # find the samples it raises on: each alone (the others keep their scores)
        return [outcome for sample in samples for outcome in self.score([sample])]

    def _call(self, samples: Sequence[Sample]) -> list[Outcome]:
        result = self.fn(
            [s.image for s in samples],
            [s.prompt for s in samples],
            [s.ground_truth for s in samples],
            [dict(s.metadata) for s in samples],
        )
        return check_result(result, len(samples), f"plug-in {self.name} ({self.target})")

    def _raised(self, error: Exception) -> SampleError:
        return SampleError(
            "internal",
            f"plug-in {self.name} ({self.target}) raised {type(error).__name__}: {error}",
        )


def check_result(result: object, size: int, who: str) -> list[Outcome]:
    """Per-sample outcomes of a plug-in's return value for ``size`` samples."""
    try:
        scores, extras = _columns(result, size)
    except _BadResult as error:
        return [SampleError("internal", f"{who} {error}")] * size
    return [_outcome(i, scores, extras, who) for i in range(size)]


class _BadResult(ValueError):
    pass


def _columns(result: object, size: int) -> tuple[list[Any], dict[str, list[Any]]]:
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
        scores, extras = result
    else:
        scores, extras = result, {}
    return (
        _column(scores, size, "scores"),
        {str(name): _column(values, size, f"extra {name!r}") for name, values in extras.items()},
    )


def _column(values: object, size: int, what: str) -> list[Any]:
    if isinstance(values, np.ndarray) and values.ndim == 1:
        values = values.tolist()
    if not isinstance(values, list | tuple):
        raise _BadResult(f"returned {what} as {type(values).__name__}; expected a sequence of {size} floats")
    if len(values) != size:
        raise _BadResult(f"returned {len(values)} {what} for {size} samples")
    return list(values)


def _outcome(i: int, scores: list[Any], extras: dict[str, list[Any]], who: str) -> Outcome:
    value = _finite(scores[i])
    if value is None:
        return SampleError("internal", f"{who} returned {scores[i]!r} for this sample; scores must be finite")
    values: dict[str, float] = {}
    for name, column in extras.items():
        extra = _finite(column[i])
        if extra is None:
            return SampleError("internal", f"{who} returned extra {name!r} = {column[i]!r}; must be finite")
        values[name] = extra
    return SampleScore(value, values)


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        return None
    number = float(value)
    return number if math.isfinite(number) else None
