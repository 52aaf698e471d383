"""The ``trainer`` section of a run's config (torch-free): what the trainer trains and how.

Every process reads it: the trainer trains by it, the coordinator computes the algorithm's
targets and checks by it (``flowgrpo.algorithms``), and the READY handshake compares a remote
trainer's with the coordinator's (``flowgrpo.config_digest``). The trainer service's own process
settings (``TrainerServiceConfig``) stay with the service."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from flowgrpo.algorithms import algorithm_of
from flowgrpo.fields import SEED_MAX, knob
from flowgrpo.models.bagel.config import GEN_PATH_LINEARS, is_gen_path
from flowgrpo.runtime.config import ServiceProcessConfig

DEFAULT_LORA_TARGETS = list(GEN_PATH_LINEARS)  # q/k/v/o and the MLP of the gen path


@dataclass
class PolicyConfig:
    kind: Literal["lora", "full"] = "lora"
    lora_rank: int = knob(64, 1, 65_536)
    lora_alpha: float = knob(128.0, 0.0, 1e6)
    lora_targets: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    lora_init: Literal["gaussian", "zero_b"] = "gaussian"  # both start with B = 0: the base policy
    init_seed: int = knob(0, 0, SEED_MAX)  # the LoRA A initialisation is a function of this seed alone
    # full: also train the generation heads (vae2llm, llm2vae, time_embedder), as a model's own
    # pre-training does (flowgrpo sft from a random model). FlowGRPO trains the gen path alone
    heads: bool = False
    # full: also train the language half (token embeddings and the und path), as a model's
    # pre-training does; without it the prompt is read by whatever und path the folder holds
    # (a random one in a drawer just made). flowgrpo sft only: FlowGRPO leaves und frozen
    text: bool = False

    def validate(self) -> None:
        if self.heads and self.kind != "full":
            raise ValueError("trainer.policy.heads=true trains the heads in full: set policy.kind=full")
        if self.text and self.kind != "full":
            raise ValueError("trainer.policy.text=true trains the und path in full: set policy.kind=full")
        if self.kind == "lora" and (self.lora_rank < 1 or self.lora_alpha <= 0):
            raise ValueError(
                f"trainer.policy.lora_rank={self.lora_rank} / lora_alpha={self.lora_alpha} must be > 0"
            )
        non_gen = [t for t in self.lora_targets if not is_gen_path(t)]
        if non_gen:
            raise ValueError(
                f"trainer.policy.lora_targets {non_gen} are outside the gen path (names need 'moe_gen')"
            )


@dataclass
class OptimConfig:
    lr: float = knob(1e-4, 0.0, 1e3)
    weight_decay: float = knob(1e-4, 0.0, 1e3)
    betas: tuple[float, float] = knob((0.9, 0.999), 0.0, 1.0)
    # tiny LoRA gradients are comparable to AdamW's eps: make it small if needed
    eps: float = knob(1e-8, 0.0, 1.0)
    grad_clip: float = knob(1.0, 0.0, 1e6)


@dataclass
class LossConfig:
    # FlowGRPO's clipped ratio ("flow_grpo"), or GRPO-Guard's re-normalised one against
    # over-optimisation ("grpo_guard": docs/algorithms.md; needs sde steps and logp_old=recompute)
    mode: Literal["flow_grpo", "grpo_guard"] = "flow_grpo"
    clip_eps: float = knob(1e-5, 0.0, 1.0)  # BAGEL recipes; 1e-4 in flow_grpo. Choose it per sde_type
    kl_beta: float = knob(0.0, 0.0, 1e6)
    is_cap: float = knob(2.0, 0.0, 1e6)  # truncation of the off-policy importance weight
    logp_old: Literal["recompute", "bypass"] = "recompute"
    # bypass: recompute (and measure the gap) every this many steps
    bypass_check_every: int = knob(10, 1, 10**9)
    # the alarm for a broken weight sync: the largest |trainer - rollout| log-prob allowed on samples
    # of the trainer's current version, measured free on the update's first forward (before any
    # update: a larger gap stops the step with nothing changed). 0 for exact numerics (rollout and
    # trainer computing the same function: deterministic CPU, peft LoRA); on a GPU the training
    # forward parts from the rollout by up to 3e-4 (docs/algorithms.md): 1e-3; .inf: off. Needed by
    # logp_old=bypass, whose ratios are only right when the rollout's log-probs are the trainer's
    max_logp_gap: float = knob(math.inf, 0.0, math.inf, infinite=True)
    mini_batches: int = knob(2, 1, 1_000_000)  # optimizer steps per training step
    micro_batch_size: int = knob(4, 1, 65_536)  # samples per forward; 1 in deterministic mode

    def validate(self) -> None:
        if self.mini_batches < 1 or self.micro_batch_size < 1:
            raise ValueError("trainer.loss.mini_batches and micro_batch_size must be >= 1")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"trainer.loss.clip_eps={self.clip_eps} must be in (0, 1)")
        if not self.max_logp_gap >= 0:
            raise ValueError(f"trainer.loss.max_logp_gap={self.max_logp_gap} must be >= 0 (.inf: no alarm)")
        if self.logp_old == "bypass" and math.isinf(self.max_logp_gap):
            raise ValueError(
                "trainer.loss.logp_old=bypass takes the rollout's log-probs as the old policy's: set "
                "trainer.loss.max_logp_gap (0 where rollout and trainer compute the same function) so "
                "that a rollout not sampling the trainer's weights stops the run instead of training on"
            )


@dataclass
class NftConfig:
    """``trainer.algorithm=diffusion_nft`` (docs/algorithms.md has the equations). Defaults: the
    reference code's (NVlabs/DiffusionNFT, SD3.5-M PickScore)."""

    # strength of the implicit policies v+- = v_old +- beta (v - v_old); 0.1 for OCR

    beta: float = knob(1.0, 0.0, 1e3)
    # advantages clipped to +-adv_clip, r = A / (2 adv_clip) + 1/2; scales the loss
    adv_clip: float = knob(5.0, 0.0, 1e6)
    # times trained per sample: int(fraction x steps) of the schedule's
    timestep_fraction: float = knob(0.99, 0.0, 1.0)
    # the old (sampling) policy after each training step: old <- d old + (1 - d) current, with
    # d = min(rate (k - after), max) after k optimizer steps in all (0 before ``after``), as the
    # reference counts its global steps; its default: after 0, rate 0.001, max 0.5; OCR: 75, 0.0075, 0.999
    old_decay_after: int = knob(0, 0, 10**9)
    old_decay_rate: float = knob(0.001, 0.0, 1.0)
    old_decay_max: float = knob(0.5, 0.0, 1.0)

    def validate(self) -> None:
        if self.beta <= 0 or self.adv_clip <= 0:
            raise ValueError(f"trainer.nft.beta={self.beta} and adv_clip={self.adv_clip} must be > 0")
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"trainer.nft.timestep_fraction={self.timestep_fraction} must be in (0, 1]")
        if not 0 <= self.old_decay_max < 1 or self.old_decay_rate < 0 or self.old_decay_after < 0:
            raise ValueError(
                f"trainer.nft.old_decay_max={self.old_decay_max} must be in [0, 1), old_decay_rate "
                f"and old_decay_after >= 0 (got {self.old_decay_rate}, {self.old_decay_after})"
            )

    def old_decay(self, optimizer_steps: int) -> float:
        """The old policy's decay after ``optimizer_steps`` optimizer steps in all."""
        if optimizer_steps < self.old_decay_after:
            return 0.0
        return min((optimizer_steps - self.old_decay_after) * self.old_decay_rate, self.old_decay_max)

    def trained_times(self, num_steps: int) -> int:
        return max(1, int(num_steps * self.timestep_fraction))


