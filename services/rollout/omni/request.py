"""One sample's coordinates and settings as plain values, the way they reach the pipeline.

vLLM-Omni's prompts are text and its per-request knobs live in ``extra_args``; that dict may be
serialised between vLLM-Omni's processes, so it holds only ints, strings and bytes (the sampler
settings as their protobuf message, the project's one definition of them). Torch- and vLLM-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Self

from flowgrpo.sampler_params import SamplerParams
from flowgrpo.v1 import common_pb2

EXTRA_ARGS_KEY = "flowgrpo"


@dataclass(frozen=True)
class OmniSampleRequest:
    """Everything the FlowGRPO pipeline needs to draw sample ``sample_index`` of prompt
    ``prompt_uid`` exactly as the native engine would."""

    prompt_ids: tuple[int, ...]  # tokenised once, at data preparation, markers included
    prompt_uid: str
    sample_index: int
    seed: int
    step: int
    window_begin: int  # first stochastic step; the group's, from flowgrpo.sampler_math.window_begin
    params: bytes  # flowgrpo.v1.SamplerParams

    @property
    def sampler_params(self) -> SamplerParams:
        return SamplerParams.from_proto(common_pb2.SamplerParams.FromString(self.params), "OmniSampleRequest")

    def extra_args(self) -> dict[str, Any]:
        """vLLM-Omni's ``extra_args`` for this sample: BAGEL's own CFG knobs and this request."""
        params = self.sampler_params
        return {
            "cfg_text_scale": params.cfg_text_scale,
            "cfg_img_scale": params.cfg_img_scale,
            "cfg_interval": list(params.cfg_interval),
            "cfg_renorm_type": params.cfg_renorm_type,
            "cfg_renorm_min": params.cfg_renorm_min,
            "timestep_shift": params.timestep_shift,
            "negative_prompt": "",  # text-unconditional branch = the empty context, as BAGEL samples
            EXTRA_ARGS_KEY: {**asdict(self), "prompt_ids": list(self.prompt_ids)},
        }

    @classmethod
    def from_extra_args(cls, extra_args: Mapping[str, Any] | None) -> Self | None:
        """The request inside ``extra_args``, or None for a plain vLLM-Omni request."""
        raw = (extra_args or {}).get(EXTRA_ARGS_KEY)
        if raw is None:
            return None
        ids: Sequence[int] = raw["prompt_ids"]
        return cls(**{**raw, "prompt_ids": tuple(int(i) for i in ids), "params": bytes(raw["params"])})
