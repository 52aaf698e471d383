"""The trainer's side of an algorithm: what one training step computes around its optimizer steps.

The trainer's ``TrainStep`` (services/trainer/step.py) owns the optimizer, the policy version and the loop:

    metrics = objective.begin(batch, params, seed, step)       # e.g. FlowGRPO's logp_old
    for each mini-batch (one optimizer step):
        for each micro-batch of this rank's rows:
            sums += objective.micro_batch(rows, scale)          # forward, loss, backward
        metrics |= objective.before_update(first)               # e.g. the on-policy gap alarm
        clip the gradients, step
    metrics |= objective.end(optimizer_steps)                   # e.g. DiffusionNFT's old policy

An objective sums its loss over the micro-batch's valid entries and back-propagates the sum times
``scale`` (1 / the mini-batch's entries, times the ranks: FSDP averages gradients over ranks), so
micro-batches of any size give the mini-batch's mean gradient. ``micro_batch`` returns its detached
sums in the order of ``metric_names``; the loop turns them into per-entry means.

:class:`Forwards` are the policy's forwards as the rollout's sampler computes them, shared by every
objective: the prompts' prefill with the CFG branch, the guided velocity, the window's log-probs.
Inside a step (``begin_step``) the prefill is the step's, of its distinct prompts once
(:class:`StepPrompts`): a micro-batch takes its rows from it and reads nothing back from the device.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from flowgrpo.devices import to_device
from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.models.bagel.config import SpecialTokens, is_text_path
from flowgrpo.models.bagel.model import BagelModel, latent_position_ids
from flowgrpo.models.bagel.sampling import (
    compute_autocast,
    context_rows,
    deterministic_kernels,
    guided_velocity,
    needs_uncond,
    prefill_prompts,
    token_grid,
    window_step,
    with_cfg_branches,
)
from flowgrpo.sampler_math import StepResult, sample_noise, shifted_schedule
from flowgrpo.sampler_params import SamplerParams


def mini_batch_rows(rows: int, mini_batches: int) -> list[list[int]]:
    """A step's rows 0..rows-1 in ``mini_batches`` consecutive mini-batches (one optimizer step
    each; the last may be shorter): the split the trainer's step trains and the benchmarks count."""
    size = math.ceil(rows / mini_batches)
    return [list(range(start, min(start + size, rows))) for start in range(0, rows, size)]


def recomputed_rows(rows: int, mini_batches: int) -> list[int]:
    """The rows whose logp_old FlowGRPO's step recomputes without gradients: those after the first
    mini-batch (the first's own forwards give theirs); what the benchmarks count for that pass."""
    return [row for mini in mini_batch_rows(rows, mini_batches)[1:] for row in mini]


class Ranks(Protocol):
    """What an objective needs of the trainer's data parallelism (the trainer's ``Dist``)."""

    @property
    def world(self) -> int: ...
    def share(self, rows: list[int]) -> list[tuple[int, bool]]:
        """This rank's rows of ``rows`` as (row, valid), padded to the same count on every rank."""
        ...

    def sum(self, value: Tensor) -> Tensor: ...
    def max(self, value: Tensor) -> Tensor: ...


class Policy(Protocol):
    """What an objective needs of the trained policy (the trainer's ``TrainablePolicy``): its
    model, its trained tensors, and the frozen reference and old copy swapped in for forwards."""

    @property
    def model(self) -> BagelModel: ...
    def trainable(self) -> dict[str, torch.nn.Parameter]: ...
    def reference(self) -> contextlib.AbstractContextManager[None]: ...
    def keep_old(self) -> None: ...
    def old(self) -> contextlib.AbstractContextManager[None]: ...
    def refresh_old(self, decay: float) -> None: ...


Rows = list[tuple[int, bool]]  # (row of the batch, valid): padding rows (valid False) count for nothing
Draw = tuple[Tensor, Tensor]  # a sample's trained times [K] and noises [K, N, C] (the forward process)