@dataclass
class AwmConfig:
    """``trainer.algorithm=awm``, Advantage Weighted Matching (docs/algorithms.md has the
    equations). Defaults: the reference code's GenEval recipe (scxue/advantage_weighted_matching,
    SD3.5-M); its KL to the reference policy is ``trainer.loss.kl_beta`` (GenEval and OCR 3e-3,
    PickScore 1e-4)."""

    # advantages clipped to +-adv_clip and divided by it: each sample's weight A in [-1, 1]
    adv_clip: float = knob(5.0, 0.0, 1e6)
    # times trained per sample: one in each of train_times equal strata of the schedule's points
    # [first, int(timestep_fraction x steps)), first = 0 with from_first_point (PickScore), else 1
    # (GenEval, OCR: t = 1, pure noise, is never trained)
    train_times: int = knob(6, 1, 10_000)
    timestep_fraction: float = knob(0.9, 0.0, 1.0)
    from_first_point: bool = False
    # the matching loss t ((mse + 1e-10)^p - 1e-10^p) / p of the velocity's mse ("ghuber"):
    # 0.25 in every reference recipe; 1 is the t-weighted mse
    loss_power: float = knob(0.25, 0.0, 1.0)
    # the pull toward an average of the past policies: ema_kl_beta mean((v - v_ema)^2); after each
    # training step ema <- d ema + (1 - d) current, d = min(rate k, max) after k optimizer steps in
    # all, as the reference counts its global steps (rate 0.001, max 0.3). 0: no average is kept
    ema_kl_beta: float = knob(1.0, 0.0, 1e6)
    ema_decay_rate: float = knob(0.001, 0.0, 1.0)
    ema_decay_max: float = knob(0.3, 0.0, 1.0)

    def validate(self) -> None:
        if self.adv_clip <= 0 or self.loss_power <= 0:
            raise ValueError(
                f"trainer.awm.adv_clip={self.adv_clip} and loss_power={self.loss_power} must be > 0"
            )
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"trainer.awm.timestep_fraction={self.timestep_fraction} must be in (0, 1]")
        if not 0 <= self.ema_decay_max < 1:
            raise ValueError(f"trainer.awm.ema_decay_max={self.ema_decay_max} must be in [0, 1)")

    def ema_decay(self, optimizer_steps: int) -> float:
        """The average's decay after ``optimizer_steps`` optimizer steps in all."""
        return min(optimizer_steps * self.ema_decay_rate, self.ema_decay_max)


