"""``rollout.engine=synthetic``: a LOAD-TEST engine. It computes no image and trains nothing; it
exists so that hundreds of rollout replicas fit on a laptop's cores while everything around them
is real (``flowgrpo bench scale``): the gRPC protocol and its checks, the data bus, deadlines and
cancellation, weight loads and their checks, the coordinator's dispatch. No recipe uses it, and
the coordinator says so loudly when a run does.

What it returns has the real engine's shapes and dtypes, for the requested image size and
window, and is a pure function of the sample's coordinates (seed, step, prompt uid, sample
index), like the real sampler's noise: latents are the sample's own noise draws, sigmas and
timesteps the real schedule's at the group's real window, log-probs the standard-normal
log-density of those draws (finite, of the right magnitude), images (when asked) a flat colour
of the coordinates. ``step_delay_s`` sleeps per denoising step per batch, in which it checks
``between_steps`` as the real loop does (a caller that gives up frees it within one step).
Updates are checked whole against the checkpoint's parameter shapes (on the meta device: no
memory) and then only counted: the version moves, nothing else.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from flowgrpo.models.bagel.checkpoint import read_bagel_config
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.models.bagel.policy import PolicyUpdate, check_update
from flowgrpo.models.bagel.sampling import SampleRequest, Trajectories, token_grid
from flowgrpo.sampler_math import sample_noise, shifted_schedule, window_begin
from flowgrpo.sampler_params import SamplerParams

LATENT_CHANNELS = 64  # per latent token (2x2 patches of BAGEL's 16-channel autoencoder)


class SyntheticEngine:
    """The :class:`~flowgrpo.services.rollout.engine.RolloutEngine` of load tests."""

    def __init__(
        self, params_of: dict[str, torch.Size], *, step_delay_s: float, max_batch_samples: int
    ) -> None:
        self.shapes = params_of  # parameter name -> shape: what an update is checked against
        self.step_delay_s = step_delay_s
        self.max_batch_samples = max_batch_samples
        self.version = 0

    @classmethod
    def from_checkpoint(
        cls, folder: str | Path, *, step_delay_s: float, max_batch_samples: int
    ) -> SyntheticEngine:
        with torch.device("meta"):
            model = BagelModel(read_bagel_config(folder))
        shapes = {n: p.shape for n, p in model.named_parameters()}
        return cls(shapes, step_delay_s=step_delay_s, max_batch_samples=max_batch_samples)

    @property
    def policy_version(self) -> int:
        return self.version

    def generate(
        self,
        requests: Sequence[SampleRequest],
        params: SamplerParams,
        *,
        seed: int,
        step: int,
        between_steps: Callable[[], None] | None = None,
    ) -> Trajectories:
        params.check("sampler")
        batches = math.ceil(len(requests) / self.max_batch_samples)
        for _ in range(params.num_steps * batches):  # the real loop's pace and stop points
            if between_steps is not None:
                between_steps()
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
        rows = [_sample(r, params, seed, step) for r in requests]
        images = (
            torch.stack([_image(r, params, seed, step) for r in requests]) if params.decode_images else None
        )
        return Trajectories(
            latents=torch.stack([r[0] for r in rows]),
            log_probs=torch.stack([r[1] for r in rows]),
            sigmas=torch.stack([r[2] for r in rows]),
            timesteps=torch.stack([r[3] for r in rows]),
            window_begin=torch.tensor([int(r[3][0]) for r in rows], dtype=torch.int64),
            final_latents=torch.stack([r[4] for r in rows]),
            images=images,
        )

    def apply_update(self, update: PolicyUpdate) -> None:
        meta = {n: torch.empty(s, device="meta") for n, s in self.shapes.items()}
        check_update(update, meta, self.version)  # refused whole, as the real engines refuse it
        self.version = update.version

    def close(self) -> None:
        pass


def _sample(
    request: SampleRequest, params: SamplerParams, seed: int, step: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(latents [W+1, N, 64], log_probs [W], sigmas [W+1], timesteps [W], final [N, 64])."""
    rows, cols = token_grid(params)
    shape = (params.window_size + 1, rows * cols, LATENT_CHANNELS)
    latents = sample_noise(shape, seed=seed, step=step, prompt_uid=request.prompt_uid,
                           sample_index=request.sample_index, stream="synthetic")  # fmt: skip
    begin = window_begin(params, seed, step, request.prompt_uid)
    schedule = shifted_schedule(params.num_points, params.timestep_shift)
    sigmas = schedule[begin : begin + params.window_size + 1].clone()
    log_probs = (-0.5 * latents[1:] ** 2).flatten(1).mean(dim=1)  # the sampler's form: mean 0, var 1
    timesteps = torch.arange(begin, begin + params.window_size, dtype=torch.int64)
    return latents, log_probs, sigmas, timesteps, latents[-1].clone()


def _image(request: SampleRequest, params: SamplerParams, seed: int, step: int) -> Tensor:
    colour = sample_noise((3,), seed=seed, step=step, prompt_uid=request.prompt_uid,
                          sample_index=request.sample_index, stream="synthetic/image")  # fmt: skip
    rgb = (torch.sigmoid(colour) * 255).to(torch.uint8)
    return rgb.expand(params.height, params.width, 3).clone()
