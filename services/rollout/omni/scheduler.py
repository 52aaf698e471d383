"""The scheduler hook of vLLM-Omni's BAGEL pipeline, as FlowGRPO samples: torch only, so it is
tested against the native sampler without vLLM-Omni.

``step(v_t, t, x_t, dt)`` is called once per denoising step, in order, with the CFG-combined
velocity of one sample; every step is ``ode_step`` but the group's window, whose steps are
``window_step`` (SDE or CPS) with noise from the sample's coordinates and a recorded log-prob.
The time comes from this project's schedule, checked against vLLM-Omni's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from flowgrpo.models.bagel.sampling import window_step
from flowgrpo.sampler_math import ode_step, sample_noise, shifted_schedule
from flowgrpo.services.rollout.omni.request import OmniSampleRequest

# vLLM-Omni computes the same schedule in fp32 on the device; ours is float64, then fp32
SCHEDULE_TOLERANCE = 1e-5


@dataclass
class SchedulerOutput:
    prev_sample: Tensor  # [N, 64] fp32: x after the step
    log_prob: Tensor | None  # [] fp32 inside the window, None outside


class FlowGrpoScheduler:
    """BAGEL's scheduler hook for one sample: ``step(v_t, t, x_t, dt)`` is called once per
    denoising step, in order, with the CFG-combined velocity."""

    def __init__(self, request: OmniSampleRequest) -> None:
        self.request = request
        self.params = request.sampler_params
        self.schedule = shifted_schedule(self.params.num_points, self.params.timestep_shift)
        self.index = 0

    def step(self, v_t: Tensor, t: Tensor | float, x_t: Tensor, dt: Any, **_: Any) -> SchedulerOutput:
        i, self.index = self.index, self.index + 1
        if i >= self.params.num_steps:
            raise RuntimeError(f"scheduler step {i} past the schedule's {self.params.num_steps} steps")
        if abs(float(t) - float(self.schedule[i])) > SCHEDULE_TOLERANCE:
            raise RuntimeError(
                f"step {i}: vLLM-Omni's t={float(t)} is not this schedule's {float(self.schedule[i])}"
            )
        x, v = x_t.float()[None], v_t.float()[None]  # [1, N, 64]: one sample
        sigma, sigma_next = self.schedule[i : i + 1].to(x.device), self.schedule[i + 1 : i + 2].to(x.device)
        offset = i - self.request.window_begin
        if not 0 <= offset < self.params.window_size:
            return SchedulerOutput(ode_step(x, v, sigma, sigma_next)[0], None)
        noise = sample_noise(
            tuple(x.shape[1:]),
            seed=self.request.seed,
            step=self.request.step,
            prompt_uid=self.request.prompt_uid,
            sample_index=self.request.sample_index,
            stream=f"sde/{i}",
        ).to(x.device)
        after_first = float(self.schedule[1])
        result = window_step(
            self.params, x, v, sigma, sigma_next, sigma_after_first=after_first, noise=noise[None]
        )
        return SchedulerOutput(result.x_next[0], result.log_prob[0])