@dataclass
class DgpoConfig:
    """``trainer.algorithm=dgpo`` (docs/algorithms.md has the equations). Defaults: the reference
    code's GenEval recipe (Luo-Yihong/DGPO ``config/dgpo.py``), but beta (its OCR recipe and README:
    100; GenEval's 101) and the KL weight, which is ``trainer.loss.kl_beta`` (the reference: 0.02)."""

    # the DPO temperature on a group's advantage-weighted denoising-error gap (beta_dpo); the
    # reference's EMA-reference recipe: 2000
    beta: float = knob(100.0, 0.0, 1e6)
    # advantages clipped to +-adv_clip before they weight the group (train.adv_clip_max)
    adv_clip: float = knob(5.0, 0.0, 1e6)
    # times trained per sample, distinct, shared by the whole step (num_train_timesteps) ...
    trained_times: int = knob(4, 1, 1000)
    # ... drawn from the schedule's first time_points points, the noisiest (trunc_steps + 1: 5 of
    # 10 for GenEval, 7 for OCR)
    time_points: int = knob(5, 1, 1000)
    # one noise per (group, time), as the reference's use_shared_noise; false: one per sample
    shared_noise: bool = True
    # the DPO reference: "base", the frozen loaded policy (adapters off for LoRA); "old", the
    # old policy below (use_ema_ref, with beta ~2000)
    reference: Literal["base", "old"] = "base"
    # text CFG of the frozen base's velocity, the DPO reference ("base") and the KL target
    # (kl_cfg): 1 is its conditional velocity; the CFG-free recipe's 4.5 distils guidance
    reference_cfg: float = knob(1.0, 1.0, 100.0)
    # a sample's gradient stops once its denoising error left the old policy's by more than
    # this ratio in the advantage's direction (clip_range; .inf: never)
    clip_range: float = knob(1e-2, 0.0, math.inf, infinite=True)
    # the old policy after each optimizer step: old <- d old + (1 - d) current, with
    # d = min(rate k, max) after k optimizer steps before it (the reference's ema_ref: 0.001, 0.3)
    old_decay_rate: float = knob(0.001, 0.0, 1.0)
    old_decay_max: float = knob(0.3, 0.0, 1.0)
    # rollouts sample with the old policy once more optimizer steps than this are done
    # (switch_ema_ref: 500 for GenEval and OCR, 200 for compressibility); before, with the trained one
    sample_old_after: int = knob(500, 0, 10**9)

    def validate(self) -> None:
        if self.beta <= 0 or self.adv_clip <= 0:
            raise ValueError(f"trainer.dgpo.beta={self.beta} and adv_clip={self.adv_clip} must be > 0")
        if self.trained_times > self.time_points:
            raise ValueError(
                f"trainer.dgpo.trained_times={self.trained_times} distinct times cannot be drawn from "
                f"trainer.dgpo.time_points={self.time_points} points: raise time_points or lower "
                "trained_times"
            )
        if not 0 <= self.old_decay_max < 1:
            raise ValueError(f"trainer.dgpo.old_decay_max={self.old_decay_max} must be in [0, 1)")

    def old_decay(self, optimizer_steps: int) -> float:
        """The old policy's decay for the update after ``optimizer_steps`` optimizer steps."""
        return min(optimizer_steps * self.old_decay_rate, self.old_decay_max)