@dataclass
class Trajectory:
    """One sample to train on, as the rollout stored it."""

    prompt_uid: str
    sample_index: int
    policy_version: int
    advantage: float  # the coordinator's target for the sample (DiffusionNFT: its optimality)
    prompt_ids: Tensor  # [L] int64
    latents: Tensor  # [W + 1, N, 64] fp32 (FlowGRPO's inputs: empty for DiffusionNFT)
    log_probs: Tensor  # [W] fp32: behaviour log-probs
    sigmas: Tensor  # [W + 1] fp32
    final_latents: Tensor | None = None  # [N, 64] fp32: the clean latent (DiffusionNFT's input)
    # drawn with FP8 linear layers (rollout.precision=fp8): its log-probs are another policy's
    # than the trainer's even at lag 0, so FlowGRPO weights it by the truncated importance ratio
    fp8: bool = False


def stop_nothing() -> None:
    """The stop check outside a step, and once a step's first update is applied."""


class StepPrompts:
    """A training step's distinct prompts (by their tokens, in order of first appearance, as the
    sampler orders a request's) and their prefill, made on first use and shared by every
    micro-batch, pass and optimizer step of the step. The rows of a micro-batch are a selection
    of it; each row layout's index is copied to the device once and its context kept, so a
    micro-batch reads nothing back from the device (the query runs come from host lengths)."""

    def __init__(self, prompts: Sequence[Tensor]) -> None:
        self._row_of: dict[tuple[int, ...], int] = {}
        self._prompts: list[Tensor] = []
        for ids in prompts:
            key = tuple(ids.tolist())
            if key not in self._row_of:
                self._row_of[key] = len(self._prompts)
                self._prompts.append(ids)
        self._lengths = [int(p.numel()) for p in self._prompts]
        self._caches: dict[bool, KVCache] = {}  # by whether each prompt was prefilled alone
        self._contexts: dict[tuple[tuple[int, ...], bool, bool], KVCache] = {}

    def context(self, model: BagelModel, part: Sequence[Tensor], params: SamplerParams) -> KVCache:
        """The CFG context of the rows whose prompts are ``part`` (each one of the step's), inside
        the caller's no-grad, autocast and determinism settings."""
        layout = tuple(self._row_of[tuple(ids.tolist())] for ids in part)
        # each prompt prefilled alone where the sampler's results must not depend on the batch:
        # batch-invariant forwards, and deterministic mode (where it samples each alone)
        alone = params.batch_invariant or params.deterministic
        key = (layout, alone, needs_uncond(params))
        if key not in self._contexts:
            if alone not in self._caches:
                self._caches[alone] = prefill_prompts(model, self._prompts, invariant=alone)
            cache = self._caches[alone]
            index = torch.tensor(layout, device=cache.key_mask.device)
            lengths = [self._lengths[row] for row in layout]
            self._contexts[key] = context_rows(model, cache, index, lengths, params)
        return self._contexts[key]


