"""One training step over a batch of trajectories: the optimizer loop, whatever the algorithm.

The loop owns the optimizer, the policy version and the stop checks; the algorithm's objective
(``flowgrpo.algorithms.<name>.objective``) computes what the step needs before its updates, the
loss of each micro-batch, and what follows the updates:

1. ``objective.begin``: e.g. FlowGRPO's logp_old recompute, DiffusionNFT's times and noises;
2. the batch is cut into ``loss.mini_batches`` mini-batches, one optimizer step each; a
   mini-batch runs in micro-batches of ``loss.micro_batch_size`` samples whose gradients
   accumulate (``objective.micro_batch``: forward, loss, backward);
3. before each update, ``objective.before_update`` (FlowGRPO's weight-sync alarm may stop the
   step there, nothing updated); after the last, ``objective.end`` (DiffusionNFT's old policy).

On a GPU with bf16 frozen weights, the forwards run under bf16 autocast (``compute_autocast``, which
the rollout's sampler enters too: both compute the same bf16 function):
the fp32 trainable tensors (LoRA A/B, or an unsharded fp32 gen path) are cast to bf16 for their
matmuls and receive fp32 gradients, as the frozen bf16 matmuls do. Without it peft runs every LoRA
matmul in fp32 (CUDA cores, ~1/15 of the bf16 rate) and a one-process fp32 gen path cannot meet
the bf16 und path at all. On the CPU (fp32 tests) nothing changes: autocast is never entered.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from flowgrpo.algorithms import algorithm_of
from flowgrpo.algorithms.awm.objective import AWMObjective
from flowgrpo.algorithms.dgpo.objective import DGPOObjective
from flowgrpo.algorithms.diffusion_nft.objective import DiffusionNFTObjective
from flowgrpo.algorithms.flow_grpo.objective import ON_POLICY_GAP, FlowGRPOObjective, LogProbGapError
from flowgrpo.algorithms.grpo_guard.objective import GRPOGuardObjective
from flowgrpo.algorithms.objective import Forwards, Objective, Trajectory, mini_batch_rows, stop_nothing
from flowgrpo.configs.trainer import AwmConfig, DgpoConfig, LossConfig, NftConfig, OptimConfig, TrainerConfig
from flowgrpo.models.bagel.config import SpecialTokens
from flowgrpo.models.bagel.sampling import lora_inputs_uncast
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.trainer.distributed import Dist, full_tensor
from flowgrpo.services.trainer.policy import TrainablePolicy

__all__ = ["ON_POLICY_GAP", "LogProbGapError", "TrainStep", "Trajectory", "adamw", "apply_gradients"]


def make_objective(forwards: Forwards, cfg: TrainerConfig) -> Objective:
    """The objective of ``cfg``'s algorithm (``flowgrpo.algorithms``)."""
    name = algorithm_of(cfg).name
    if name == "diffusion_nft":
        return DiffusionNFTObjective(forwards, cfg.loss, cfg.section(NftConfig))
    if name == "awm":
        return AWMObjective(forwards, cfg.loss, cfg.section(AwmConfig))
    if name == "dgpo":
        return DGPOObjective(forwards, cfg.loss, cfg.section(DgpoConfig))
    if name == "grpo_guard":
        return GRPOGuardObjective(forwards, cfg.loss)
    return FlowGRPOObjective(forwards, cfg.loss)