Algorithm = Literal["flow_grpo", "diffusion_nft", "awm", "dgpo"]


@dataclass
class TrainerConfig:
    # "flow_grpo": the clipped policy gradient on the SDE window's log-probs; "diffusion_nft":
    # DiffusionNFT on the forward process (clean latents, an old policy; docs/algorithms.md);
    # "awm": Advantage Weighted Matching, the flow-matching loss on clean latents weighted by A
    # "dgpo": DGPO, group preferences on the forward process against a reference policy
    algorithm: Algorithm = "flow_grpo"
    checkpoint: str = (
        ""  # BAGEL folder in the published layout (only ema.safetensors + llm_config.json are read)
    )
    device: str = "cpu"
    dtype: Literal["bfloat16", "float32"] = "float32"  # frozen weights; trainable ones are fp32
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    nft: NftConfig = field(default_factory=NftConfig)
    awm: AwmConfig = field(default_factory=AwmConfig)
    dgpo: DgpoConfig = field(default_factory=DgpoConfig)
    # recompute each decoder layer's image-query work in the backward: ~6x less activation
    # memory for ~1/3 more update time (the 7B full gen path needs it at micro-batch > 1)
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile each decoder layer's image-query work (a GPU speed-up)
    checkpoint_dir: str = ""  # where trainer checkpoints go; empty: no checkpoints
    keep_last: int = knob(3, 1, 1_000_000)
    # write checkpoints in the background: SaveCheckpoint returns once the state is copied to host
    # memory (pinned on a GPU: one copy of the trained tensors and their AdamW moments), and the
    # checkpoint counts (resume, run state) only once it is whole; with schedule.save_every=1 a
    # trainer's death then costs at most the step in flight (docs/ARCHITECTURE.md)
    async_save: bool = False
    resume: bool = True  # start from the newest checkpoint in checkpoint_dir when there is one
    publish_dtype: Literal["", "bfloat16", "float32"] = ""  # dtype of published tensors; "" = as trained
    publish_bus: bool = True  # put each version on this replica's bus store (any rollout, any host)
    # also leave each version in one allocation on the trainer's GPU for rollouts on this host
    # (CUDA IPC, device-to-device); they take the bus when they cannot open it
    publish_cuda_ipc: bool = False
    # one GPU for rollout and trainer (docs/colocated.md): keep the frozen base weights in one
    # allocation exported by CUDA IPC, which rollouts with rollout.base_weights=trainer map as
    # their own weights, so the base is in GPU memory once (one trainer process only)
    share_base: bool = False
    # return the step's cached activation memory to the GPU after each step (torch.cuda
    # .empty_cache), for the rollout sharing the GPU; it is allocated again by the next step
    release_memory: bool = False

    def validate(self) -> None:
        for knob_name in ("heads", "text"):
            if getattr(self.policy, knob_name):
                raise ValueError(
                    f"trainer.policy.{knob_name}=true is for flowgrpo sft: a FlowGRPO run publishes the "
                    "gen path alone, which is all its rollouts take"
                )
        if (self.share_base or self.release_memory) and not self.device.startswith("cuda"):
            raise ValueError(
                f"trainer.share_base and trainer.release_memory are for a GPU trainer "
                f"(trainer.device={self.device!r}): set trainer.device=cuda or turn them off"
            )
        if not (self.publish_bus or self.publish_cuda_ipc):
            raise ValueError(
                "trainer.publish_bus and trainer.publish_cuda_ipc are both false: nothing publishes"
            )
        if self.publish_cuda_ipc and not self.device.startswith("cuda"):
            raise ValueError(
                f"trainer.publish_cuda_ipc needs a GPU trainer (trainer.device={self.device!r}): "
                "set trainer.device=cuda or publish over the bus only"
            )
        if self.keep_last < 1:
            raise ValueError(f"trainer.keep_last={self.keep_last} must be >= 1")
        algorithm_of(self).check(self, None)  # the checks that need no sampler settings


@dataclass
class TrainerServiceConfig(ServiceProcessConfig):
    """``flowgrpo serve trainer trainer.checkpoint=DIR ...``: the section and the process's settings."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def validate(self) -> None:  # here, not in TrainerConfig: in a run config "" follows model.checkpoint
        super().validate()
        if not self.trainer.checkpoint:
            raise ValueError("trainer.checkpoint is empty: set it to a BAGEL checkpoint folder")
