"""One FlowGRPO step of each policy KIND in turn (a policy and step of its own each, in the one
process group) in every process of a torchrun job (FSDP2 over gloo when WORLD_SIZE > 1); rank 0
writes each KIND's published tensors and metrics into OUT/KIND. Used by test_fsdp.py: run as
``python -m torch.distributed.run --nproc_per_node N fsdp_worker.py CHECKPOINT OUT KIND...``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from flowgrpo.configs.trainer import LossConfig, OptimConfig, PolicyConfig, TrainerConfig
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.trainer.distributed import Dist, close_distributed, end_rank, init_distributed
from flowgrpo.services.trainer.load import load_policy
from flowgrpo.services.trainer.step import TrainStep, Trajectory

PARAMS = SamplerParams(num_points=6, height=32, width=32, window_size=2, window_range=(0, 4),
                       deterministic=True, decode_images=False, cfg_text_scale=2.0)  # fmt: skip
PROMPTS = {"p0": [384, 5, 6, 7, 385], "p1": [384, 9, 10, 385], "p2": [384, 11, 385]}
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 2.0]  # 5 samples: uneven over 2 ranks (masked, not duplicated)


def trajectories(checkpoint: Path) -> list[Trajectory]:
    sampler = BagelSampler(
        load_bagel_model(checkpoint, dtype=torch.float32), None, load_special_tokens(checkpoint)
    )
    pairs = [("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1), ("p2", 0)]
    requests = [SampleRequest(uid, i, torch.tensor(PROMPTS[uid])) for uid, i in pairs]
    out = sampler.generate(requests, PARAMS, seed=3, step=0)
    return [
        Trajectory(
            r.prompt_uid, r.sample_index, 0, a, r.prompt_ids, out.latents[i], out.log_probs[i], out.sigmas[i]
        )
        for i, (r, a) in enumerate(zip(requests, ADVANTAGES, strict=True))
    ]


def main(checkpoint: Path, out: Path, kinds: list[str]) -> None:
    torch.set_num_threads(1)
    dist = init_distributed("cpu")
    for kind in kinds:  # each a policy and a step of its own, as in a process of its own
        one_kind(checkpoint, kind, out / kind, dist)


def one_kind(checkpoint: Path, kind: str, out: Path, dist: Dist) -> None:
    config = PolicyConfig(kind=kind, lora_rank=4, lora_alpha=8.0)  # type: ignore[arg-type]
    # meta-device construction, FSDP2 sharding, then each rank reads its own rows of the file
    policy = load_policy(checkpoint, config, dist, dtype=torch.float32, device="cpu", keep_reference=True)
    # KL on: the second mini-batch's policy differs from the reference (sharded for full training)
    loss = LossConfig(mini_batches=2, micro_batch_size=1, kl_beta=0.5)
    step = TrainStep(
        policy, load_special_tokens(checkpoint), TrainerConfig(optim=OptimConfig(lr=1e-3), loss=loss), dist
    )
    metrics = step.run(trajectories(checkpoint), PARAMS)
    published = {n: t.contiguous() for n, t in policy.published().items()}
    if dist.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(published, str(out / "published.safetensors"))
        (out / "metrics.json").write_text(json.dumps(metrics))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
    close_distributed()
    end_rank()
