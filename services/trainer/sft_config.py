"""The config of ``flowgrpo sft`` (torch-free): supervised fine-tuning of BAGEL's gen path with
flow matching on (prompt, image) pairs, on the trainer's machinery (services/trainer/sft.py).

A recipe (``examples/sft_compose.yaml``) or ``key=value`` overrides::

    flowgrpo sft examples/sft_compose.yaml model=/ckpt/tiny data.images=/data/pairs steps=2000
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from flowgrpo.configs.trainer import OptimConfig, PolicyConfig
from flowgrpo.fields import SEED_MAX, knob
from flowgrpo.rewards.config import RewardConfig


@dataclass
class SftDataConfig:
    # an image folder: metadata.jsonl ({"file_name": ..., "text": ...} per line) and its images
    images: str = ""
    # the side of the square training images (px, a multiple of 16): each image's shorter side
    # is resized to it and the centre cropped
    resolution: int = knob(64, 16, 4096)
    # the share of samples trained without their prompt (the empty context: CFG's
    # text-unconditional branch learns from them), drawn per sample and step
    text_dropout: float = knob(0.1, 0.0, 1.0)
    max_images: int = knob(200_000, 1, 10_000_000)  # every latent is held in memory

    def validate(self) -> None:
        if not self.images:
            raise ValueError("data.images is empty: set it to an image folder (metadata.jsonl + images)")
        if self.resolution % 16:
            raise ValueError(f"data.resolution={self.resolution} must be a multiple of 16 (one token: 16 px)")


@dataclass
class SftEvalConfig:
    """Sampling held-out prompts with the ODE and scoring them (the reward's scorers); metrics
    ``eval/...`` in metrics.jsonl. The same noise every time, so evaluations compare."""

    prompts: str = ""  # a prompt file, one per line; "" = no evaluation
    every: int = knob(0, 0, 10**9)  # steps between evaluations; 0 = at the end only
    max_prompts: int = knob(200, 1, 100_000)
    images_per_prompt: int = knob(2, 1, 64)
    num_points: int = knob(15, 2, 1000)
    cfg_text_scale: float = knob(4.0, 0.0, 100.0)
    batch_size: int = knob(32, 1, 65_536)
    seed: int = knob(0, 0, SEED_MAX)
    reward: RewardConfig = field(default_factory=RewardConfig)


@dataclass
class SftConfig:
    name: str = "sft"
    run_dir: str = ""  # default runs/<name>: config.yaml, metrics.jsonl, checkpoints/, model/
    model: str = ""  # the BAGEL folder to start from (published layout)
    device: str = "cpu"
    dtype: Literal["bfloat16", "float32"] = "float32"  # frozen weights; trained ones are fp32
    # with dtype=float32: the forwards and backwards under bf16 autocast (mixed precision: the
    # weights, gradients and optimizer stay fp32), the tensor cores' rate on a GPU; the way to
    # train in bf16 when every weight trains (policy.heads, policy.text), as the compose base does
    autocast_bf16: bool = False
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig(kind="full"))  # heads: see PolicyConfig
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-4, weight_decay=0.0))
    data: SftDataConfig = field(default_factory=SftDataConfig)
    steps: int = knob(1000, 1, 10**9)
    batch_size: int = knob(64, 1, 1_000_000)  # samples per optimizer step, over every rank
    micro_batch_size: int = knob(64, 1, 65_536)  # samples per forward on one rank (at most its share)
    warmup_steps: int = knob(0, 0, 10**9)  # linear learning-rate warm-up from 0
    # after the warm-up: "constant", or "cosine" from lr down to lr * min_lr_ratio at ``steps``
    # (a run resumed with more steps stretches the rest of its cosine to the new end)
    lr_decay: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = knob(0.0, 0.0, 1.0)
    # BAGEL's training times: t = sigmoid(N(0, 1)) ("logit_normal") or U(0, 1), then shifted
    # t <- s t / (1 + (s - 1) t) by timestep_shift (1: none, BAGEL's published setting)
    timesteps: Literal["logit_normal", "uniform"] = "logit_normal"
    timestep_shift: float = knob(1.0, 0.01, 100.0)
    seed: int = knob(0, 0, SEED_MAX)  # data order, noise, times and text dropout
    log_every: int = knob(10, 1, 10**9)
    save_every: int = knob(0, 0, 10**9)  # steps between checkpoints (resumable); 0 = at the end only
    keep_last: int = knob(2, 1, 1_000_000)
    eval: SftEvalConfig = field(default_factory=SftEvalConfig)

    def validate(self) -> None:
        if not self.model:
            raise ValueError("model is empty: set it to the BAGEL folder to fine-tune")
        if self.dtype == "bfloat16" and not self.device.startswith("cuda"):
            raise ValueError("dtype=bfloat16 is for a GPU (device=cuda); use float32 on the CPU")
        if self.dtype == "bfloat16" and (self.policy.heads or self.policy.text):
            # the frozen vae2llm's and embeddings' dtypes are what tell the sampler and trainer to autocast
            raise ValueError(
                "policy.heads=true and policy.text=true train in float32: set dtype=float32 "
                "(autocast_bf16=true computes in bf16)"
            )
        if self.autocast_bf16 and self.dtype == "bfloat16":
            raise ValueError("autocast_bf16=true is for dtype=float32 (bf16 frozen weights autocast already)")
