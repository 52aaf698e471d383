"""Sampler settings on the wire: ``flowgrpo.v1.SamplerParams`` <-> :class:`SamplerParams`,
and the checks of the other request fields that the rollout and the trainer both read.

One conversion for the rollout (which samples with them) and the trainer (which recomputes
log-probs with them), so both read the same settings the same way. Every value is checked where
the request comes in, before any work: a bad one raises :class:`FieldError` naming the field
and the range it must lie in (the services answer INVALID_ARGUMENT and keep serving).

The ranges: what the checkpoint can take (:class:`ModelLimits`: image side, prompt length,
vocabulary), what the math is defined for (interval ends and renorm floors in [0, 1], CPS noise
<= 1), and generous bounds on the rest that keep a request's work and memory bounded
(``MAX_NUM_POINTS`` schedule points, CFG scales <= ``MAX_CFG_SCALE``). Floats are always finite.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from flowgrpo.bus import TensorRef
from flowgrpo.bus.dtypes import STORAGE
from flowgrpo.bus.refs import endpoint_problem
from flowgrpo.models.bagel.config import BagelConfig
from flowgrpo.models.bagel.sampling import PIXELS_PER_TOKEN, SamplerParams
from flowgrpo.sampler_math import CfgParams, WindowParams
from flowgrpo.v1 import common_pb2

CHOICES = {
    "cfg_renorm_type": ("global", "channel", "text_channel"),
    "sde_type": ("sde", "cps"),
    "window_strategy": ("random", "fixed", "progressive"),
}
MAX_NUM_POINTS = 1000  # schedule points (the recipes use 10-50)
SHIFT_RANGE = (0.01, 100.0)  # timestep_shift: t <- s t / (1 + (s - 1) t) needs s > 0
MAX_CFG_SCALE = 100.0  # cfg_text_scale, cfg_img_scale (the recipes use 1-8)
MAX_NOISE_LEVEL = {"sde": 10.0, "cps": 1.0}  # CPS: sin(noise_level pi / 2) is defined up to 1
MAX_STEP = 2**31 - 1  # training steps, generation steps
MAX_VERSION = 2**53  # policy versions (exact in a double: metrics carry them)
MAX_SAMPLE_INDEX = 65535  # a sample's index within its prompt's group
MAX_ID_CHARS = 256  # prompt uids, release tags, weight names
MAX_KEY_CHARS = 1024  # bus keys
MAX_DIM = 2**31 - 1  # one dimension of a tensor on the bus
MAX_RANK = 8  # dimensions of a tensor whose shape is free (weights)
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


class FieldError(ValueError):
    """A request field outside what the service takes; the message names it and its range."""


@dataclass(frozen=True)
class ModelLimits:
    """What one checkpoint takes: images up to ``max_side`` pixels a side (a multiple of
    ``PIXELS_PER_TOKEN``), prompts of up to ``max_prompt_tokens`` ids below ``vocab``."""

    max_side: int
    max_prompt_tokens: int
    vocab: int
    token_dim: int  # features of one latent token (64 for BAGEL)

    @classmethod
    def of(cls, config: BagelConfig) -> ModelLimits:
        return cls(
            max_side=PIXELS_PER_TOKEN * config.max_latent_size,
            max_prompt_tokens=config.max_position_embeddings,
            vocab=config.vocab,
            token_dim=config.latent_token_dim,
        )


def sampler_params_from_proto(
    msg: common_pb2.SamplerParams, limits: ModelLimits, field: str = "SamplerParams"
) -> SamplerParams:
    """The checked settings; a bad value raises :class:`FieldError` naming ``field.<name>``."""
    for name, choices in CHOICES.items():
        value = getattr(msg, name)
        if value not in choices:
            raise FieldError(f"{field}.{name}={value!r} is not one of {', '.join(choices)}")
    check_int(f"{field}.num_points", msg.num_points, 2, MAX_NUM_POINTS)
    check_float(f"{field}.timestep_shift", msg.timestep_shift, *SHIFT_RANGE)
    check_float(f"{field}.cfg_text_scale", msg.cfg_text_scale, 0.0, MAX_CFG_SCALE)
    check_float(f"{field}.cfg_img_scale", msg.cfg_img_scale, 0.0, MAX_CFG_SCALE)
    check_float(f"{field}.cfg_interval_lo", msg.cfg_interval_lo, 0.0, 1.0)
    check_float(f"{field}.cfg_interval_hi", msg.cfg_interval_hi, msg.cfg_interval_lo, 1.0)
    check_float(f"{field}.cfg_renorm_min", msg.cfg_renorm_min, 0.0, 1.0)
    check_float(f"{field}.noise_level", msg.noise_level, 0.0, MAX_NOISE_LEVEL[msg.sde_type])
    _check_window(field, msg)
    for name in ("height", "width"):
        _check_side(f"{field}.{name}", getattr(msg, name), limits)
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
        raise FieldError(f"{field}: {error}") from None
    return params


def _check_window(field: str, msg: common_pb2.SamplerParams) -> None:
    size, lo, hi, steps = msg.sde_window_size, msg.sde_window_lo, msg.sde_window_hi, msg.num_points - 1
    if size < 1:
        name, value = "sde_window_size", size
    elif lo < 0:
        name, value = "sde_window_lo", lo
    elif hi > steps:
        name, value = "sde_window_hi", hi
    elif lo + size > hi:
        name, value = "sde_window_size", size
    else:
        return
    raise FieldError(
        f"{field}.{name}={value} (window size {size} in [{lo}, {hi}]): need sde_window_size >= 1 and "
        f"0 <= sde_window_lo, sde_window_lo + sde_window_size <= sde_window_hi <= num_points - 1 = {steps}"
    )


def _check_side(field: str, pixels: int, limits: ModelLimits) -> None:
    if pixels < PIXELS_PER_TOKEN or pixels > limits.max_side or pixels % PIXELS_PER_TOKEN:
        raise FieldError(
            f"{field}={pixels} must be a multiple of {PIXELS_PER_TOKEN} in [{PIXELS_PER_TOKEN}, "
            f"{limits.max_side}] (this checkpoint's latent grid is at most "
            f"{limits.max_side // PIXELS_PER_TOKEN} tokens of {PIXELS_PER_TOKEN} px a side)"
        )


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


# --- scalar fields ---------------------------------------------------------------------------


def check_int(field: str, value: int, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise FieldError(f"{field}={value} is out of range: need {lo} <= {_leaf(field)} <= {hi}")
    return value


def check_float(field: str, value: float, lo: float, hi: float) -> float:
    if not (math.isfinite(value) and lo <= value <= hi):
        raise FieldError(
            f"{field}={value!r} is out of range: need a finite {lo:g} <= {_leaf(field)} <= {hi:g}"
        )
    return value


def check_id(field: str, value: str, most: int = MAX_ID_CHARS) -> str:
    """A non-empty printable name of at most ``most`` characters (uids, tags, tensor names)."""
    if not value or len(value) > most or not value.isprintable():
        raise FieldError(
            f"{field}={value[:64]!r}{'...' if len(value) > 64 else ''}: need 1 to {most} printable characters"
        )
    return value


def _leaf(field: str) -> str:
    return field.rpartition(".")[2]


# --- bus references --------------------------------------------------------------------------


def check_ref(
    field: str,
    msg: common_pb2.TensorRef,
    column: str,
    dtypes: Sequence[str],
    *,
    dims: Sequence[tuple[int, int]] | None,
    max_bytes: int,
) -> TensorRef:
    """A reference the service may fetch: a well-formed endpoint and key, the expected column
    and dtype, ``dims`` (an inclusive range per dimension; None: up to ``MAX_RANK`` dimensions
    of at most ``MAX_DIM``), and ``nbytes`` that is the shape's size, at most ``max_bytes``."""
    problem = endpoint_problem(msg.endpoint)
    if problem is not None:
        raise FieldError(f"{field}.endpoint={msg.endpoint[:80]!r}: {problem}")
    check_id(f"{field}.key", msg.key, MAX_KEY_CHARS)
    check_id(f"{field}.store_id", msg.store_id)
    if msg.column != column:
        raise FieldError(f"{field}.column={msg.column[:64]!r}: this field takes column {column!r}")
    if msg.dtype not in dtypes:
        raise FieldError(f"{field}.dtype={msg.dtype[:64]!r}: need one of {', '.join(dtypes)}")
    shape = list(msg.shape)
    if dims is None and len(shape) > MAX_RANK:
        raise FieldError(f"{field}.shape has {len(shape)} dimensions: need at most {MAX_RANK}")
    ranges = dims if dims is not None else [(0, MAX_DIM)] * len(shape)
    if len(shape) != len(ranges) or any(not lo <= n <= hi for n, (lo, hi) in zip(shape, ranges, strict=True)):
        want = ", ".join(str(lo) if lo == hi else f"{lo}..{hi}" for lo, hi in ranges)
        raise FieldError(f"{field}.shape={shape[:8]}: need [{want}]")
    size = STORAGE[msg.dtype].itemsize * math.prod(shape)
    if msg.nbytes != size or size > max_bytes:
        raise FieldError(
            f"{field}.nbytes={msg.nbytes}: {msg.dtype}{shape} is {size} bytes; a tensor holds at most "
            f"{max_bytes} (bus.max_bytes)"
        )
    check_int(f"{field}.policy_version", msg.policy_version, -1, MAX_VERSION)
    return TensorRef.from_proto(msg)


# --- fetched tensors -------------------------------------------------------------------------


def check_token_ids(field: str, ids: Tensor, vocab: int) -> None:
    """Prompt ids the embedding can look up: each in [0, vocab)."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise FieldError(
            f"{field}: ids from {int(ids.min())} to {int(ids.max())}; need 0 <= id < {vocab} (the vocabulary)"
        )


def check_finite(field: str, tensor: Tensor, lo: float = -math.inf, hi: float = math.inf) -> None:
    """Every element finite (and within [lo, hi])."""
    if not bool(tensor.isfinite().all()):
        raise FieldError(f"{field}: the tensor holds NaN or infinite values; need finite values")
    if tensor.numel() and (float(tensor.min()) < lo or float(tensor.max()) > hi):
        raise FieldError(
            f"{field}: values from {float(tensor.min())} to {float(tensor.max())}; need [{lo:g}, {hi:g}]"
        )
