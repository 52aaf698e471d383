"""Do the rollout and the trainer compute the same function? (``flowgrpo bench consistency``)

Two models with the same random weights in one process: the rollout's ``NativeBagelEngine``
(LoRA applied by its ``lora_mode``) and the trainer's FlowGRPO ``TrainStep`` on a LoRA
``TrainablePolicy`` (autocast over bf16 frozen weights on a GPU), each with its query path
compiled when ``--compile`` (as both services do on a GPU; the trainer's activation
checkpointing, which recomputes only in the backward, is left out). Per mode (``plain``: the batched forward;
``invariant``: ``sampling.batch_invariant``):

1. the rollout samples ``--batch`` trajectories in one batch; the trainer recomputes their window
   log-probs in micro-batches of ``--micro-batch`` (``FlowGRPOObjective.recompute``, what logp_old
   computes): the gap per window step, max |trainer - rollout| over the samples;
2. the trainer trains one step, its LoRA is published to the rollout, the rollout samples again
   and the trainer recomputes: the gap after an update (both sides at the new version);
3. the cost: the rollout's images/s and the trainer's step seconds (``--repeats`` timed runs after
   a warm-up; median and range), and how long the recompute the gap makes redundant takes.

On a CPU with the tiny model (the smoke test), ``invariant`` with ``--lora-mode peft`` gives a gap
of exactly 0 and ``plain`` does not. On an H200 (7B, bf16, compiled; ``bench/consistency_gpu.sh``)
``invariant`` + ``peft`` gives 0 after a published update, and docs/algorithms.md has the table.
The training forward's gap (``training_forward_gap``: the update's first forward, with gradients,
against the rollout) is printed too: it is what ``trainer.loss.max_logp_gap`` watches.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from flowgrpo.algorithms.flow_grpo.objective import FlowGRPOObjective
from flowgrpo.configs.trainer import LossConfig, OptimConfig, PolicyConfig, TrainerConfig
from flowgrpo.models.bagel.config import bagel_7b, tiny
from flowgrpo.models.bagel.parallelize import parallelize_bagel
from flowgrpo.models.bagel.policy import PolicyUpdate
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.bench.common import (
    DTYPES,
    SPECIAL_7B,
    SPECIAL_TINY,
    make_requests,
    open_device,
    random_bagel,
)
from flowgrpo.services.bench.stats import Figure, repeats_arg, timed, write_json
from flowgrpo.services.rollout.engine import NativeBagelEngine
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.services.trainer.step import ON_POLICY_GAP, TrainStep, Trajectory

MODES = {"plain": False, "invariant": True}


@dataclass
class Sides:
    """The rollout engine and the trainer step, on the same weights and version."""

    engine: NativeBagelEngine
    step: TrainStep
    requests: list[SampleRequest]
    lora: PolicyConfig


def build(args: argparse.Namespace, device: torch.device) -> Sides:
    cfg, special = (bagel_7b(), SPECIAL_7B) if args.model == "7b" else (tiny(), SPECIAL_TINY)
    dtype, compiled = DTYPES[args.dtype], args.compile and device.type == "cuda"
    rollout_model = random_bagel(cfg, dtype, device)
    trainer_model = random_bagel(cfg, dtype, device)  # the same seed: the same weights
    # as the services build them: the rollout compiles; the trainer compiles and checkpoints
    parallelize_bagel(rollout_model, None, compile=compiled, activation_checkpointing=False)
    engine = NativeBagelEngine(
        BagelSampler(rollout_model, None, special), args.batch, lora_mode=args.lora_mode
    )
    lora = PolicyConfig(kind="lora", lora_rank=args.lora_rank, lora_alpha=2.0 * args.lora_rank)
    policy = TrainablePolicy(trainer_model, lora)
    parallelize_bagel(policy.model, None, compile=compiled, activation_checkpointing=compiled)
    loss = LossConfig(micro_batch_size=args.micro_batch, mini_batches=1)
    step = TrainStep(policy, special, TrainerConfig(optim=OptimConfig(lr=args.lr), loss=loss))
    requests = make_requests(args.batch, args.prompt_len, special, group=args.group)
    return Sides(engine, step, requests, lora)


def sample(sides: Sides, params: SamplerParams, version: int) -> list[Trajectory]:
    out = sides.engine.generate(sides.requests, params, seed=0, step=version)
    g = torch.Generator().manual_seed(version)
    advantages = torch.randn(len(sides.requests), generator=g).clamp(-3, 3).tolist()
    return [
        Trajectory(r.prompt_uid, r.sample_index, version, a, r.prompt_ids, out.latents[i].cpu(),
                   out.log_probs[i].cpu(), out.sigmas[i].cpu())
        for i, (r, a) in enumerate(zip(sides.requests, advantages, strict=True))
    ]  # fmt: skip


def recompute(sides: Sides, batch: list[Trajectory], params: SamplerParams) -> torch.Tensor:
    """The trainer's logp_old recompute of ``batch`` [B, W], as a FlowGRPO step computes it."""
    objective = sides.step.objective
    assert isinstance(objective, FlowGRPOObjective)
    with sides.step.compute_settings():
        return objective.recompute(batch, params)


