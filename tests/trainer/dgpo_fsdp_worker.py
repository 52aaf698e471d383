"""One DGPO step of each policy KIND in turn (a policy and step of its own each, in the one process
group) in every process of a torchrun job (FSDP2 over gloo when WORLD_SIZE > 1); rank 0 writes each
KIND's published tensors, old policy and metrics into OUT/KIND. Used by test_dgpo_fsdp.py: run as
``python -m torch.distributed.run --nproc_per_node N dgpo_fsdp_worker.py CHECKPOINT OUT KIND...``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from flowgrpo.configs.trainer import DgpoConfig, LossConfig, OptimConfig, PolicyConfig, TrainerConfig
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.trainer.distributed import (
    Dist,
    close_distributed,
    end_rank,
    full_tensor,
    init_distributed,
)
from flowgrpo.services.trainer.load import load_policy
from flowgrpo.services.trainer.step import TrainStep, Trajectory

PARAMS = SamplerParams(num_points=6, height=32, width=32, window_size=1, window_range=(0, 5), noise_level=0.0,
                       cfg_text_scale=1.0, deterministic=True, decode_images=False)  # fmt: skip
PROMPTS = {"p0": [384, 5, 6, 7, 385], "p1": [384, 9, 10, 385]}
# two groups of 3, one a mini-batch: over 2 ranks each group is split (rows 0, 2 | 1 + a masked row)
ADVANTAGES = [1.0, -0.5, -0.5, 0.8, 0.2, -1.0]


def clean_samples(checkpoint: Path) -> list[Trajectory]:
    sampler = BagelSampler(
        load_bagel_model(checkpoint, dtype=torch.float32), None, load_special_tokens(checkpoint)
    )
    requests = [SampleRequest(uid, i, torch.tensor(ids)) for uid, ids in PROMPTS.items() for i in range(3)]
    out = sampler.generate(requests, PARAMS, seed=3, step=0)
    none = torch.empty(0)
    return [
        Trajectory(r.prompt_uid, r.sample_index, 0, a, r.prompt_ids, none, none, none, out.final_latents[i])
        for i, (r, a) in enumerate(zip(requests, ADVANTAGES, strict=True))
    ]


def main(checkpoint: Path, out: Path, kinds: list[str]) -> None:
    torch.set_num_threads(1)
    dist = init_distributed("cpu")
    for kind in kinds:  # each a policy and a step of its own, as in a process of its own
        one_kind(checkpoint, kind, out / kind, dist)


def one_kind(checkpoint: Path, kind: str, out: Path, dist: Dist) -> None:
    config = PolicyConfig(kind=kind, lora_rank=4, lora_alpha=8.0)  # type: ignore[arg-type]
    policy = load_policy(checkpoint, config, dist, dtype=torch.float32, device="cpu", keep_reference=True)
    # the second mini-batch sees the first update: its groups weigh != 1/2, its old policy has moved;
    # a guided base (a CFG branch) as the reference and the KL target
    loss = LossConfig(mini_batches=2, micro_batch_size=1, kl_beta=0.5)
    dgpo = DgpoConfig(trained_times=2, time_points=3, reference_cfg=2.0, old_decay_rate=0.5, clip_range=1.0)
    trainer = TrainerConfig(algorithm=dgpo, optim=OptimConfig(lr=1e-3), loss=loss)
    step = TrainStep(policy, load_special_tokens(checkpoint), trainer, dist)
    metrics = step.run(clean_samples(checkpoint), PARAMS, seed=1, step=1)
    published = {n: t.contiguous() for n, t in policy.published().items()}
    old = {n: full_tensor(t).contiguous() for n, t in policy.old_state().items()}
    if dist.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(published, str(out / "published.safetensors"))
        save_file(old, str(out / "old.safetensors"))
        (out / "metrics.json").write_text(json.dumps(metrics))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
    close_distributed()
    end_rank()