class Forwards:
    """The policy's forwards as the sampler computes them; ``may_stop`` is the running step's
    stop check (the loop sets it), called between the micro-batches of a pass without gradients."""

    def __init__(self, policy: Policy, special: SpecialTokens, dist: Ranks, micro_batch_size: int) -> None:
        self.policy = policy
        self.special = special
        self.dist = dist
        self.micro_batch_size = micro_batch_size
        self.mixed_precision = True  # bf16 autocast on a GPU with bf16 frozen weights (compute_autocast)
        self.may_stop: Callable[[], None] = stop_nothing
        self._step: StepPrompts | None = None  # the running step's prompts (begin_step)

    def begin_step(self, batch: Sequence[Trajectory]) -> None:
        """From here to :meth:`end_step`, :meth:`context` takes its rows from one prefill of the
        batch's distinct prompts (``StepPrompts``) instead of prefilling every micro-batch's
        rows: a step of G samples a prompt prefills each prompt once, not once per micro-batch
        and pass, and reads no mask back from the device. Only while the language half is
        frozen: the prefill reads it, and an update of it would make the cache stale."""
        frozen = not any(is_text_path(n) for n in self.policy.trainable())
        self._step = StepPrompts([t.prompt_ids for t in batch]) if frozen else None

    def end_step(self) -> None:
        self._step = None

    @property
    def device(self) -> torch.device:
        """Where the forwards run (the model's gen-path input projection's device)."""
        return self.policy.model.vae2llm.weight.device

    def chunks(self, rows: Rows) -> list[Rows]:
        size = self.micro_batch_size
        return [rows[i : i + size] for i in range(0, len(rows), size)]

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        return compute_autocast(self.policy.model) if self.mixed_precision else contextlib.nullcontext()

    def context(self, part: Sequence[Trajectory], params: SamplerParams) -> KVCache:
        """The rows' prompts prefilled without gradients (the und path is frozen), with the CFG
        branch's rows when the settings ask for it, as the sampler builds them: inside a step
        (:meth:`begin_step`) rows of the step's one prefill, else a prefill of these rows."""
        model = self.policy.model
        with deterministic_or_not(params), torch.no_grad(), self.autocast():
            if self._step is not None:
                return self._step.context(model, [t.prompt_ids for t in part], params)
            prompts = prefill_prompts(model, [t.prompt_ids for t in part], invariant=params.batch_invariant)
            return with_cfg_branches(model, prompts, params)

    def velocity(self, context: KVCache, x: Tensor, t: Tensor, params: SamplerParams) -> Tensor:
        """The policy's velocity [B, N, C] at (x, t) for the context's prompts (``guided_velocity``:
        CFG when the settings ask for it); with gradients when grad mode is on."""
        model = self.policy.model
        device = context.key_mask.device
        rows, cols = token_grid(params)
        pos_ids = latent_position_ids(rows, cols, model.config.max_latent_size, device)
        with deterministic_or_not(params), self.autocast():
            return guided_velocity(
                model,
                context,
                to_device(x, device),
                to_device(t, device),
                pos_ids,
                params=params,
                special=self.special,
            )

    def window_log_probs(self, part: Sequence[Trajectory], params: SamplerParams) -> StepResult:
        """The stored window steps [B, W] scored under the current weights (``window_step``, the
        sampler's function): one forward per window step, like the sampler."""
        with deterministic_or_not(params):
            return self._window_log_probs(part, params)

    def _window_log_probs(self, part: Sequence[Trajectory], params: SamplerParams) -> StepResult:
        context = self.context(part, params)
        device = context.key_mask.device
        after_first = float(shifted_schedule(params.num_points, params.timestep_shift)[1])
        latents = to_device(torch.stack([t.latents for t in part]), device)
        sigmas = to_device(torch.stack([t.sigmas for t in part]), device)
        steps = []
        for k in range(latents.shape[1] - 1):
            x, x_next, sigma, sigma_next = latents[:, k], latents[:, k + 1], sigmas[:, k], sigmas[:, k + 1]
            v = self.velocity(context, x, sigma, params)
            steps.append(
                window_step(params, x, v, sigma, sigma_next, sigma_after_first=after_first, x_next=x_next)
            )
        return StepResult(
            x_next=torch.stack([s.x_next for s in steps], dim=1),
            mean=torch.stack([s.mean for s in steps], dim=1),
            std=torch.stack([s.std for s in steps], dim=1),
            log_prob=torch.stack([s.log_prob for s in steps], dim=1),
        )


