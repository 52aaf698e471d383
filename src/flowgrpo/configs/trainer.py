"""The ``trainer`` section of a run's config (torch-free): what the trainer trains and how.

Every process reads it: the trainer trains by it, the coordinator computes the algorithm's
targets and checks by it (``flowgrpo.algorithms``), and the READY handshake compares a remote
trainer's with the coordinator's (``flowgrpo.config_digest``). ``trainer.algorithm`` is a tagged
union of the algorithms' sections, each defined in its package's ``config.py``.
``TrainerServiceConfig`` is the section with the process's settings (``flowgrpo serve trainer``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from flowgrpo.algorithms import algorithm_of
from flowgrpo.algorithms.awm.config import AwmConfig
from flowgrpo.algorithms.dgpo.config import DgpoConfig
from flowgrpo.algorithms.diffusion_nft.config import NftConfig
from flowgrpo.algorithms.flow_grpo.config import FlowGrpoConfig
from flowgrpo.fields import SEED_MAX, knob
from flowgrpo.models.bagel.config import GEN_PATH_LINEARS, is_gen_path
from flowgrpo.runtime.config import ServiceProcessConfig

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "AlgorithmConfig",
    "AwmConfig",
    "DgpoConfig",
    "FlowGrpoConfig",
    "LossConfig",
    "NftConfig",
    "OptimConfig",
    "PolicyConfig",
    "TrainerConfig",
    "TrainerServiceConfig",
]

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
    # truncation of the importance weight min(pi_old / pi_behaviour, is_cap) of the samples drawn
    # by another policy: an older version (async), or an FP8 rollout (TIS, as FlashRL's)
    is_cap: float = knob(2.0, 0.0, 1e6)
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
    # the same alarm on the samples an FP8 rollout drew (rollout.precision=fp8), whose log-probs
    # part from the trainer's by the quantization as well: a threshold of their own, above that
    # gap (bench/fp8_gpu.sh measures it) and below a broken weight sync's; .inf: off
    max_fp8_logp_gap: float = knob(math.inf, 0.0, math.inf, infinite=True)
    mini_batches: int = knob(2, 1, 1_000_000)  # optimizer steps per training step
    micro_batch_size: int = knob(4, 1, 65_536)  # samples per forward; 1 in deterministic mode

    def validate(self) -> None:
        if self.mini_batches < 1 or self.micro_batch_size < 1:
            raise ValueError("trainer.loss.mini_batches and micro_batch_size must be >= 1")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"trainer.loss.clip_eps={self.clip_eps} must be in (0, 1)")
        if not self.max_logp_gap >= 0:
            raise ValueError(f"trainer.loss.max_logp_gap={self.max_logp_gap} must be >= 0 (.inf: no alarm)")
        if not self.max_fp8_logp_gap >= 0:
            raise ValueError(
                f"trainer.loss.max_fp8_logp_gap={self.max_fp8_logp_gap} must be >= 0 (.inf: no alarm)"
            )
        if self.logp_old == "bypass" and math.isinf(self.max_logp_gap):
            raise ValueError(
                "trainer.loss.logp_old=bypass takes the rollout's log-probs as the old policy's: set "
                "trainer.loss.max_logp_gap (0 where rollout and trainer compute the same function) so "
                "that a rollout not sampling the trainer's weights stops the run instead of training on"
            )


# before 2026-12-05 ``trainer.algorithm`` was a name and each algorithm had a section beside it
OLD_ALGORITHM_SECTIONS = {"nft": "diffusion_nft", "awm": "awm", "dgpo": "dgpo"}


def upgraded_trainer(trainer: Mapping[str, Any]) -> dict[str, Any]:
    """A ``trainer`` section this project wrote before 2026-12-05 (a run folder's config.yaml) in
    today's layout: the named algorithm's section becomes ``trainer.algorithm``; the other
    algorithms' sections, which that run never read, are dropped. Today's layout is returned as is."""
    if not any(key in trainer for key in OLD_ALGORITHM_SECTIONS):
        return dict(trainer)
    sections = {name: trainer.get(key) for key, name in OLD_ALGORITHM_SECTIONS.items()}
    out = {key: value for key, value in trainer.items() if key not in OLD_ALGORITHM_SECTIONS}
    name = out.get("algorithm", "flow_grpo")
    if isinstance(name, str):
        section = sections.get(name)
        out["algorithm"] = {"name": name, **(section if isinstance(section, Mapping) else {})}
    return out


# ``trainer.algorithm``: one section per algorithm, its ``name`` the tag (flowgrpo.config's tagged
# unions): a recipe sets only the chosen algorithm's keys. Each class is its package's.
AlgorithmConfig = FlowGrpoConfig | NftConfig | AwmConfig | DgpoConfig
Section = TypeVar("Section", FlowGrpoConfig, NftConfig, AwmConfig, DgpoConfig)


@dataclass
class TrainerConfig:
    # "flow_grpo": the clipped policy gradient on the SDE window's log-probs; "diffusion_nft":
    # DiffusionNFT on the forward process (clean latents, an old policy; docs/algorithms.md);
    # "awm": Advantage Weighted Matching, the flow-matching loss on clean latents weighted by A
    # "dgpo": DGPO, group preferences on the forward process against a reference policy.
    # `algorithm: awm` (its defaults) or `algorithm: {name: awm, adv_clip: 2}`
    algorithm: AlgorithmConfig = field(default_factory=FlowGrpoConfig)
    checkpoint: str = (
        ""  # BAGEL folder in the published layout (only ema.safetensors + llm_config.json are read)
    )
    device: str = "cpu"
    dtype: Literal["bfloat16", "float32"] = "float32"  # frozen weights; trainable ones are fp32
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    # recompute each decoder layer's image-query work in the backward: ~6x less activation
    # memory for ~1/3 more update time (the 7B full gen path needs it at micro-batch > 1)
    activation_checkpointing: bool = False
    # checkpoint only decoder layers 0, N, 2N, ... (torchtitan's selective layer checkpointing):
    # 2 keeps half the layers' activations and recomputes half, between the two in memory and time
    activation_checkpointing_every: int = knob(1, 1, 1024)
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

    MOVED_KEYS: ClassVar[dict[str, str]] = {
        section: f"the algorithm's settings are in trainer.algorithm since 2026-12-05 (trainer.algorithm: "
        f"{{name: {name}, ...}}; trainer.algorithm.KEY=VALUE)"
        for section, name in OLD_ALGORITHM_SECTIONS.items()
    }

    def section(self, kind: type[Section]) -> Section:
        """The algorithm's section as ``kind`` (an algorithm's code asks for its own)."""
        if not isinstance(self.algorithm, kind):
            raise ValueError(f"trainer.algorithm is {self.algorithm.name}: it has no {kind.__name__}")
        return self.algorithm

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
        if self.activation_checkpointing_every != 1 and not self.activation_checkpointing:
            raise ValueError(
                f"trainer.activation_checkpointing_every={self.activation_checkpointing_every} has no "
                "effect with trainer.activation_checkpointing=false: turn it on or leave the every at 1"
            )
        algorithm_of(self).check(self, None)  # the checks that need no sampler settings


@dataclass
class TrainerServiceConfig(ServiceProcessConfig):
    """``flowgrpo serve trainer trainer.checkpoint=DIR ...``: the section and the process's settings."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def validate(self) -> None:  # here, not in TrainerConfig: in a run config "" follows model.checkpoint
        super().validate()
        if not self.trainer.checkpoint:
            raise ValueError("trainer.checkpoint is empty: set it to a BAGEL checkpoint folder")
