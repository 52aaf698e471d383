"""Typed configs: recipes and dotted overrides build dataclasses strictly."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from flowgrpo.config import ConfigError, apply_overrides, dump_yaml, load_config, to_dict


class Mode(enum.Enum):
    SYNC = "sync"
    ASYNC = "async"


@dataclass
class Optim:
    lr: float = 1e-4
    eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.999)


@dataclass
class Trainer:
    optim: Optim = field(default_factory=Optim)
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj_moe_gen"])
    offload: bool = False
    checkpoint_dir: str | None = None


@dataclass
class Rollout:
    batch_size: int = 8
    group_size: int = 4
    sde_type: Literal["sde", "cps"] = "sde"

    def validate(self) -> None:
        if self.batch_size % self.group_size:
            raise ValueError(
                f"rollout.batch_size={self.batch_size} is not divisible by rollout.group_size="
                f"{self.group_size}; set batch_size to a multiple of group_size"
            )


@dataclass
class Run:
    mode: Mode = Mode.SYNC
    rollout: Rollout = field(default_factory=Rollout)
    trainer: Trainer = field(default_factory=Trainer)
    labels: dict[str, str] = field(default_factory=dict)


def test_overrides_set_nested_values_with_types() -> None:
    cfg = apply_overrides(
        Run(),
        [
            "rollout.batch_size=16",
            "trainer.optim.lr=3e-5",
            "trainer.optim.betas=[0.8, 0.9]",
            "trainer.lora_targets=[a, b]",
            "trainer.offload=true",
            "trainer.checkpoint_dir=/tmp/ck",
            "mode=async",
            "rollout.sde_type=cps",
            "labels={team: rl}",
        ],
    )
    assert cfg.rollout.batch_size == 16
    assert cfg.trainer.optim.lr == pytest.approx(3e-5)
    assert cfg.trainer.optim.betas == (0.8, 0.9)
    assert cfg.trainer.lora_targets == ["a", "b"]
    assert cfg.trainer.offload is True
    assert cfg.trainer.checkpoint_dir == "/tmp/ck"
    assert cfg.mode is Mode.ASYNC
    assert cfg.labels == {"team": "rl"}
    assert Run().rollout.batch_size == 8, "the input config is not mutated"


def test_int_is_accepted_for_float_and_null_for_optional() -> None:
    cfg = apply_overrides(Run(), ["trainer.optim.lr=1", "trainer.checkpoint_dir=null"])
    assert cfg.trainer.optim.lr == 1.0 and isinstance(cfg.trainer.optim.lr, float)
    assert cfg.trainer.checkpoint_dir is None


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("trainer.optim.learning_rate=1", ["unknown key 'trainer.optim.learning_rate'", "lr, eps, betas"]),
        ("rollout.batchsize=4", ["did you mean rollout.batch_size?"]),
        ("rollout.batch_size=eight", ["rollout.batch_size: expected int, got str 'eight'"]),
        ("rollout.batch_size=2.5", ["rollout.batch_size: expected int"]),
        ("trainer.offload=3", ["trainer.offload: expected bool"]),
        ("rollout.sde_type=ode", ["rollout.sde_type: 'ode' is not one of 'sde', 'cps'"]),
        ("mode=fast", ["mode: 'fast' is not one of ['sync', 'async']"]),
        ("trainer.optim.betas=[1, 2, 3]", ["expected 2 items"]),
        ("rollout.batch_size", ["is not of the form section.key=value"]),
        ("rollout.batch_size.x=1", ["'rollout.batch_size' is a int, not a section"]),
        ("rollout.batch_size=6", ["not divisible by rollout.group_size=4", "multiple of group_size"]),
    ],
)
def test_bad_overrides_name_the_key_and_the_fix(override: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        apply_overrides(Run(), [override])
    for fragment in fragments:
        assert fragment in str(err.value)


def test_recipe_file_round_trip_and_errors(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("rollout:\n  batch_size: 12\n  group_size: 4\ntrainer:\n  optim:\n    eps: 1.0e-15\n")
    cfg = load_config(Run, recipe, ["trainer.optim.lr=2e-4"])
    assert (cfg.rollout.batch_size, cfg.trainer.optim.eps, cfg.trainer.optim.lr) == (12, 1e-15, 2e-4)

    resolved = tmp_path / "run" / "config.yaml"
    dump_yaml(cfg, resolved)
    assert load_config(Run, resolved) == cfg
    assert yaml.safe_load(resolved.read_text())["mode"] == "sync"

    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  group_sise: 4\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'rollout.group_sise'; did you mean"):
        load_config(Run, bad)
    bad.write_text("rollout: [1, 2]\n")
    with pytest.raises(ConfigError, match="rollout: expected a mapping"):
        load_config(Run, bad)
    bad.write_text("rollout: {batch_size: 4\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Run, bad)


def test_to_dict_is_plain_data() -> None:
    data = to_dict(apply_overrides(Run(), ["mode=async"]))
    assert data["mode"] == "async"
    assert data["trainer"]["optim"]["betas"] == [0.9, 0.999]
    assert yaml.safe_load(yaml.safe_dump(data)) == data