class ForwardProcessObjective:
    """What the objectives that train on the forward process share (DiffusionNFT, AWM): each
    sample's clean latent is noised again at times and with noises drawn from its coordinates
    (``draw``), and a micro-batch runs its rows at each of their times in turn (``time_backward``)
    on one prefill of their prompts, shared by every policy the objective evaluates (current, old,
    reference): right only while the language half, which the prefill reads, is frozen (checked)."""

    def __init__(self, forwards: Forwards, algorithm: str) -> None:
        text = [n for n in forwards.policy.trainable() if is_text_path(n)]
        if text:
            raise ValueError(f"{algorithm} trains the gen path; {text[0]} (the language half) is trainable")
        self.forwards = forwards
        self._batch: Sequence[Trajectory] = ()
        self._params: SamplerParams | None = None
        self._draws: list[Draw] = []

    def begin(
        self,
        batch: Sequence[Trajectory],
        params: SamplerParams,
        minis: list[list[int]],
        *,
        seed: int,
        step: int,
        version: int,
        steps_done: int,
    ) -> dict[str, float]:
        self._batch, self._params = batch, params
        self._draws = [self.draw(t, params, seed, step) for t in batch]
        return {}

    def draw(self, sample: Trajectory, params: SamplerParams, seed: int, step: int) -> Draw:
        raise NotImplementedError

    def entries_per_sample(self) -> int:
        raise NotImplementedError

    def micro_batch(self, rows: Rows, scale: float, sums: Tensor, *, first: bool) -> None:
        params = self._params
        assert params is not None  # begin ran
        context = self.forwards.context([self._batch[r] for r, _ in rows], params)
        for k in range(self.entries_per_sample()):
            sums += self.time_backward(rows, context, k, params, scale)

    def time_backward(
        self, rows: Rows, context: KVCache, k: int, params: SamplerParams, scale: float
    ) -> Tensor:
        """Forward and backward of the rows at each row's k-th time; the detached sums of
        ``metric_names``."""
        raise NotImplementedError

    def noised(self, rows: Rows, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The rows' clean latents x0, their k-th times t and noises eps, and x_t = (1 - t) x0 + t eps."""
        index = [r for r, _ in rows]
        x0 = torch.stack([self._batch[r].final_latents for r in index])  # type: ignore[misc]
        t = torch.stack([self._draws[r][0][k] for r in index])
        eps = torch.stack([self._draws[r][1][k] for r in index])
        return x0, t, eps, (1.0 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps

    def before_update(self, first: bool) -> dict[str, float]:
        return {}

    def counters(self) -> dict[str, float]:
        return {}

    def restore(self, counters: dict[str, float]) -> None:
        """Nothing beyond the policy's old copy, checkpointed with the weights."""


def draw_noises(sample: Trajectory, count: int, *, seed: int, step: int, stream: str) -> Tensor:
    """``count`` noises [K, N, C] shaped like the sample's clean latent, from its coordinates and
    ``stream``/k (never from the batch layout)."""
    assert sample.final_latents is not None  # the core fetched them
    shape = tuple(sample.final_latents.shape)
    return torch.stack(
        [
            sample_noise(
                shape,
                seed=seed,
                step=step,
                prompt_uid=sample.prompt_uid,
                sample_index=sample.sample_index,
                stream=f"{stream}/{k}",
            )
            for k in range(count)
        ]
    )


def deterministic_or_not(params: SamplerParams) -> contextlib.AbstractContextManager[None]:
    """The sampler's deterministic kernels when the settings ask for them (forwards only)."""
    return deterministic_kernels() if params.deterministic else contextlib.nullcontext()


class Objective(Protocol):
    """An algorithm's loss and what its step computes besides (see the module's docstring)."""

    metric_names: tuple[str, ...]  # what ``micro_batch`` sums, in order; reported as per-entry means
    keeps_old_policy: bool  # the policy's old copy is part of the state (checkpointed)

    def begin(
        self,
        batch: Sequence[Trajectory],
        params: SamplerParams,
        minis: list[list[int]],
        *,
        seed: int,
        step: int,
        version: int,
        steps_done: int,
    ) -> dict[str, float]:
        """Before the first update: ``minis`` are the mini-batches' rows, ``version`` the trainer's
        policy version, ``steps_done`` the steps trained so far. Returns metrics."""
        ...

    def entries_per_sample(self) -> int:
        """The loss entries of one sample (a mini-batch's mean is over its samples' entries)."""
        ...

    def micro_batch(self, rows: Rows, scale: float, sums: Tensor, *, first: bool) -> None:
        """Forward and backward (of the loss sum times ``scale``) of ``rows``; add the detached
        sums of ``metric_names`` to ``sums`` (float64, on :attr:`Forwards.device`: the loop
        reads them once an optimizer step). ``first``: of the first mini-batch."""
        ...

    def before_update(self, first: bool) -> dict[str, float]:
        """The last check before the update (every rank calls it); raise to drop the step."""
        ...

    def end(self, *, steps_done: int, optimizer_steps: int) -> dict[str, float]:
        """After the step's updates (counters already counting them). Returns metrics."""
        ...

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """Inside, the policy is the one the rollouts sample with (what is published)."""
        ...

    def counters(self) -> dict[str, float]:
        """The objective's state a checkpoint keeps besides tensors."""
        ...

    def restore(self, counters: dict[str, float]) -> None: ...