def gap_per_window_step(sides: Sides, batch: list[Trajectory], params: SamplerParams) -> list[float]:
    recomputed = recompute(sides, batch, params)
    behaviour = torch.stack([t.log_probs for t in batch])
    return (recomputed - behaviour).abs().amax(dim=0).tolist()


def publish(sides: Sides) -> None:
    """The trainer's LoRA to the rollout, as the weight publication carries it."""
    tensors: dict[str, Tensor] = {n: t.detach().clone() for n, t in sides.step.policy.published().items()}
    update = PolicyUpdate(sides.step.version, "lora", tensors, lora_rank=sides.lora.lora_rank,
                          lora_alpha=sides.lora.lora_alpha)  # fmt: skip
    sides.engine.apply_update(update)


def measure_mode(
    sides: Sides, params: SamplerParams, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """Gaps before and after one published update, then the timed costs (which train further)."""
    version = sides.step.version
    batch = sample(sides, params, version)
    before = gap_per_window_step(sides, batch, params)
    trained = sides.step.run(batch, params)
    publish(sides)
    after_batch = sample(sides, params, sides.step.version)
    after = gap_per_window_step(sides, after_batch, params)
    rollout_s = timed(lambda: sides.engine.generate(sides.requests, params, seed=0, step=99),
                      repeats=args.repeats, device=device)  # fmt: skip
    recompute_s = timed(lambda: recompute(sides, after_batch, params), repeats=args.repeats, device=device)
    step_s = timed(lambda: sides.step.run(after_batch, params), repeats=args.repeats, device=device)
    publish(sides)  # the next mode starts with both sides at one version again
    return {
        "gap_per_window_step": before,
        "gap_per_window_step_after_update": after,
        # the update's first forward (with gradients) against the rollout's log-probs: 0 means the
        # ratio is exactly 1 on-policy, not only the no-gradient recompute
        "training_forward_gap": trained[ON_POLICY_GAP],
        "rollout_images_per_s": rollout_s.per(len(sides.requests), "images/s"),
        "recompute_s": recompute_s,
        "trainer_step_s": step_s,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = open_device(args.device, "consistency")
    if device is None:
        return 1
    started = time.perf_counter()
    sides = build(args, device)
    base = SamplerParams(num_points=args.num_points, height=args.resolution, width=args.resolution,
                         cfg_text_scale=args.cfg_scale, window_size=args.window,
                         window_range=(0, min(7, args.num_points - 1)), decode_images=False)  # fmt: skip
    report: dict[str, Any] = {
        "args": vars(args),
        "once_s": {"build": time.perf_counter() - started},
        "modes": {},
    }
    for mode in args.modes:
        report["modes"][mode] = measure_mode(sides, replace(base, batch_invariant=MODES[mode]), args, device)
    _print(report)
    write_json(args.json, report)
    return 0


def _print(report: dict[str, Any]) -> None:
    a = report["args"]
    print(f"rollout batch {a['batch']}, trainer micro-batch {a['micro_batch']}, {a['model']} {a['dtype']} "
          f"on {a['device']}, compile {a['compile']}, rollout LoRA {a['lora_mode']}")  # fmt: skip
    for mode, r in report["modes"].items():
        gaps = " ".join(f"{g:.3g}" for g in r["gap_per_window_step"])
        after = " ".join(f"{g:.3g}" for g in r["gap_per_window_step_after_update"])
        print(f"{mode:<10} gap per window step {gaps}  after an update {after}  "
              f"training forward {r['training_forward_gap']:.3g}")  # fmt: skip
        figures: dict[str, Figure] = {
            k: r[k] for k in ("rollout_images_per_s", "recompute_s", "trainer_step_s")
        }
        print("           " + "  ".join(f"{k} {v.brief('.4g')}" for k, v in figures.items()))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowgrpo bench consistency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["7b", "tiny"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--compile", action="store_true", help="compile both sides' query path (CUDA only)")
    parser.add_argument("--lora-mode", choices=["merge", "peft"], default="peft",
                        help="how the rollout applies the published LoRA")  # fmt: skip
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    parser.add_argument("--batch", type=int, default=8, help="rollout samples, one batch")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--micro-batch", type=int, default=2, help="the trainer's micro-batch")
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--num-points", type=int, default=6)
    parser.add_argument("--window", type=int, default=2)
    parser.add_argument("--cfg-scale", type=float, default=4.0)
    parser.add_argument("--prompt-len", type=int, default=6)
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--repeats", type=repeats_arg, default=3)
    parser.add_argument("--json", help="also write the figures here")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
