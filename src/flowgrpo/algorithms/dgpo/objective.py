"""DGPO's objective on the trainer (docs/algorithms.md; the loop is ``TrainStep``'s).

DGPO trains on the forward process: each sample's clean latent x0 (any solver's; no log-prob, no
SDE window) is noised again at a few times t of the sampling schedule, x_t = (1 - t) x0 + t eps,
and the policy's denoising errors are compared with a reference policy's within each prompt
group, weighted by the advantages, in one log-sigmoid per (group, time)
(:mod:`flowgrpo.algorithms.dgpo.loss`).

Group coupling. A sample's gradient coefficient sigmoid(s_g) A_i needs its whole group's errors,
but micro-batches and ranks split groups (the loop's mini-batches hold whole groups, checked in
``begin``). So the first micro-batch of each mini-batch runs a pass without gradients over this
rank's share of it (the current, reference and old policies' errors), the groups' sums are added
over the ranks, and every sample keeps its coefficient; each micro-batch then back-propagates
sum_i c_i e_i on its own. The gradient is the unsplit group loss's for any micro-batch size and
rank count; the price is one forward without gradients of the current policy per (sample, time).

The old policy is the reference code's ``ema_ref``: old <- d old + (1 - d) current after every
optimizer step (refreshed before the next forward, so mini-batch k + 1 sees the k-th update),
d = min(rate k, max). It is the PPO-style clip's yardstick, the DPO reference with
``dgpo.reference=old``, and what rollouts sample with after ``dgpo.sample_old_after`` optimizer
steps (the reference's ``switch_ema_ref``).

The policy's trained velocity is its conditional one (no CFG), as the reference trains whatever
the rollouts' guidance; the frozen base's, the DPO reference and KL target, takes the text CFG
``dgpo.reference_cfg`` (1: conditional). Times are shared by the whole step, noises by each group
(``dgpo.shared_noise``): both are functions of (run seed, step, prompt uid[, sample index]).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from flowgrpo.algorithms.dgpo.loss import (
    denoising_error,
    dgpo_loss,
    gradient_clipped,
    group_logits,
    group_sums,
    sample_coefficients,
    surrogate_sum,
)
from flowgrpo.algorithms.diffusion_nft.loss import velocity_kl
from flowgrpo.algorithms.objective import Forwards, Rows, Trajectory
from flowgrpo.configs.trainer import DgpoConfig, LossConfig
from flowgrpo.devices import to_device
from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.models.bagel.config import is_text_path
from flowgrpo.models.bagel.sampling import with_cfg_branches
from flowgrpo.sampler_math import coordinate_seed, sample_noise, shifted_schedule
from flowgrpo.sampler_params import SamplerParams

# what the pre-pass keeps per (sample, time), reported as per-entry means in this order
VALUES = ("actor/pg_loss", "actor/dgpo/weight", "actor/dgpo/error", "actor/dgpo/error_gap",
          "actor/pg_clipfrac")  # fmt: skip


class DGPOObjective:
    """Keeps the old policy (``policy.keep_old``) and refreshes it after every optimizer step."""

    keeps_old_policy = True

    def __init__(self, forwards: Forwards, loss: LossConfig, dgpo: DgpoConfig) -> None:
        self.forwards = forwards
        self.loss = loss
        self.dgpo = dgpo
        self.metric_names = VALUES + (("actor/kl_loss",) if loss.kl_beta > 0 else ())
        policy = forwards.policy
        text = [n for n in policy.trainable() if is_text_path(n)]
        if text:  # every policy here shares one prefill per micro-batch
            raise ValueError(f"DGPO trains the gen path; {text[0]} (the language half) is trainable")
        if not policy.model.vae2llm.weight.is_meta:
            policy.keep_old()
        self.optimizer_steps = 0  # before the update not yet folded into the old policy
        self._updated = False  # an update was applied since the old policy was last refreshed
        self._decay = 0.0
        self._batch: Sequence[Trajectory] = ()
        self._params: SamplerParams | None = None
        self._coords = (0, 0)  # (seed, step)
        self._times = torch.empty(0)
        self._minis: list[list[int]] = []
        self._mini_of: dict[int, int] = {}
        self._prepared: int | None = None  # the mini-batch whose coefficients are below
        self._coefficients: dict[int, Tensor] = {}  # row -> [K] sigmoid(s_g) A_i (0: clipped)
        self._values: dict[int, Tensor] = {}  # row -> [K, len(VALUES)] float64
        self._kl_targets: dict[int, Tensor] = {}  # row -> [K, N, C] the base's velocity (kl_beta > 0)

    # --- the step ---------------------------------------------------------------------------------

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
        check_whole_groups(batch, minis)
        self._batch, self._params, self._coords = batch, params, (seed, step)
        self._minis = minis
        self._mini_of = {row: k for k, mini in enumerate(minis) for row in mini}
        self._times = self.draw_times(params, seed, step)
        self._prepared, self._updated = None, False  # an abandoned step's last check applied nothing
        return {}

    def entries_per_sample(self) -> int:
        return int(self._times.numel())

    def draw_times(self, params: SamplerParams, seed: int, step: int) -> Tensor:
        """The step's trained times [K]: distinct points among the schedule's first
        ``time_points`` (the noisiest), the same for every sample, as the reference shares them."""
        if self.dgpo.time_points > params.num_steps:
            raise ValueError(
                f"trainer.algorithm.time_points={self.dgpo.time_points} exceeds the request's schedule of "
                f"{params.num_steps} steps"
            )
        schedule = shifted_schedule(params.num_points, params.timestep_shift)[: self.dgpo.time_points]
        generator = torch.Generator().manual_seed(coordinate_seed(seed, step, "dgpo/times"))
        return schedule[torch.randperm(len(schedule), generator=generator)[: self.dgpo.trained_times]]

    def noise(self, sample: Trajectory, k: int, seed: int, step: int) -> Tensor:
        """The eps [N, C] of the sample's k-th time: its group's one draw (``shared_noise``: the
        group's samples are compared on the same x_t noise) or its own."""
        assert sample.final_latents is not None  # the core fetched them
        shape = tuple(sample.final_latents.shape)
        if not self.dgpo.shared_noise:
            return sample_noise(shape, seed=seed, step=step, prompt_uid=sample.prompt_uid,
                                sample_index=sample.sample_index, stream=f"dgpo/{k}")  # fmt: skip
        group_seed = coordinate_seed(seed, step, sample.prompt_uid, "dgpo/group", k)
        generator = torch.Generator().manual_seed(group_seed)
        return torch.randn(shape, generator=generator, dtype=torch.float32)

    def micro_batch(self, rows: Rows, scale: float, sums: Tensor, *, first: bool) -> None:
        """The mini-batch's coefficients on its first micro-batch, then each trained time in turn,
        forward and backward of sum_i c_i e_i."""
        self._refresh_old()
        mini = self._mini_of[rows[0][0]]
        if mini != self._prepared:
            self._prepare(mini)
        context = self.forwards.context([self._batch[r] for r, _ in rows], self._conditional())
        for k in range(self.entries_per_sample()):
            sums += to_device(self._time_backward(rows, context, k, scale), sums.device)

    def before_update(self, first: bool) -> dict[str, float]:
        self._updated = True  # folded into the old policy before the next forward (or at the end)
        return {}

    def end(self, *, steps_done: int, optimizer_steps: int) -> dict[str, float]:
        self._refresh_old()
        self.optimizer_steps = optimizer_steps  # the loop's count, which the refreshes followed
        self._prepared, self._coefficients, self._values, self._kl_targets = None, {}, {}, {}
        return {"actor/dgpo/old_decay": self._decay}

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        if self.optimizer_steps > self.dgpo.sample_old_after:
            return self.forwards.policy.old()
        return contextlib.nullcontext()

    def counters(self) -> dict[str, float]:
        return {}

    def restore(self, counters: dict[str, float]) -> None:
        """The old policy is checkpointed with the weights; its decay counts optimizer steps."""
        default = counters["steps_done"] * self.loss.mini_batches  # as TrainStep.restore counts them
        self.optimizer_steps = int(counters.get("optimizer_steps", default))

    # --- the pass without gradients: each sample's coefficient ----------------------------------

    def _prepare(self, mini: int) -> None:
        """Errors of this rank's share of mini-batch ``mini``, the groups' logits summed over the
        ranks, and each of its samples' coefficients and reported values."""
        rows = self.forwards.dist.share(self._minis[mini])
        errors: dict[int, Tensor] = {}  # row -> [3, K]: current, DPO reference, old
        self._kl_targets = {}
        for part in self.forwards.chunks(rows):
            self.forwards.may_stop()
            errors.update(self._errors(part))
        own = [r for r, valid in rows if valid]
        uids = sorted({self._batch[r].prompt_uid for r in self._minis[mini]})
        index = {uid: i for i, uid in enumerate(uids)}
        sizes = torch.zeros(len(uids), dtype=torch.float64)
        for r in self._minis[mini]:
            sizes[index[self._batch[r].prompt_uid]] += 1
        group = torch.tensor([index[self._batch[r].prompt_uid] for r in own], dtype=torch.long)
        advantages = self._advantages(own)
        error, ref_error, old_error = (self._stack(errors, own, j) for j in range(3))
        sums = self.forwards.dist.sum(group_sums(advantages, error, ref_error, group, len(uids)))
        logits = group_logits(sums, sizes, self.dgpo.beta)[group]  # [B, K]
        clipped = gradient_clipped(advantages, error, old_error, self.dgpo.clip_range)
        coefficients = sample_coefficients(logits, advantages, clipped)
        values = torch.stack(
            [dgpo_loss(logits), torch.sigmoid(logits), error, error - ref_error, clipped.double()], dim=-1
        )
        self._coefficients = dict(zip(own, coefficients, strict=True))
        self._values = dict(zip(own, values, strict=True))
        self._prepared = mini

    def _errors(self, part: Rows) -> dict[int, Tensor]:
        """Per valid row, its errors [3, K] (current, DPO reference, old) at every trained time,
        without gradients; each policy swapped in once for all the times."""
        policy = self.forwards.policy
        conditional = self._conditional()
        context = self.forwards.context([self._batch[r] for r, _ in part], conditional)
        with torch.no_grad():
            current = old = self._errors_of(part, context, conditional, keep=False)
            base = current
            if self.dgpo.reference == "base" or self.loss.kl_beta > 0:
                base_params = self._base_params()
                base_context = with_cfg_branches(policy.model, context, base_params)
                with policy.reference():
                    base = self._errors_of(part, base_context, base_params, keep=self.loss.kl_beta > 0)
            if self.dgpo.reference == "old" or not math.isinf(self.dgpo.clip_range):
                with policy.old():
                    old = self._errors_of(part, context, conditional, keep=False)
        ref = base if self.dgpo.reference == "base" else old
        stacked = torch.stack([current, ref, old], dim=1).double().cpu()  # [B, 3, K]
        return {r: stacked[i] for i, (r, valid) in enumerate(part) if valid}

    def _errors_of(self, part: Rows, context: KVCache, params: SamplerParams, *, keep: bool) -> Tensor:
        """The rows' errors [B, K] under the policy in place; ``keep``: its velocities are the KL's
        targets (the base's)."""
        per_time = []
        for k in range(self.entries_per_sample()):
            x0, eps, x_t, t = self._inputs(part, k)
            v = self.forwards.velocity(context, x_t, t, params)
            if keep:
                self._keep_kl_targets(part, k, v)
            per_time.append(denoising_error(v, x0, eps))
        return torch.stack(per_time, dim=1)

    def _keep_kl_targets(self, part: Rows, k: int, base: Tensor) -> None:
        for i, (r, valid) in enumerate(part):
            if valid:
                if r not in self._kl_targets:
                    self._kl_targets[r] = base.new_empty((self.entries_per_sample(), *base.shape[1:]))
                self._kl_targets[r][k] = base[i]

    # --- the pass with gradients ---------------------------------------------------------------------

    def _time_backward(self, rows: Rows, context: KVCache, k: int, scale: float) -> Tensor:
        """Forward and backward of the rows at the k-th time; the detached sums of the metrics."""
        x0, eps, x_t, t = self._inputs(rows, k)
        v = self.forwards.velocity(context, x_t, t, self._conditional())
        error = denoising_error(v, x0, eps)
        mask = to_device(torch.tensor([float(valid) for _, valid in rows]), v.device)
        coefficients = to_device(
            torch.stack(
                [
                    self._coefficients[r][k] if valid else torch.zeros((), dtype=torch.float64)
                    for r, valid in rows
                ]
            ),
            v.device,
        )
        kl = self._kl(rows, k, v) if self.loss.kl_beta > 0 else None
        torch.autograd.backward(surrogate_sum(error, coefficients, mask, kl, self.loss.kl_beta) * scale)
        own = [self._values[r][k] for r, valid in rows if valid]
        parts = torch.stack(own).sum(dim=0) if own else torch.zeros(len(VALUES), dtype=torch.float64)
        if kl is not None:
            parts = torch.cat([to_device(parts, mask.device), (kl.detach() * mask).sum().double().view(1)])
        return parts

    def _kl(self, rows: Rows, k: int, v: Tensor) -> Tensor:
        """mean((v - v_base)^2) per row; a padding row is compared with itself (0, and masked)."""
        targets = [self._kl_targets[r][k] if valid else v[i].detach() for i, (r, valid) in enumerate(rows)]
        return velocity_kl(v, torch.stack(targets))

    # --- inputs -----------------------------------------------------------------------------------

    def _inputs(self, rows: Rows, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(x0, eps, x_t, t) of the rows at the k-th time, on the forwards' device."""
        seed, step = self._coords
        device = self.forwards.device
        x0 = to_device(torch.stack([self._batch[r].final_latents for r, _ in rows]), device)  # type: ignore[misc]
        eps = to_device(torch.stack([self.noise(self._batch[r], k, seed, step) for r, _ in rows]), device)
        t = to_device(self._times[k].expand(len(rows)), device)
        x_t = (1.0 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
        return x0, eps, x_t, t

    def _advantages(self, rows: list[int]) -> Tensor:
        clip = self.dgpo.adv_clip  # the coordinator clipped them too; the wire allows |A| <= 1e6
        return torch.tensor([self._batch[r].advantage for r in rows], dtype=torch.float64).clamp(-clip, clip)

    def _stack(self, errors: dict[int, Tensor], rows: list[int], which: int) -> Tensor:
        if not rows:  # a rank without a valid row still joins the groups' sum
            return torch.zeros(0, self.entries_per_sample(), dtype=torch.float64)
        return torch.stack([errors[r][which] for r in rows])

    def _conditional(self) -> SamplerParams:
        """The request's settings without CFG: the policy's conditional velocity is what trains."""
        assert self._params is not None  # begin ran
        return replace(self._params, cfg_text_scale=1.0, cfg_img_scale=1.0)

    def _base_params(self) -> SamplerParams:
        """The frozen base's settings: text CFG ``reference_cfg`` (the request's interval and renorm)."""
        assert self._params is not None
        return replace(self._params, cfg_text_scale=self.dgpo.reference_cfg, cfg_img_scale=1.0)

    def _refresh_old(self) -> None:
        """Fold the last applied update into the old policy (the reference's ema_ref step)."""
        if not self._updated:
            return
        self._decay = self.dgpo.old_decay(self.optimizer_steps)
        self.forwards.policy.refresh_old(self._decay)
        self.optimizer_steps += 1
        self._updated = False


def check_whole_groups(batch: Sequence[Trajectory], minis: list[list[int]]) -> None:
    """DGPO weighs each prompt group as one: a group's samples must share a mini-batch."""
    home: dict[str, int] = {}
    for k, mini in enumerate(minis):
        for row in mini:
            uid = batch[row].prompt_uid
            if home.setdefault(uid, k) != k:
                raise ValueError(
                    f"DGPO weighs a prompt group as one, but group {uid} spans mini-batches {home[uid]} "
                    f"and {k}: make trainer.loss.mini_batches divide the step's prompt groups"
                )
