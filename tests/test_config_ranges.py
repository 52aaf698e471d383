"""Every numeric field of every config section has a range, checked by one mechanism
(``flowgrpo.fields.knob`` + ``check_ranges``, run by ``flowgrpo.config.validate``): the walk
below finds each int and float field (pairs included) of the run config and of each service's
config, and proves that a value past either end, and NaN, is refused through the command line's
own path (a dotted override), in one line naming the key. The default passes (the control)."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterator
from typing import Any

import pytest

from flowgrpo.config import ConfigError, load_config
from flowgrpo.configs.reward import RewardServiceConfig
from flowgrpo.configs.rollout import RolloutServiceConfig
from flowgrpo.configs.run import RunConfig
from flowgrpo.configs.trainer import TrainerServiceConfig
from flowgrpo.runtime.config import ClientConfig
from flowgrpo.services.trainer.sft_config import SftConfig

# the run's recipe, each service's own config, the gRPC client's (open_channel), flowgrpo sft's
CONFIGS: list[type[Any]] = [
    RunConfig, TrainerServiceConfig, RolloutServiceConfig, RewardServiceConfig, ClientConfig, SftConfig
]  # fmt: skip
# what each needs set to be valid at all (no file is opened by these checks)
BASE: dict[type[Any], list[str]] = {
    RunConfig: ["data.prompts=prompts"],
    TrainerServiceConfig: ["trainer.checkpoint=bagel"],
    RolloutServiceConfig: ["rollout.checkpoint=bagel"],
    SftConfig: ["model=bagel", "data.images=pairs"],
}
NUMBERS = (int, float, tuple[int, int], tuple[float, float])


@dataclasses.dataclass(frozen=True)
class NumericField:
    config: type[Any]
    key: str  # dotted; "[0]" for the first item of a list of sections
    hint: Any
    field: dataclasses.Field[Any]
    select: tuple[str, ...] = ()  # the overrides that pick its section of a tagged union


def _variants(hint: Any) -> dict[str, Any]:
    """A tagged union's sections by name (``trainer.algorithm``), else {}."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return {}
    args = typing.get_args(hint)
    if not all(isinstance(a, type) and dataclasses.is_dataclass(a) for a in args):
        return {}
    return {typing.get_args(typing.get_type_hints(a)["name"])[0]: a for a in args}


def _section(hint: Any) -> Any:
    """The dataclass a field holds (X | None and list[X] unwrapped), else None."""
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def numeric_fields(
    config: type[Any], cls: type[Any], prefix: str = "", select: tuple[str, ...] = ()
) -> Iterator[NumericField]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], f"{prefix}{f.name}"
        variants, section = _variants(hint), _section(hint)
        if variants:  # every section of the union, each picked by its name
            for name, variant in variants.items():
                yield from numeric_fields(config, variant, f"{key}.", (*select, f"{key}={name}"))
        elif section is not None:
            item = "[0]" if typing.get_origin(hint) is list else ""
            yield from numeric_fields(config, section, f"{key}{item}.", select)
        elif hint in NUMBERS:
            yield NumericField(config, key, hint, f, select)


FIELDS = [nf for config in CONFIGS for nf in numeric_fields(config, config)]


def test_the_walk_finds_the_sections_it_must() -> None:
    """Guards the walk itself: a section it missed would pass every check below unseen."""
    keys = {nf.key for nf in FIELDS if nf.config is RunConfig}
    for key in ("trainer.optim.lr", "trainer.optim.betas", "reward.scorers[0].weight",
                "reward.ocr.judge.max_retries", "bus.chunk_bytes", "sampling.num_points",
                "launch.start_timeout_s", "trainer.keep_last"):  # fmt: skip
        assert key in keys
    assert len(keys) >= 90, len(keys)
    picked = {(nf.key, nf.select) for nf in FIELDS if nf.config is RunConfig and nf.select}
    for name in ("diffusion_nft", "dgpo"):  # each algorithm's own beta, its section picked by name
        assert ("trainer.algorithm.beta", (f"trainer.algorithm={name}",)) in picked
    assert ("trainer.algorithm.train_times", ("trainer.algorithm=awm",)) in picked
    service_keys = {nf.key for nf in FIELDS if nf.config is TrainerServiceConfig}
    assert {"server.concurrency", "orphan_after_s", "trainer.optim.lr"} <= service_keys
    assert any(nf.key == "default_deadline_s" for nf in FIELDS if nf.config is ClientConfig)


@pytest.mark.parametrize("nf", FIELDS, ids=[f"{nf.config.__name__}:{nf.key}" for nf in FIELDS])
def test_every_numeric_field_has_a_range_and_refuses_what_lies_outside(nf: NumericField) -> None:
    assert "range" in nf.field.metadata, f"{nf.key} has no range: declare it with flowgrpo.fields.knob"
    lo, hi = nf.field.metadata["range"]
    base = [*BASE.get(nf.config, []), *nf.select]
    assert load_config(nf.config, overrides=base)  # the defaults pass
    integer = nf.hint in (int, tuple[int, int])
    outside: list[Any] = [lo - 1 if integer else _below(lo), hi + 1 if integer else _above(hi)]
    if not integer:
        outside.append(math.nan)
    for value in outside:
        if isinstance(value, float) and math.isinf(value) and nf.field.metadata["infinite"]:
            continue  # an unbounded end: nothing lies past it
        with pytest.raises(ConfigError) as refused:
            load_config(nf.config, overrides=[*base, _override(nf, value)])
        message = str(refused.value)
        assert "\n" not in message and len(message) < 1000
        assert nf.key in message, message


def _below(lo: float) -> float:
    return -math.inf if math.isinf(lo) else lo - max(1.0, abs(lo))


def _above(hi: float) -> float:
    return math.inf if math.isinf(hi) else hi + max(1.0, abs(hi))


def _override(nf: NumericField, value: float) -> str:
    text = _yaml_number(value)
    if nf.hint in (tuple[int, int], tuple[float, float]):
        text = f"[{text}, {text}]"
    if "[0]." in nf.key:  # a list of sections: the whole list, one item holding the value
        head, _, leaf = nf.key.partition("[0].")
        return f"{head}=[{{{leaf}: {text}}}]"
    return f"{nf.key}={text}"


def _yaml_number(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return ".nan"
    if isinstance(value, float) and math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    return repr(value)