class TrainStep:
    """Owns the optimizer and the policy version; ``run`` trains on one batch."""

    def __init__(
        self,
        policy: TrainablePolicy,
        special: SpecialTokens,
        cfg: TrainerConfig,
        dist: Dist | None = None,
    ) -> None:
        self.policy = policy
        self.dist = dist or Dist()
        self.loss: LossConfig = cfg.loss
        self.optim_config: OptimConfig = cfg.optim
        self.optimizer = adamw(policy, cfg.optim)
        self.forwards = Forwards(policy, special, self.dist, cfg.loss.micro_batch_size)
        self.objective = make_objective(self.forwards, cfg)
        self.version = 0  # weight publications so far
        self.steps_done = 0
        self.optimizer_steps = 0  # updates applied or skipped (non-finite gradients) so far
        self._may_stop: Callable[[], None] = stop_nothing  # the running step's stop check (see run)

    # --- the step -----------------------------------------------------------------------------

    def run(
        self,
        batch: Sequence[Trajectory],
        params: SamplerParams,
        may_stop: Callable[[], None] | None = None,
        *,
        seed: int = 0,
        step: int = 0,
    ) -> dict[str, float]:
        """Train on ``batch``. ``may_stop`` is called between micro-batches until the first
        optimizer update (it raises to abandon the step): before it, nothing of the step has
        touched the weights or the optimizer, so an abandoned step leaves the trainer as it was;
        once an update is applied the step runs to its end. ``seed`` and ``step`` are the
        coordinates of whatever a step draws at random (FlowGRPO draws nothing)."""
        if not batch:
            raise ValueError("a training step needs at least one trajectory")
        self._set_may_stop(may_stop or stop_nothing)
        self.forwards.begin_step(batch)
        try:
            with self.compute_settings():
                return self._run(batch, params, seed, step)
        finally:
            self.forwards.end_step()
            self._set_may_stop(stop_nothing)

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """Inside, the policy is the one rollouts sample with (what is published): FlowGRPO's is
        the trained policy itself, DiffusionNFT's its old policy."""
        return self.objective.sampling_policy()

    def _set_may_stop(self, may_stop: Callable[[], None]) -> None:
        self._may_stop = self.forwards.may_stop = may_stop

    def _run(
        self, batch: Sequence[Trajectory], params: SamplerParams, seed: int, step: int
    ) -> dict[str, float]:
        minis = mini_batch_rows(len(batch), self.loss.mini_batches)
        lag = torch.tensor([self.version - t.policy_version for t in batch], dtype=torch.float32)
        metrics = self.objective.begin(
            batch, params, minis, seed=seed, step=step, version=self.version, steps_done=self.steps_done
        )
        started = time.perf_counter()
        totals: dict[str, float] = {}
        for k, mini in enumerate(minis):
            means, checked = self._optimizer_step(mini, first=k == 0)
            metrics.update(checked)
            for key, value in means.items():
                totals[key] = totals.get(key, 0.0) + value
        for key in ("actor/grad_norm", *self.objective.metric_names):
            metrics[key] = totals[key] / len(minis)
        metrics["actor/skipped_steps"] = totals["actor/skipped_steps"]
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        self.version += 1
        self.steps_done += 1
        metrics.update(self.objective.end(steps_done=self.steps_done, optimizer_steps=self.optimizer_steps))
        metrics["timing_s/update_actor"] = time.perf_counter() - started
        metrics.update(batch_metrics(batch, lag))
        return metrics

    def compute_settings(self) -> contextlib.AbstractContextManager[None]:
        """What every forward of a step runs inside: peft's LoRA input casts off, backward and
        recomputes included (``lora_inputs_uncast``: the rollout's sampler does the same)."""
        if not self.forwards.mixed_precision:
            return contextlib.nullcontext()
        return lora_inputs_uncast(self.policy.model)

    def _optimizer_step(self, mini: list[int], *, first: bool) -> tuple[dict[str, float], dict[str, float]]:
        """One optimizer step on the mini-batch ``mini``: its micro-batches' forwards and
        backwards, the objective's last word (which may stop the step), the update. Returns the
        mini-batch's means and what the objective's check reported."""
        self.optimizer.zero_grad(set_to_none=True)
        total = float(len(mini) * self.objective.entries_per_sample())  # every entry counts once
        scale = self.dist.world / total  # FSDP averages gradients over ranks: the mini-batch mean
        # on the device: a micro-batch's sums read back would make the host wait for its backward
        sums = torch.zeros(len(self.objective.metric_names), dtype=torch.float64, device=self.forwards.device)
        for part in self.forwards.chunks(self.dist.share(mini)):
            self._may_stop()
            self.objective.micro_batch(part, scale, sums, first=first)
        try:
            checked = self.objective.before_update(first)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)  # the step is dropped: its gradients too
            raise
        means = (self.dist.sum(sums) / total).tolist()
        self._may_stop()
        self._set_may_stop(stop_nothing)  # the update: from here on the step finishes
        grad_norm, skipped = apply_gradients(self.policy, self.optimizer, self.optim_config.grad_clip)
        self.optimizer_steps += 1
        return dict(zip(self.objective.metric_names, means, strict=True)) | {
            "actor/grad_norm": grad_norm,
            "actor/skipped_steps": float(skipped),
        }, checked

    # --- checkpoints ----------------------------------------------------------------------------

    @property
    def keeps_old_policy(self) -> bool:
        return self.objective.keeps_old_policy

    def counters(self) -> dict[str, float]:
        """What a checkpoint keeps of the step besides tensors."""
        return {
            "version": self.version,
            "steps_done": self.steps_done,
            "optimizer_steps": self.optimizer_steps,
            **self.objective.counters(),
        }

    def restore(self, counters: dict[str, float]) -> None:
        self.version, self.steps_done = int(counters["version"]), int(counters["steps_done"])
        # checkpoints written before optimizer steps were counted: every step took mini_batches
        # of them (the run config has each step's prompts divisible by mini_batches)
        self.optimizer_steps = int(counters.get("optimizer_steps", self.steps_done * self.loss.mini_batches))
        self.objective.restore(counters)


def adamw(policy: TrainablePolicy, optim: OptimConfig) -> torch.optim.AdamW:
    """The optimizer of every training step (FlowGRPO, DiffusionNFT, sft) over the trained tensors."""
    return torch.optim.AdamW(
        list(policy.trainable().values()),
        lr=optim.lr,
        betas=optim.betas,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
    )


def apply_gradients(
    policy: TrainablePolicy, optimizer: torch.optim.Optimizer, grad_clip: float
) -> tuple[float, bool]:
    """Clip the gradient norm and step; a non-finite norm skips the update (the caller counts it).
    Returns (norm, skipped)."""
    trainable = list(policy.trainable().values())
    norm = full_tensor(torch.nn.utils.clip_grad_norm_(trainable, grad_clip))
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return float(norm), True
    optimizer.step()
    return float(norm), False


def batch_metrics(batch: Sequence[Trajectory], lag: Tensor) -> dict[str, float]:
    """The batch's targets (FlowGRPO: advantages; DiffusionNFT: optimalities), lag and size."""
    advantages = torch.tensor([t.advantage for t in batch])
    return {
        "critic/advantages/mean": float(advantages.mean()),
        "critic/advantages/max": float(advantages.max()),
        "critic/advantages/min": float(advantages.min()),
        "trainer/lag/mean": float(lag.mean()),
        "trainer/lag/max": float(lag.max()),
        "trainer/samples": float(len(batch)),
    }
