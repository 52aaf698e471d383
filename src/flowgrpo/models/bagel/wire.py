"""Sampler settings on the wire: ``flowgrpo.v1.SamplerParams`` <-> :class:`SamplerParams`.

One conversion for the rollout (which samples with them) and the trainer (which recomputes
log-probs with them), so both read the same settings the same way.
"""

from __future__ import annotations

from flowgrpo.models.bagel.sampling import SamplerParams
from flowgrpo.sampler_math import CfgParams, WindowParams
from flowgrpo.v1 import common_pb2

CHOICES = {
    "cfg_renorm_type": ("global", "channel", "text_channel"),
    "sde_type": ("sde", "cps"),
    "window_strategy": ("random", "fixed", "progressive"),
}


def sampler_params_from_proto(msg: common_pb2.SamplerParams) -> SamplerParams:
    """The checked settings; a bad value raises ValueError naming the field."""
    for name, choices in CHOICES.items():
        value = getattr(msg, name)
        if value not in choices:
            raise ValueError(f"SamplerParams.{name}={value!r} is not one of {', '.join(choices)}")
    params = SamplerParams(
        num_points=msg.num_points,
        shift=msg.timestep_shift,
        cfg=CfgParams(
            text_scale=msg.cfg_text_scale,
            img_scale=msg.cfg_img_scale,
            interval=(msg.cfg_interval_lo, msg.cfg_interval_hi),
            renorm_type=msg.cfg_renorm_type,  # type: ignore[arg-type]
            renorm_min=msg.cfg_renorm_min,
        ),
        sde_type=msg.sde_type,  # type: ignore[arg-type]
        noise_level=msg.noise_level,
        window=WindowParams(
            size=msg.sde_window_size,
            lo=msg.sde_window_lo,
            hi=msg.sde_window_hi,
            strategy=msg.window_strategy,  # type: ignore[arg-type]
        ),
        height=msg.height,
        width=msg.width,
        deterministic=msg.deterministic,
        decode_images=msg.decode_images,
    )
    try:
        params.validate()
    except ValueError as error:
        raise ValueError(f"SamplerParams: {error}") from None
    return params


def sampler_params_to_proto(params: SamplerParams) -> common_pb2.SamplerParams:
    return common_pb2.SamplerParams(
        num_points=params.num_points,
        timestep_shift=params.shift,
        cfg_text_scale=params.cfg.text_scale,
        cfg_img_scale=params.cfg.img_scale,
        cfg_interval_lo=params.cfg.interval[0],
        cfg_interval_hi=params.cfg.interval[1],
        cfg_renorm_type=params.cfg.renorm_type,
        cfg_renorm_min=params.cfg.renorm_min,
        sde_type=params.sde_type,
        noise_level=params.noise_level,
        sde_window_size=params.window.size,
        sde_window_lo=params.window.lo,
        sde_window_hi=params.window.hi,
        window_strategy=params.window.strategy,
        height=params.height,
        width=params.width,
        deterministic=params.deterministic,
        decode_images=params.decode_images,
    )
