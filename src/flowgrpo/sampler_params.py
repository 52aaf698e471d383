"""Sampler settings: the one definition of how a batch is sampled, in a recipe, on the wire and
in the sampler.

vLLM's single ``SamplingParams`` is the model: each knob is declared once, here, with its
default and its range. The recipe's ``sampling`` section (the coordinator's ``SamplingConfig``
extends :class:`SamplerSettings`), the gRPC message ``flowgrpo.v1.SamplerParams`` (the
conversion is derived from the fields: a field keeps its name on the wire, a pair ``x`` becomes
``x_lo`` and ``x_hi``) and what the rollout samples with and the trainer recomputes log-probs
with (:class:`SamplerParams`) are the same object, checked by the same :meth:`check`. A new knob
is a field here and a field of the same name in common.proto; tests/test_sampler_params.py
fails until the two agree. Torch-free: the coordinator imports it.

Ranges: what the math is defined for (interval ends and renorm floors in [0, 1], CPS noise
<= 1) and generous bounds on the rest that keep a request's work bounded. Floats are finite.
What one checkpoint can take (image sides, prompt lengths) is the model's to check
(``flowgrpo.models.bagel.wire``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal, Self

from flowgrpo.fields import FieldError, check_choice, check_float, check_int, knob
from flowgrpo.v1 import common_pb2

RenormType = Literal["global", "channel", "text_channel"]
SdeType = Literal["sde", "cps"]
WindowStrategy = Literal["random", "fixed", "progressive"]

MAX_NUM_POINTS = 1000  # schedule points (the recipes use 10-50)
MAX_CFG_SCALE = 100.0  # the recipes use 1-8
MAX_NOISE_LEVEL = 10.0  # SDE; CPS: sin(noise_level pi / 2) is defined up to 1
MAX_SIDE = 2**15  # pixels; a checkpoint's own limit is far lower (ModelLimits)


@dataclass(frozen=True)
class SamplerSettings:
    """How to sample, whatever the image size (defaults: the FlowGRPO BAGEL PickScore LoRA recipe).

    x_t = (1 - t) x0 + t eps on the schedule t <- s t / (1 + (s - 1) t); classifier-free guidance
    inside ``cfg_interval``; SDE (or CPS) steps with ``noise_level`` inside a window of
    ``window_size`` consecutive steps that begins in [lo, hi - window_size] of ``window_range``
    (per prompt group, by ``window_strategy``), the Euler ODE elsewhere. With ``branch`` the G
    samples of a group start from one initial noise, so the ODE steps before their shared window
    are one trajectory: computed once per group, then branched into the samples at the window.
    """

    num_points: int = knob(15, 2, MAX_NUM_POINTS)  # schedule points: num_points - 1 denoising steps
    timestep_shift: float = knob(3.0, 0.01, 100.0)
    cfg_text_scale: float = knob(4.0, 0.0, MAX_CFG_SCALE)
    cfg_img_scale: float = knob(1.0, 0.0, MAX_CFG_SCALE)
    cfg_interval: tuple[float, float] = knob((0.0, 1.0), 0.0, 1.0)  # CFG applies where lo < t <= hi
    cfg_renorm_type: RenormType = "global"
    cfg_renorm_min: float = knob(0.0, 0.0, 1.0)
    sde_type: SdeType = "sde"
    noise_level: float = knob(1.3, 0.0, MAX_NOISE_LEVEL)  # 0: the plain Euler ODE
    window_size: int = knob(2, 1, MAX_NUM_POINTS)  # consecutive stochastic (trained) steps
    window_range: tuple[int, int] = knob((0, 7), 0, MAX_NUM_POINTS)
    window_strategy: WindowStrategy = "random"
    deterministic: bool = False  # deterministic kernels, one sample per forward (bitwise on CPU)
    branch: bool = False  # a group's samples share their initial noise and the ODE steps before the window
    # every sample's forward in a batch of its own shape: its prompt prefilled alone, its (cond,
    # uncond) pair over its own cache length, so a sample's velocity, and its log-probs, do not
    # depend on what else shares the batch: a rollout's batch of 8 and a trainer's micro-batch of
    # 2 compute the same numbers (docs/algorithms.md, "exact log-prob ratios")
    batch_invariant: bool = False

    @property
    def num_steps(self) -> int:
        return self.num_points - 1

    def check(self, where: str) -> None:
        """Every field in its range, then the rules between fields; :class:`FieldError` names
        ``where.<field>``."""
        hints = _type_hints(type(self))
        for f in dataclasses.fields(self):
            _check_field(f"{where}.{f.name}", getattr(self, f.name), hints[f.name], f.metadata)
        if self.sde_type == "cps":
            check_float(f"{where}.noise_level", self.noise_level, 0.0, 1.0)
        lo, hi = self.window_range
        if lo + self.window_size > hi or hi > self.num_steps:
            raise FieldError(
                f"{where}.window_size={self.window_size} in {where}.window_range=[{lo}, {hi}] does not fit a "
                f"schedule of {self.num_steps} steps (num_points={self.num_points}): need "
                f"0 <= lo, lo + window_size <= hi <= {self.num_steps}"
            )


@dataclass(frozen=True)
class SamplerParams(SamplerSettings):
    """What one request samples with: the settings, the image size, and whether to decode."""

    height: int = knob(512, 1, MAX_SIDE)  # pixels
    width: int = knob(512, 1, MAX_SIDE)
    decode_images: bool = True

    def to_proto(self) -> common_pb2.SamplerParams:
        values: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                values[f"{f.name}_lo"], values[f"{f.name}_hi"] = value
            else:
                values[f.name] = value
        return common_pb2.SamplerParams(**values)

    @classmethod
    def from_proto(cls, msg: common_pb2.SamplerParams, where: str = "SamplerParams") -> Self:
        """The checked settings of a request; a bad value raises :class:`FieldError`."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if isinstance(f.default, tuple):
                values[f.name] = (getattr(msg, f"{f.name}_lo"), getattr(msg, f"{f.name}_hi"))
            else:
                values[f.name] = getattr(msg, f.name)
        params = cls(**values)
        params.check(where)
        return params


_HINTS: dict[type, dict[str, Any]] = {}  # per class: get_type_hints is slow, check() is per request


def _type_hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _check_field(name: str, value: Any, hint: Any, metadata: Any) -> None:
    if typing.get_origin(hint) is Literal:
        check_choice(name, value, typing.get_args(hint))
        return
    if "range" not in metadata:
        return
    lo, hi = metadata["range"]
    check = check_int if isinstance(lo, int) else check_float
    if isinstance(value, tuple):
        for i, end in enumerate(value):
            check(f"{name}[{i}]", end, lo, hi)
        if value[0] > value[1]:
            raise FieldError(f"{name}={list(value)}: need lo <= hi")
    else:
        check(name, value, lo, hi)
