"""Text-to-image sampling with BAGEL, recording what FlowGRPO trains on.

BAGEL's text-to-image loop: prefill every distinct prompt once, run the conditional and the
text-unconditional (empty cache) branches of all samples in ONE forward per step, combine them
with CFG, and step the latents — SDE inside each group's window, Euler ODE elsewhere. All the
math (schedule, CFG, SDE step, log-prob, noise, window) comes from ``flowgrpo.sampler_math``, the
module the trainer uses too; :func:`guided_velocity` is the one velocity both call.

Randomness is a function of (seed, step, prompt uid, sample index) only, so a sample comes out
the same whatever batch it was in. In ``deterministic`` mode every sample also runs in a batch
of its own (fixed shapes), which makes results bitwise independent of the batch composition on
CPU; otherwise they agree within float rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.models.bagel.config import SpecialTokens
from flowgrpo.models.bagel.model import BagelModel, latent_position_ids, unpatchify
from flowgrpo.models.bagel.vae import AutoEncoder, images_to_uint8
from flowgrpo.sampler_math import (
    StepResult,
    batch_noise,
    combine_cfg,
    cps_step,
    ode_step,
    sde_step,
    shifted_schedule,
    window_begin,
)
from flowgrpo.sampler_params import SamplerParams, SamplerSettings

PIXELS_PER_TOKEN = 16  # 8x VAE downsampling x 2x2 latent patches


def token_grid(params: SamplerParams) -> tuple[int, int]:
    """Latent-token rows and columns: one token per 16x16 pixel block."""
    for name, size in (("height", params.height), ("width", params.width)):
        if size <= 0 or size % PIXELS_PER_TOKEN:
            raise ValueError(f"sampler {name}={size} must be a positive multiple of {PIXELS_PER_TOKEN}")
    return params.height // PIXELS_PER_TOKEN, params.width // PIXELS_PER_TOKEN


@dataclass(frozen=True)
class SampleRequest:
    """One sample to draw: prompt ``prompt_uid`` (ids tokenised once, at data preparation) and
    its index within the prompt's group of G."""

    prompt_uid: str
    sample_index: int
    prompt_ids: Tensor  # [L] int64


@dataclass
class Trajectories:
    """What a batch of samples produced; row i belongs to request i.

    The window holds ``size`` trained steps: latents x[begin .. begin + size] (size + 1 of them),
    their sigmas, the behaviour log-prob of each step and the step indices.
    """

    latents: Tensor  # [B, W + 1, N, 64] fp32
    log_probs: Tensor  # [B, W] fp32
    sigmas: Tensor  # [B, W + 1] fp32
    timesteps: Tensor  # [B, W] int64: schedule index of each window step
    window_begin: Tensor  # [B] int64
    final_latents: Tensor  # [B, N, 64] fp32: x at t = 0
    images: Tensor | None  # [B, H, W, 3] uint8, when decoded


# --- the velocity, shared with the trainer --------------------------------------------------


def prefill_prompts(model: BagelModel, prompts: Sequence[Tensor]) -> KVCache:
    """One cache row per prompt; prompts of different lengths are right-padded and masked."""
    device = model.vae2llm.weight.device
    longest = max(int(p.numel()) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), longest, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, : prompt.numel()] = prompt.to(device)
        mask[row, : prompt.numel()] = True
    return model.prefill(ids, mask)


def with_cfg_branches(model: BagelModel, cond: KVCache, params: SamplerSettings) -> KVCache:
    """The context rows of one CFG forward: the conditional rows, then (when CFG is not the
    identity) as many empty rows for the text-unconditional branch. Build it once per batch."""
    if not _needs_uncond(params):
        return cond
    empty = KVCache.empty(model.config, cond.key_mask.shape[0], cond.keys[0].dtype, cond.key_mask.device)
    return KVCache.cat_rows([cond, empty])


