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

Branched rollouts (``params.branch``): a group's samples start from one initial noise, so until
their shared window they are one ODE trajectory. The loop runs it as ONE row per group (in the
forward's batch beside the other groups' rows) and repeats it into the group's samples at the
window's first step; x[begin] is that shared prefix end. In deterministic mode each prefix and
then each sample runs alone, which is bitwise unbranched sampling from the group's noise.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.models.bagel.config import SpecialTokens
from flowgrpo.models.bagel.model import BagelModel, latent_position_ids, unpatchify
from flowgrpo.models.bagel.vae import AutoEncoder, decode_in_batches, images_to_uint8
from flowgrpo.sampler_math import (
    StepResult,
    batch_noise,
    combine_cfg,
    cps_step,
    initial_noise,
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


def prefill_prompts(model: BagelModel, prompts: Sequence[Tensor], *, invariant: bool = False) -> KVCache:
    """One cache row per prompt; prompts of different lengths are right-padded and masked.
    ``invariant``: each prompt prefilled alone (its K/V independent of the others'), then padded."""
    if invariant and len(prompts) > 1:
        return KVCache.cat_rows([prefill_prompts(model, [p]) for p in prompts])
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
    if not needs_uncond(params):
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
    if params.batch_invariant and x.shape[0] > 1:  # each sample as in a batch of one
        rows = range(x.shape[0])
        own = [pos_ids[i : i + 1] if pos_ids.dim() == 2 else pos_ids for i in rows]
        return torch.cat([
            guided_velocity(model, _own_context(context, i, len(rows), params), x[i : i + 1], t[i : i + 1],
                            own[i], params=params, special=special)
            for i in rows
        ])  # fmt: skip
    markers = {"soi_id": special.vision_start, "eoi_id": special.vision_end}
    if not needs_uncond(params):
        return model.predict_velocity(context, x, t, pos_ids, **markers)
    b = x.shape[0]
    v = model.predict_velocity(context, torch.cat([x, x]), torch.cat([t, t]), pos_ids, **markers)
    return combine_cfg(v[:b], v[b:], t, params)


def compute_autocast(model: BagelModel) -> contextlib.AbstractContextManager[object]:
    """bf16 (or fp16) autocast when the model's frozen weights are that dtype on a GPU, else a
    no-op. The frozen ``vae2llm`` weight tells the load dtype (it is never trained).

    The rollout's forwards (prefill and :func:`guided_velocity`) and the trainer's run inside it
    alike: autocast runs some ops in fp32 (exp, pow, rsqrt, sums, softmax), so a rollout without
    it computes another bf16 function than the trainer (issue #23 measured 2.5e-2 relative)."""
    weight = model.vae2llm.weight
    if weight.device.type == "cuda" and weight.dtype in (torch.bfloat16, torch.float16):
        return torch.autocast("cuda", dtype=weight.dtype)
    return contextlib.nullcontext()


@contextlib.contextmanager
def lora_inputs_uncast(model: BagelModel) -> Iterator[None]:
    """Under autocast, peft's cast of every LoRA input to fp32 (the A/B dtype) is a round trip
    (autocast casts it back to bf16 for the matmul) that costs ~10% of a forward in memory
    traffic: switched off while inside (the numbers are the same: bf16 -> fp32 -> bf16 is exact).
    A no-op without autocast, where the cast is what makes a bf16 input meet fp32 A/B."""
    if not isinstance(compute_autocast(model), torch.autocast):
        yield
        return
    from peft.tuners.lora import LoraLayer  # only GPU runs with peft layers get here

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.cast_input_dtype_enabled = True


def _own_context(context: KVCache, row: int, batch: int, params: SamplerSettings) -> KVCache:
    """Sample ``row``'s context rows of a :func:`with_cfg_branches` cache (its conditional row,
    and its empty row with CFG) cut to its own length: what it would be in a batch of one."""
    return context.own_rows((row, batch + row) if needs_uncond(params) else (row,))


def needs_uncond(params: SamplerSettings) -> bool:
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
    a stored step (``x_next``). The trainer scores with exactly this function.

    With ``params.batch_invariant`` each row is stepped on its own: the log-prob is a mean over
    the row, and a GPU reduction kernel picks its split (so its summation order) from how many
    rows it reduces; one row at a time gives every sample the same order in a rollout batch of 8
    and a trainer micro-batch of 2."""
    if params.batch_invariant and x.shape[0] > 1:
        parts = [
            window_step(params, x[i : i + 1], v[i : i + 1], sigma[i : i + 1], sigma_next[i : i + 1],
                        sigma_after_first=sigma_after_first,
                        noise=None if noise is None else noise[i : i + 1],
                        x_next=None if x_next is None else x_next[i : i + 1])
            for i in range(x.shape[0])
        ]  # fmt: skip
        return StepResult(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(StepResult)))
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

    def __init__(
        self, model: BagelModel, vae: AutoEncoder | None, special: SpecialTokens, decode_batch: int = 0
    ) -> None:
        self.model = model
        self.vae = vae
        self.special = special
        self.decode_batch = decode_batch  # images per decode (vae.decode_in_batches); 0: all at once

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
        with lora_inputs_uncast(self.model):
            return self._generate_checked(list(requests), params, seed, step, check)

    def _generate_checked(
        self,
        requests: list[SampleRequest],
        params: SamplerParams,
        seed: int,
        step: int,
        check: Callable[[], None],
    ) -> Trajectories:
        if not params.deterministic:
            return self._generate_batch(requests, params, seed, step, check)
        # Each sample denoises alone, but the images are decoded together afterwards: a decode
        # runs in batches of a fixed shape (decode_in_batches), so an image's bytes do not depend
        # on its companions, and one sample a batch padded to decode_batch would decode
        # decode_batch times the work (on the tiny model, 3/4 of a deterministic rollout's time).
        latents_only = replace(params, decode_images=False)
        with deterministic_kernels():
            if not params.branch:
                drawn = concat_trajectories(
                    [self._generate_batch([r], latents_only, seed, step, check) for r in requests]
                )
            else:
                drawn = self._generate_branched_alone(requests, latents_only, seed, step, check)
            if params.decode_images:
                drawn.images = self.decode(drawn.final_latents, params, self.decode_batch or 1)
        return drawn

    def decode(self, final: Tensor, params: SamplerParams, batch: int) -> Tensor | None:
        """Final latent tokens [B, tokens, dim] -> uint8 images [B, H, W, 3] (None without a VAE),
        decoded in batches of ``batch`` (decode_in_batches; 0: all at once)."""
        if self.vae is None:
            return None
        latent = unpatchify(final, *token_grid(params), self.model.config.patch)
        latent = latent.to(next(self.vae.parameters()).dtype)
        return images_to_uint8(decode_in_batches(self.vae, latent, batch))

    def _generate_batch(
        self,
        requests: list[SampleRequest],
        params: SamplerParams,
        seed: int,
        step: int,
        between_steps: Callable[[], None],
    ) -> Trajectories:
        """One batch: every unit (a group's prefix when branching, else a sample) from its initial
        noise to t = 0, every row of a step in one forward."""
        batch = _Batch(self, requests, params, seed=seed, step=step)
        window = batch.new_window()
        final = batch.denoise(batch.initial_noise(), range(params.num_steps), window, between_steps)
        return batch.trajectories(window, final)

    def _generate_branched_alone(
        self,
        requests: list[SampleRequest],
        params: SamplerParams,
        seed: int,
        step: int,
        between_steps: Callable[[], None],
    ) -> Trajectories:
        """Deterministic branching: each group's prefix in a batch of one, then each of its samples
        in a batch of one from the prefix's end: the computations of unbranched deterministic
        sampling from the group's initial noise, so the results are bitwise the same (on CPU)."""
        parts: list[Trajectories | None] = [None] * len(requests)
        for uid in dict.fromkeys(r.prompt_uid for r in requests):
            rows = [i for i, r in enumerate(requests) if r.prompt_uid == uid]
            group = _Batch(self, [requests[i] for i in rows], params, seed=seed, step=step)
            begin = group.units[0].branch
            prefix = group.denoise(group.initial_noise(), range(begin), None, between_steps)
            for i in rows:
                alone = _Batch(self, [requests[i]], params, seed=seed, step=step, cache=group.cache)
                window = alone.new_window()
                final = alone.denoise(prefix, range(begin, params.num_steps), window, between_steps)
                parts[i] = alone.trajectories(window, final)
        return concat_trajectories([p for p in parts if p is not None])


@dataclass(frozen=True)
class _Unit:
    """Samples that follow one trajectory until step ``branch`` (one row), then one row each: a
    prompt group when branching (``branch`` = its window's begin), else one sample (``branch`` 0)."""

    prompt: int  # its prompt's row in the batch's prompt cache
    members: range  # its samples: consecutive positions of the batch's (unit-sorted) samples
    branch: int
    begin: int  # the first step of the window (its group's)


@dataclass
class _Window:
    """What a batch records of each sample's window: x[begin + k] (k = 0..size) and the step
    log-probs (k = 0..size - 1), in the batch's sample order."""

    x: list[Tensor]  # [B, N, 64] each
    log_prob: list[Tensor]  # [B] each


class _Batch:
    """The samples of one sampler batch grouped into units, their prompt cache, and the denoising
    loop over a row layout that changes where units branch.

    The samples are sorted by unit (a stable sort by prompt when branching; the request order
    otherwise), so a branched unit's rows are its members' positions, consecutive. Rows of a
    step: for each unit in order, one row before its branch step, its members' rows from it on.
    All of it is known on the host, so the loop reads nothing back from the device."""

    def __init__(
        self,
        sampler: BagelSampler,
        requests: list[SampleRequest],
        params: SamplerParams,
        *,
        seed: int,
        step: int,
        cache: KVCache | None = None,
    ) -> None:
        self.sampler, self.params, self.seed, self.step = sampler, params, seed, step
        model = sampler.model
        self.device = model.vae2llm.weight.device
        self.grid = token_grid(params)
        self.pos_ids = latent_position_ids(*self.grid, model.config.max_latent_size, self.device)
        self.shape = (self.grid[0] * self.grid[1], model.config.latent_token_dim)
        uids = list(dict.fromkeys(r.prompt_uid for r in requests))
        prompt_of = {uid: i for i, uid in enumerate(uids)}
        begins = {uid: window_begin(params, seed, step, uid) for uid in uids}
        self.order = list(range(len(requests)))
        if params.branch:
            self.order.sort(key=lambda i: prompt_of[requests[i].prompt_uid])
        self.requests = [requests[i] for i in self.order]
        self.keys = [(r.prompt_uid, r.sample_index) for r in self.requests]
        self.units: list[_Unit] = []
        for pos, r in enumerate(self.requests):
            last = self.units[-1] if self.units else None
            if params.branch and last is not None and self.keys[last.members.start][0] == r.prompt_uid:
                self.units[-1] = replace(last, members=range(last.members.start, pos + 1))
            else:
                begin = begins[r.prompt_uid]
                self.units.append(_Unit(prompt_of[r.prompt_uid], range(pos, pos + 1),
                                        branch=begin if params.branch else 0, begin=begin))  # fmt: skip
        self.begins = [begins[uid] for uid, _ in self.keys]
        first = {uid: next(r for r in self.requests if r.prompt_uid == uid) for uid in uids}
        for r in self.requests:
            if not torch.equal(r.prompt_ids.cpu(), first[r.prompt_uid].prompt_ids.cpu()):
                raise ValueError(f"prompt {r.prompt_uid!r} arrives with two different token sequences")
        self.prompt_lengths = [int(first[uid].prompt_ids.numel()) for uid in uids]
        # each distinct prompt prefilled once; its rows share the cache row
        self.autocast = compute_autocast(model)  # the trainer's precision (compute_autocast)
        if cache is None:
            with self.autocast:
                cache = prefill_prompts(
                    model, [first[u].prompt_ids for u in uids], invariant=params.batch_invariant
                )
        self.cache = cache
        self.host_schedule = shifted_schedule(params.num_points, params.timestep_shift)
        self.schedule = self.host_schedule.to(self.device)

    # --- the loop -----------------------------------------------------------------------------

    def initial_noise(self) -> Tensor:
        """One row per unit at t = 1: a sample's own noise, or its group's when branching."""
        shared = self.params.branch
        noise = []
        for unit in self.units:
            uid, index = self.keys[unit.members.start]
            noise.append(initial_noise(self.shape, seed=self.seed, step=self.step, prompt_uid=uid,
                                       sample_index=index, shared=shared))  # fmt: skip
        return torch.stack(noise).to(self.device)

    def new_window(self) -> _Window:
        size, b = self.params.window_size, len(self.requests)
        zeros = torch.zeros(b, *self.shape, device=self.device)
        return _Window(
            x=[zeros.clone() for _ in range(size + 1)],
            log_prob=[torch.zeros(b, device=self.device) for _ in range(size)],
        )

    def denoise(
        self, x: Tensor, steps: range, window: _Window | None, between_steps: Callable[[], None]
    ) -> Tensor:
        """Denoising steps ``steps`` from x (the rows of the layout before ``steps.start``) -> the
        rows after the last one; what falls in the window is recorded into ``window``."""
        params, size = self.params, self.params.window_size
        layout = self._layout(steps.start - 1)
        contexts = _Contexts(self, {self._prompt_rows(self._layout(i)) for i in steps})
        for i in steps:
            between_steps()
            layout, before = self._layout(i), layout
            if layout != before:
                x = self._branch(x, before, layout)
            if window is not None:
                for k, rows, samples in self._runs(layout, i, size + 1):
                    window.x[k][samples] = x[rows]
            n = x.shape[0]
            sigma, sigma_next = self.schedule[i].expand(n), self.schedule[i + 1].expand(n)
            context = contexts[self._prompt_rows(layout)]
            with self.autocast:
                v = guided_velocity(self.sampler.model, context, x, sigma, self.pos_ids, params=params,
                                    special=self.sampler.special)  # fmt: skip
            stochastic = self._runs(layout, i, size)
            if not stochastic:
                x = ode_step(x, v, sigma, sigma_next)
                continue
            noise = torch.zeros(n, *self.shape)  # drawn for the window's rows only
            for _, rows, samples in stochastic:
                noise[rows] = batch_noise(self.shape, self.seed, self.step, self.keys[samples], f"sde/{i}")
            first = float(self.host_schedule[1])
            stoch = window_step(
                params, x, v, sigma, sigma_next, sigma_after_first=first, noise=noise.to(self.device)
            )
            in_window = torch.zeros(n, dtype=torch.bool, device=self.device)
            for k, rows, samples in stochastic:
                in_window[rows] = True
                if window is not None:
                    window.log_prob[k][samples] = stoch.log_prob[rows]
            x = torch.where(in_window.view(-1, 1, 1), stoch.x_next, ode_step(x, v, sigma, sigma_next))
        if window is not None:
            for k, rows, samples in self._runs(layout, steps.stop, size + 1):
                window.x[k][samples] = x[rows]
        return x

    def trajectories(self, window: _Window, final: Tensor) -> Trajectories:
        """The batch's trajectories, row i for request i, and the images when asked for."""
        window_x, window_lp = window.x, window.log_prob
        begins = torch.tensor(self.begins, device=self.device)
        if self.order != sorted(self.order):  # back to the requests' order
            back = torch.tensor(
                sorted(range(len(self.order)), key=self.order.__getitem__), device=self.device
            )
            window_x, window_lp = [t[back] for t in window_x], [t[back] for t in window_lp]
            begins, final = begins[back], final[back]
        steps = begins[:, None] + torch.arange(self.params.window_size + 1, device=self.device)
        images = None
        if self.params.decode_images:
            images = self.sampler.decode(final, self.params, self.sampler.decode_batch)
        return Trajectories(
            latents=torch.stack(window_x, dim=1),
            log_probs=torch.stack(window_lp, dim=1),
            sigmas=self.schedule[steps],
            timesteps=steps[:, :-1],
            window_begin=begins,
            final_latents=final,
            images=images,
        )

    # --- the row layout -------------------------------------------------------------------------

    def _layout(self, i: int) -> tuple[bool, ...]:
        """Which units have their members' rows at step i (branched at or before it)."""
        return tuple(u.branch <= i for u in self.units)

    def _prompt_rows(self, layout: tuple[bool, ...]) -> tuple[int, ...]:
        """The prompt-cache row of each row of ``layout``."""
        return tuple(
            u.prompt
            for u, split in zip(self.units, layout, strict=True)
            for _ in range(len(u.members) if split else 1)
        )

    def _branch(self, x: Tensor, before: tuple[bool, ...], after: tuple[bool, ...]) -> Tensor:
        """The rows of ``after`` from those of ``before``: the one row of each unit that branches
        now, repeated for its members; the other rows as they are."""
        pieces: list[Tensor] = []
        row = kept = 0  # rows [kept, row) are still to be copied as they are
        for u, was, now in zip(self.units, before, after, strict=True):
            if now and not was and len(u.members) > 1:
                pieces += [x[kept:row], x[row : row + 1].expand(len(u.members), *x.shape[1:])]
                kept = row + 1
            row += len(u.members) if was else 1
        return torch.cat([*pieces, x[kept:row]]) if pieces else x

    def _runs(self, layout: tuple[bool, ...], time: int, count: int) -> list[tuple[int, slice, slice]]:
        """(k, rows, samples) of the branched units whose window step ``time - begin`` = k is in
        [0, count): their rows and their samples' positions, consecutive units of one k merged."""
        out: list[tuple[int, slice, slice]] = []
        row = 0
        for u, split in zip(self.units, layout, strict=True):
            rows = len(u.members) if split else 1
            k = time - u.begin
            if split and 0 <= k < count:
                last = out[-1] if out else None
                if (
                    last is not None
                    and last[0] == k
                    and last[1].stop == row
                    and last[2].stop == u.members.start
                ):
                    out[-1] = (k, slice(last[1].start, row + rows), slice(last[2].start, u.members.stop))
                else:
                    out.append((k, slice(row, row + rows), slice(u.members.start, u.members.stop)))
            row += rows
        return out


class _Contexts:
    """The CFG context rows of each row layout a loop meets: the prompt-cache rows of every row
    and the empty text-unconditional ones, built on first use (each row layout's indices copied to
    the device once, before the loop; the query runs from host lengths)."""

    def __init__(self, batch: _Batch, layouts: set[tuple[int, ...]]) -> None:
        self.batch = batch
        ordered = sorted(layouts)
        flat = torch.tensor([p for rows in ordered for p in rows], dtype=torch.long, device=batch.device)
        self.index: dict[tuple[int, ...], Tensor] = {}
        start = 0
        for rows in ordered:
            self.index[rows] = flat[start : start + len(rows)]
            start += len(rows)
        self.built: tuple[tuple[int, ...], KVCache] | None = None

    def __getitem__(self, rows: tuple[int, ...]) -> KVCache:
        if self.built is None or self.built[0] != rows:
            batch = self.batch
            lengths = [batch.prompt_lengths[p] for p in rows]
            context = context_rows(batch.sampler.model, batch.cache, self.index[rows], lengths, batch.params)
            self.built = (rows, context)
        return self.built[1]


def context_rows(
    model: BagelModel, cache: KVCache, index: Tensor, lengths: list[int], params: SamplerSettings
) -> KVCache:
    """The context of one CFG forward over a prompt cache: its rows ``index`` (repeats allowed),
    whose real lengths ``lengths`` the caller knows on the host, then the empty
    text-unconditional rows when CFG asks for them (:func:`with_cfg_branches`). Its query runs
    come from those lengths: nothing is read back from the device."""
    context = with_cfg_branches(model, cache.select(index), params)
    lengths = lengths + [0] * (context.key_mask.shape[0] - len(lengths))  # the empty rows, if any
    host_mask = torch.arange(context.key_mask.shape[1]) < torch.tensor(lengths)[:, None]
    return context.with_host_mask(host_mask)


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


_DETERMINISTIC_LOCK = threading.Lock()
_deterministic_users = 0  # contexts open now, in any thread
_deterministic_saved = (False, 1)  # the settings before the first of them


@contextlib.contextmanager
def deterministic_kernels() -> Iterator[None]:
    """Deterministic algorithms and ONE intra-op thread while inside; the caller's settings after.

    The thread count matters: CPU matmuls split their reductions by thread, so two processes
    with different thread counts (a rollout and a torchrun trainer, say) differ in the last bit.
    The sampler and the trainer both run their deterministic-mode forwards inside this.

    Both settings are process-wide, and the in-process launcher runs a rollout and a trainer in
    two threads: the contexts are counted, the first one in saves the settings and the last one
    out restores them (a save/restore per context let overlapping contexts leave deterministic
    algorithms on for the rest of the process)."""
    global _deterministic_users, _deterministic_saved
    with _DETERMINISTIC_LOCK:
        if _deterministic_users == 0:
            _deterministic_saved = (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads())
            torch.use_deterministic_algorithms(True)
            torch.set_num_threads(1)
        _deterministic_users += 1
    try:
        yield
    finally:
        with _DETERMINISTIC_LOCK:
            _deterministic_users -= 1
            if _deterministic_users == 0:
                torch.use_deterministic_algorithms(_deterministic_saved[0])
                torch.set_num_threads(_deterministic_saved[1])
