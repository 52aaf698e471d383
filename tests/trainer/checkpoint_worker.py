"""Full gen-path checkpoints in every process of a torchrun job (FSDP2 over gloo when WORLD_SIZE > 1).

Each JOB (``MODE,CKPT_DIR,OUT[,DAMAGED]``) in turn, on a trainer of its own (built afresh from
CHECKPOINT, as in a process of its own). ``save``: train step 1, save the checkpoint of step 1
under CKPT_DIR, train step 2. ``save_async``: the same with a background save
(``start_checkpoint``) that writes while the state is gathered and step 2 trains (its DCP
collectives on a group of their own, beside the training's). ``resume``: try to load DAMAGED
(when given), which must be refused, then resume from the newest checkpoint under CKPT_DIR and
train step 2. ``load``: resume only. Rank 0 writes the whole weights and AdamW moments as saved
or loaded, with every rank's next CPU draws (``state.safetensors``), the weights after step 2
(``after.safetensors``) and step 2's metrics; every rank writes the error it got for DAMAGED
(``refused_<rank>.txt``). Used by test_checkpoint_fsdp.py: ``python -m torch.distributed.run
--nproc_per_node N checkpoint_worker.py CHECKPOINT JOB...``.
"""

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
from flowgrpo.services.trainer.checkpoint import (
    CheckpointError,
    HostStager,
    PendingCheckpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    start_checkpoint,
)
from flowgrpo.services.trainer.distributed import (
    Dist,
    close_distributed,
    end_rank,
    full_tensor,
    init_distributed,
)
from flowgrpo.services.trainer.load import load_policy
from flowgrpo.services.trainer.step import TrainStep, Trajectory

PARAMS = SamplerParams(num_points=6, height=32, width=32, window_size=2, window_range=(0, 4),
                       deterministic=True, decode_images=False, cfg_text_scale=2.0)  # fmt: skip
PROMPTS = {"p0": [384, 5, 6, 7, 385], "p1": [384, 9, 10, 385]}
ADVANTAGES = {1: [1.0, -1.0, 0.5, -0.5], 2: [0.3, -0.2, 1.0, -1.1]}  # per training step


def trajectories(checkpoint: Path, step: int) -> list[Trajectory]:
    """The batch of training step ``step`` (1 or 2), sampled by policy version ``step - 1``."""
    sampler = BagelSampler(
        load_bagel_model(checkpoint, dtype=torch.float32), None, load_special_tokens(checkpoint)
    )
    requests = [SampleRequest(uid, i, torch.tensor(ids)) for uid, ids in PROMPTS.items() for i in range(2)]
    out = sampler.generate(requests, PARAMS, seed=3, step=step)
    return [
        Trajectory(
            r.prompt_uid,
            r.sample_index,
            step - 1,
            a,
            r.prompt_ids,
            out.latents[i],
            out.log_probs[i],
            out.sigmas[i],
        )
        for i, (r, a) in enumerate(zip(requests, ADVANTAGES[step], strict=True))
    ]


def build(checkpoint: Path, dist: Dist) -> TrainStep:
    policy = load_policy(checkpoint, PolicyConfig(kind="full"), dist, dtype=torch.float32, device="cpu")
    loss = LossConfig(mini_batches=2, micro_batch_size=1)
    return TrainStep(
        policy, load_special_tokens(checkpoint), TrainerConfig(optim=OptimConfig(lr=1e-3), loss=loss), dist
    )


def whole_state(step: TrainStep) -> dict[str, torch.Tensor]:
    """``weight/<name>`` and ``<moment>/<name>``, whole (a collective under FSDP)."""
    state = {f"weight/{n}": t.contiguous() for n, t in step.policy.published().items()}
    for name, param in step.policy.trainable().items():
        for key, value in step.optimizer.state.get(param, {}).items():
            state[f"{key}/{name}"] = full_tensor(value).contiguous()
    return state


def draws(dist: Dist) -> torch.Tensor:
    """[ranks, 3]: each rank's next draws from its CPU generator."""
    table = torch.zeros(dist.world, 3)
    table[dist.rank] = torch.rand(3)
    return dist.sum(table)


def main(checkpoint: Path, jobs: list[str]) -> None:
    torch.set_num_threads(1)
    dist = init_distributed("cpu")
    for job in jobs:
        mode, ckpt_dir, out, *damaged = job.split(",")
        run_job(checkpoint, dist, mode, (Path(ckpt_dir), Path(out), Path(damaged[0]) if damaged else None))


def run_job(checkpoint: Path, dist: Dist, mode: str, paths: tuple[Path, Path, Path | None]) -> None:
    ckpt_dir, out, damaged = paths
    step = build(checkpoint, dist)
    out.mkdir(parents=True, exist_ok=True)
    pending: PendingCheckpoint | None = None
    if mode in ("save", "save_async"):
        torch.manual_seed(dist.rank)  # a generator state of its own on each rank
        step.run(trajectories(checkpoint, 1), PARAMS)
        if mode == "save":
            save_checkpoint(ckpt_dir, step, step=1)
        else:
            pending = start_checkpoint(ckpt_dir, step, 1, HostStager(pinned=False))
    else:
        if damaged is not None:
            try:
                load_checkpoint(damaged, step)
                raise AssertionError(f"{damaged} was loaded")
            except CheckpointError as error:
                (out / f"refused_{dist.rank}.txt").write_text(str(error))
        path = latest_checkpoint(ckpt_dir)
        assert path is not None and load_checkpoint(path, step) == 1
    state = {**whole_state(step), "rng": draws(dist)}
    if dist.rank == 0:
        save_file(state, str(out / "state.safetensors"))
    if mode == "load":
        return
    metrics = step.run(trajectories(checkpoint, 2), PARAMS)
    published = {n: t.contiguous() for n, t in step.policy.published().items()}
    if dist.rank == 0:
        save_file(published, str(out / "after.safetensors"))
        (out / "metrics.json").write_text(json.dumps(metrics))
    if pending is not None:
        path = pending.wait()
        assert (path is not None) == (dist.rank == 0), path


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
    close_distributed()
    end_rank()