def guided_velocity(
    model: BagelModel,
    context: KVCache,
    x: Tensor,
    t: Tensor,
    pos_ids: Tensor,
    *,
    params: SamplerSettings,
    special: SpecialTokens,
) -> Tensor:
    """CFG-combined velocity [B, N, 64] fp32 of latents x at times t [B], given the context rows
    of :func:`with_cfg_branches`: both branches (conditional, empty-context) in one forward.

    The rollout calls it without gradients, the trainer with them (the prompt cache depends only
    on the frozen und path, so it is built once, without gradients, by both).
    """
    markers = {"soi_id": special.vision_start, "eoi_id": special.vision_end}
    if not _needs_uncond(params):
        return model.predict_velocity(context, x, t, pos_ids, **markers)
    b = x.shape[0]
    v = model.predict_velocity(context, torch.cat([x, x]), torch.cat([t, t]), pos_ids, **markers)
    return combine_cfg(v[:b], v[b:], t, params)


def _needs_uncond(params: SamplerSettings) -> bool:
    return not (params.cfg_text_scale == 1.0 and params.cfg_img_scale <= 1.0)  # else CFG is the identity


def window_step(
    params: SamplerParams,
    x: Tensor,
    v: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    *,
    sigma_after_first: float,
    noise: Tensor | None = None,
    x_next: Tensor | None = None,
) -> StepResult:
    """The stochastic step of the window ("sde" or "cps"), sampling (``noise``) or scoring
    a stored step (``x_next``). The trainer scores with exactly this function."""
    if params.sde_type == "cps":
        return cps_step(x, v, sigma, sigma_next, noise_level=params.noise_level, noise=noise, x_next=x_next)
    return sde_step(
        x,
        v,
        sigma,
        sigma_next,
        sigma_after_first=sigma_after_first,
        noise_level=params.noise_level,
        noise=noise,
        x_next=x_next,
    )


# --- the sampler -------------------------------------------------------------------------


class BagelSampler:
    """Draws FlowGRPO trajectories from a BAGEL model (and decodes them with the VAE)."""

    def __init__(self, model: BagelModel, vae: AutoEncoder | None, special: SpecialTokens) -> None:
        self.model = model
        self.vae = vae
        self.special = special

    @torch.no_grad()
    def generate(
        self,
        requests: Sequence[SampleRequest],
        params: SamplerParams,
        *,
        seed: int,
        step: int,
        between_steps: Callable[[], None] | None = None,
    ) -> Trajectories:
        """Sample every request; row i of the result belongs to request i. ``between_steps`` is
        called before each denoising step: a caller's way to stop a long request there (it
        raises), since nothing is half-done between two steps."""
        params.check("sampler")
        token_grid(params)
        if not requests:
            raise ValueError("generate() needs at least one request")
        check = between_steps or _nothing
        if params.deterministic:
            with deterministic_kernels():
                parts = [self._generate_batch([r], params, seed, step, check) for r in requests]
            return concat_trajectories(parts)
        return self._generate_batch(list(requests), params, seed, step, check)

    def _generate_batch(
        self,
        requests: list[SampleRequest],
        params: SamplerParams,
        seed: int,
        step: int,
        between_steps: Callable[[], None],
    ) -> Trajectories:
        device = self.model.vae2llm.weight.device
        rows, cols = token_grid(params)
        pos_ids = latent_position_ids(rows, cols, self.model.config.max_latent_size, device)
        keys = [(r.prompt_uid, r.sample_index) for r in requests]
        context = with_cfg_branches(self.model, self._prompt_cache(requests), params)
        # The schedule and the window starts are known on the host: deciding which steps are
        # stochastic from them, rather than from device tensors, keeps the loop free of syncs.
        host_schedule = shifted_schedule(params.num_points, params.timestep_shift)
        schedule = host_schedule.to(device)
        host_begins = [window_begin(params, seed, step, r.prompt_uid) for r in requests]
        begins = torch.tensor(host_begins, device=device)
        x = batch_noise((rows * cols, self.model.config.latent_token_dim), seed, step, keys, "init").to(
            device
        )
        size = params.window_size
        window_x, window_lp = (
            [x.new_zeros(x.shape) for _ in range(size + 1)],
            [x.new_zeros(len(requests)) for _ in range(size)],
        )
        for i in range(params.num_steps):
            between_steps()
            sigma, sigma_next = schedule[i].expand(len(requests)), schedule[i + 1].expand(len(requests))
            v = guided_velocity(self.model, context, x, sigma, pos_ids, params=params, special=self.special)
            offset = i - begins  # position of step i inside each sample's window
            host_offsets = [i - b for b in host_begins]
            _record(window_x, x, offset, host_offsets, size + 1)
            if any(0 <= o < size for o in host_offsets):
                in_window = (offset >= 0) & (offset < size)
                noise = batch_noise(tuple(x.shape[1:]), seed, step, keys, f"sde/{i}").to(device)
                stoch = window_step(
                    params, x, v, sigma, sigma_next, sigma_after_first=float(host_schedule[1]), noise=noise
                )
                _record(window_lp, stoch.log_prob, offset, host_offsets, size)
                x = torch.where(in_window.view(-1, 1, 1), stoch.x_next, ode_step(x, v, sigma, sigma_next))
            else:
                x = ode_step(x, v, sigma, sigma_next)
        _record(window_x, x, params.num_steps - begins, [params.num_steps - b for b in host_begins], size + 1)
        return self._trajectories(
            window_x, window_lp, begins=begins, schedule=schedule, final=x, params=params, grid=(rows, cols)
        )

    def _prompt_cache(self, requests: list[SampleRequest]) -> KVCache:
        """Prefill each distinct prompt once; its G samples share the cache row."""
        uids = list(dict.fromkeys(r.prompt_uid for r in requests))
        first = {uid: next(r for r in requests if r.prompt_uid == uid) for uid in uids}
        for r in requests:
            if not torch.equal(r.prompt_ids.cpu(), first[r.prompt_uid].prompt_ids.cpu()):
                raise ValueError(f"prompt {r.prompt_uid!r} arrives with two different token sequences")
        cache = prefill_prompts(self.model, [first[uid].prompt_ids for uid in uids])
        rows = torch.tensor([uids.index(r.prompt_uid) for r in requests], device=cache.key_mask.device)
        return cache.select(rows)

    def _trajectories(
        self,
        window_x: list[Tensor],
        window_lp: list[Tensor],
        *,
        begins: Tensor,
        schedule: Tensor,
        final: Tensor,
        params: SamplerParams,
        grid: tuple[int, int],
    ) -> Trajectories:
        steps = begins[:, None] + torch.arange(params.window_size + 1, device=begins.device)
        images = None
        if params.decode_images and self.vae is not None:
            latent = unpatchify(final, *grid, self.model.config.patch)
            vae_dtype = next(self.vae.parameters()).dtype
            images = images_to_uint8(self.vae.decode(latent.to(vae_dtype)))
        return Trajectories(
            latents=torch.stack(window_x, dim=1),
            log_probs=torch.stack(window_lp, dim=1),
            sigmas=schedule[steps],
            timesteps=steps[:, :-1],
            window_begin=begins,
            final_latents=final,
            images=images,
        )


