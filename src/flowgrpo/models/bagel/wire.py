"""The checks of the request fields that the rollout and the trainer both read, beyond the
sampler settings' own ranges (``flowgrpo.sampler_params``): what this checkpoint can take
(:class:`ModelLimits`: image side, prompt length, vocabulary) and the bus references a request
names. Every value is checked where the request comes in, before any work: a bad one raises
:class:`FieldError` naming the field and the range it must lie in (the services answer
INVALID_ARGUMENT and keep serving).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from flowgrpo.bus import TensorRef
from flowgrpo.bus.dtypes import STORAGE
from flowgrpo.bus.refs import endpoint_problem
from flowgrpo.fields import FieldError, check_id, check_int
from flowgrpo.models.bagel.config import BagelConfig
from flowgrpo.models.bagel.sampling import PIXELS_PER_TOKEN
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.v1 import common_pb2

MAX_STEP = 2**31 - 1  # training steps, generation steps
MAX_VERSION = 2**53  # policy versions (exact in a double: metrics carry them)
MAX_SAMPLE_INDEX = 65535  # a sample's index within its prompt's group
MAX_KEY_CHARS = 1024  # bus keys
MAX_DIM = 2**31 - 1  # one dimension of a tensor on the bus
MAX_RANK = 8  # dimensions of a tensor whose shape is free (weights)
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


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
    """The checked settings (:meth:`SamplerParams.from_proto`), then the image size this
    checkpoint can take; a bad value raises :class:`FieldError` naming ``field.<name>``."""
    params = SamplerParams.from_proto(msg, field)
    for name in ("height", "width"):
        _check_side(f"{field}.{name}", getattr(params, name), limits)
    return params


def _check_side(field: str, pixels: int, limits: ModelLimits) -> None:
    if pixels < PIXELS_PER_TOKEN or pixels > limits.max_side or pixels % PIXELS_PER_TOKEN:
        raise FieldError(
            f"{field}={pixels} must be a multiple of {PIXELS_PER_TOKEN} in [{PIXELS_PER_TOKEN}, "
            f"{limits.max_side}] (this checkpoint's latent grid is at most "
            f"{limits.max_side // PIXELS_PER_TOKEN} tokens of {PIXELS_PER_TOKEN} px a side)"
        )


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
