"""The one definition of the sampler settings: the wire message mirrors it field for field, the
conversion round-trips every value, and the recipe and the wire refuse the same bad values."""

from __future__ import annotations

import dataclasses
import math

import pytest

from flowgrpo.config import ConfigError, apply_overrides
from flowgrpo.configs.run import RunConfig, SamplingConfig
from flowgrpo.fields import FieldError
from flowgrpo.sampler_params import SamplerParams, SamplerSettings
from flowgrpo.v1 import common_pb2

# a value of every field, each different from its default (a field the conversion dropped
# would come back as the default and fail the round trip)
CHANGED = {
    "num_points": 9, "timestep_shift": 2.5, "cfg_text_scale": 3.5, "cfg_img_scale": 1.25,
    "cfg_interval": (0.125, 0.875), "cfg_renorm_type": "channel", "cfg_renorm_min": 0.5,
    "sde_type": "cps", "noise_level": 0.75, "window_size": 3, "window_range": (1, 6),
    "window_strategy": "progressive", "deterministic": True, "branch": True, "batch_invariant": True,
    "height": 48, "width": 80,
    "decode_images": False,
}  # fmt: skip


def test_the_wire_message_has_exactly_the_fields_of_the_dataclass() -> None:
    wire = {f.name for f in common_pb2.SamplerParams.DESCRIPTOR.fields}
    expected: set[str] = set()
    for f in dataclasses.fields(SamplerParams):
        pair = isinstance(f.default, tuple)
        expected |= {f"{f.name}_lo", f"{f.name}_hi"} if pair else {f.name}
    assert wire == expected
    assert set(CHANGED) == {f.name for f in dataclasses.fields(SamplerParams)}


def test_every_field_round_trips_through_the_wire() -> None:
    params = SamplerParams(**CHANGED)  # type: ignore[arg-type]
    assert all(getattr(params, k) != getattr(SamplerParams(), k) for k in CHANGED)
    msg = params.to_proto()
    assert (msg.cfg_interval_lo, msg.window_range_hi, msg.sde_type, msg.branch) == (0.125, 6, "cps", True)
    assert SamplerParams.from_proto(common_pb2.SamplerParams.FromString(msg.SerializeToString())) == params


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_points": 1}, "where.num_points=1"),
        ({"timestep_shift": math.nan}, "where.timestep_shift=nan"),
        ({"cfg_text_scale": 101.0}, "where.cfg_text_scale=101.0"),
        ({"cfg_interval": (0.5, 1.5)}, "where.cfg_interval[1]=1.5"),
        ({"cfg_interval": (0.8, 0.2)}, "where.cfg_interval=[0.8, 0.2]: need lo <= hi"),
        ({"cfg_renorm_type": "local"}, "where.cfg_renorm_type='local' is not one of global, channel"),
        ({"noise_level": -0.1}, "where.noise_level=-0.1"),
        ({"sde_type": "cps", "noise_level": 1.5}, "where.noise_level=1.5"),
        ({"window_size": 0}, "where.window_size=0"),
        ({"window_range": (-1, 7)}, "where.window_range[0]=-1"),
        ({"window_range": (0, 15)}, "where.window_range=[0, 15] does not fit a schedule of 14 steps"),
        ({"window_size": 8}, "where.window_size=8 in where.window_range=[0, 7]"),
        ({"height": 0}, "where.height=0"),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(change: dict[str, object], named: str) -> None:
    params = dataclasses.replace(SamplerParams(), **change)  # type: ignore[arg-type]
    with pytest.raises(FieldError) as caught:
        params.check("where")
    assert named in str(caught.value)
    with pytest.raises(FieldError, match="SamplerParams"):  # the wire refuses it alike
        SamplerParams.from_proto(params.to_proto())


def test_the_recipe_refuses_what_the_wire_refuses() -> None:
    with pytest.raises(ConfigError, match=r"sampling\.cfg_text_scale=1000.0 is out of range"):
        apply_overrides(RunConfig(), ["data.prompts=p", "sampling.cfg_text_scale=1000"])
    with pytest.raises(ConfigError, match=r"sampling\.cfg_interval\[1\]=2.0"):
        apply_overrides(RunConfig(), ["data.prompts=p", "sampling.cfg_interval=[0, 2]"])


def test_the_runs_settings_reach_the_rollout_and_validation_uses_the_ode() -> None:
    knobs = {f.name for f in dataclasses.fields(SamplerSettings)}
    changed = {k: v for k, v in CHANGED.items() if k in knobs}
    sampling = SamplingConfig(**changed, resolution=96, eval_num_points=12)  # type: ignore[arg-type]
    sampling.validate()
    train = sampling.params()
    assert {k: getattr(train, k) for k in knobs} == changed
    assert (train.height, train.width, train.decode_images) == (96, 96, True)
    val = sampling.params(evaluation=True)
    assert (val.num_points, val.noise_level, val.window_size, val.window_range) == (12, 0.0, 1, (0, 11))
    assert (val.cfg_text_scale, val.cfg_renorm_type, val.deterministic) == (3.5, "channel", True)
    assert train.branch and not val.branch  # validation: every run's images from the same noise


def test_branching_is_a_dotted_override_of_a_run_and_reaches_the_wire() -> None:
    config = apply_overrides(RunConfig(), ["data.prompts=p", "sampling.branch=true"])
    assert config.sampling.branch and config.sampling.params().to_proto().branch
    assert not RunConfig().sampling.params().to_proto().branch  # off unless asked for
