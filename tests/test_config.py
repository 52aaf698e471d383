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


# --- tagged unions: one section per kind, its name the tag ------------------------------------


@dataclass
class Plain:
    name: Literal["plain"] = "plain"


@dataclass
class Mixed:
    name: Literal["mixed"] = "mixed"
    beta: float = 1.0
    steps: int = 3


@dataclass
class Guided:
    name: Literal["guided"] = "guided"
    beta: float = 2.0
    scale: float = 4.0


@dataclass
class Job:
    method: Plain | Mixed | Guided = field(default_factory=Plain)
    seed: int = 0


def test_a_tagged_union_is_picked_by_its_name_and_takes_only_that_section_s_keys(tmp_path: Path) -> None:
    assert apply_overrides(Job(), ["method=mixed"]).method == Mixed()
    assert apply_overrides(Job(), ["method={name: guided, scale: 2}"]).method == Guided(scale=2.0)
    assert apply_overrides(Job(), ["method=guided", "method.scale=1.5"]).method == Guided(scale=1.5)
    recipe = tmp_path / "job.yaml"
    recipe.write_text("method:\n  name: mixed\n  steps: 7\n")
    assert load_config(Job, recipe).method == Mixed(steps=7)
    recipe.write_text("method: guided\n")
    assert load_config(Job, recipe).method == Guided()
    with pytest.raises(
        ConfigError, match=r"unknown key 'method.scale'.*valid keys under 'method': name, beta, steps"
    ):
        apply_overrides(Job(), ["method=mixed", "method.scale=2"])
    with pytest.raises(ConfigError, match=r"unknown key 'method.beta'.*valid keys under 'method': name\)"):
        apply_overrides(Job(), ["method.beta=2"])  # the default, plain, has no beta


def test_naming_the_section_s_own_kind_keeps_its_settings_and_another_kind_resets_them(
    tmp_path: Path,
) -> None:
    recipe = tmp_path / "job.yaml"
    recipe.write_text("method: {name: mixed, beta: 0.5}\n")
    assert load_config(Job, recipe, ["method=mixed"]).method == Mixed(beta=0.5)
    assert load_config(Job, recipe, ["method.name=mixed"]).method == Mixed(beta=0.5)
    assert load_config(Job, recipe, ["method=guided"]).method == Guided()  # not guided's beta 0.5
    assert load_config(Job, recipe, ["method.name=guided"]).method == Guided()
    assert load_config(Job, recipe, ["method={name: mixed}"]).method == Mixed()  # a mapping replaces


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("method=other", "method.name: 'other' is not one of 'plain', 'mixed', 'guided'"),
        ("method={beta: 2}", "method: the section has no name: add name: (one of plain, mixed, guided)"),
        ("method=null", "method: null is not a section; name one of plain, mixed, guided"),
        ("method=[1]", "method: expected a name (plain, mixed, guided) or a mapping, got [1]"),
        ("method.name=other", "method.name: 'other' is not one of"),
        ("method={name: [1, 2]}", "method.name: [1, 2] is not one of"),
        ("method={name: {a: 1}}", "method.name: {'a': 1} is not one of"),
    ],
)
def test_a_bad_tagged_union_names_the_key_and_the_choices(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        apply_overrides(Job(), [override])
    assert fragment in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_tagged_union_round_trips_through_its_recipe_file(tmp_path: Path) -> None:
    job = apply_overrides(Job(), ["method=guided", "method.beta=0.25", "seed=3"])
    dump_yaml(job, tmp_path / "job.yaml")
    assert yaml.safe_load((tmp_path / "job.yaml").read_text())["method"] == {
        "name": "guided",
        "beta": 0.25,
        "scale": 4.0,
    }
    assert load_config(Job, tmp_path / "job.yaml") == job


def test_a_key_of_a_deeper_section_is_named_by_its_path() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'lr'; did you mean trainer\.optim\.lr\?"):
        apply_overrides(Run(), ["lr=1e-4"])
    with pytest.raises(ConfigError, match=r"unknown key 'trainer\.eps'; did you mean trainer\.optim\.eps\?"):
        apply_overrides(Run(), ["trainer.eps=1e-8"])


def test_a_missing_recipe_names_the_closest_ones_beside_it(tmp_path: Path) -> None:
    (tmp_path / "tiny_demo.yaml").write_text("rollout:\n  batch_size: 8\n")
    (tmp_path / "other.yaml").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"no recipe at .*tiny_dmeo.yaml; did you mean .*tiny_demo.yaml\?$"):
        load_config(Run, tmp_path / "tiny_dmeo.yaml")
    with pytest.raises(ConfigError, match=r"no recipe at .*: the folder .*nowhere does not exist"):
        load_config(Run, tmp_path / "nowhere" / "recipe.yaml")