def _record(slots: list[Tensor], value: Tensor, offset: Tensor, host_offset: list[int], count: int) -> None:
    """slots[k][b] = value[b] for each sample b whose offset[b] == k (0 <= k < count). ``host_offset``
    is ``offset`` as a list: it says which slots change without a device sync."""
    for k in range(count):
        if k in host_offset:
            shape = (-1,) + (1,) * (value.dim() - 1)
            slots[k] = torch.where((offset == k).view(shape), value, slots[k])


def concat_trajectories(parts: list[Trajectories]) -> Trajectories:
    images = [p.images for p in parts]
    return Trajectories(
        latents=torch.cat([p.latents for p in parts]),
        log_probs=torch.cat([p.log_probs for p in parts]),
        sigmas=torch.cat([p.sigmas for p in parts]),
        timesteps=torch.cat([p.timesteps for p in parts]),
        window_begin=torch.cat([p.window_begin for p in parts]),
        final_latents=torch.cat([p.final_latents for p in parts]),
        images=None if any(i is None for i in images) else torch.cat(images),  # type: ignore[arg-type]
    )


def _nothing() -> None:
    pass


@contextlib.contextmanager
def deterministic_kernels() -> Iterator[None]:
    """Deterministic algorithms and ONE intra-op thread while inside; the caller's settings after.

    The thread count matters: CPU matmuls split their reductions by thread, so two processes
    with different thread counts (a rollout and a torchrun trainer, say) differ in the last bit.
    The sampler and the trainer both run their deterministic-mode forwards inside this."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0])
        torch.set_num_threads(previous[1])
