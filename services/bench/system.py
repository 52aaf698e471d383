"""The whole system against its physical limit (``flowgrpo bench system``): a recipe run once per
*variant* (a name and overrides); per variant, the images/s achieved against those the matmul
peak allows, where each step's time went, and the MFU of each part.

Per variant:

1. the limit, images/s = measured matmul peak / FLOPs per image, the FLOPs counted exactly for
   the recipe (SPEC section 7): the rollout's denoising steps (every row the sampler runs: both
   CFG branches when CFG is not the identity, whatever ``cfg_interval`` says, since the sampler
   runs the empty-context branch at every step; one row per group before its window when
   branching) over the real prompts each step drew, plus the training pass
   (``trainer_flops``: logp_old where the trainer recomputes it, the update, the KL reference's
   forward when ``kl_beta > 0``; DiffusionNFT's forwards at its trained times);
2. the achieved images/s (samples trained per second of step wall time) and achieved / limit,
   which is the end-to-end MFU;
3. where each step's time went: rollout (the coordinator's ``timing_s/gen``), reward
   (``timing_s/reward``), logp_old (the trainer's ``timing_s/old_log_prob``), update
   (``timing_s/update_actor``), weight publication (the trainer's ``timing_s/update_weights`` + the
   coordinator's ``timing_s/load_weights``) and the rest, idle / overhead (negative where parts
   overlap: async, or several rollout requests scored while others generate);
4. the MFU of the rollout (its FLOPs / ``timing_s/gen``) and of the trainer (its FLOPs / logp_old
   + update time), against the same peak;
5. each GPU's peak memory in use while the variant ran (``nvidia-smi``, when there is one).

Not counted in the FLOPs (they show in the measured split instead): VAE decode, prompt prefill,
the reward model, activation checkpointing's recompute. Why one command: the limit, the achieved
rate and the split are only comparable when measured on the same machine in the same run, and
variants (e.g. a shared vs a copied base model) only when run back to back.

The peak is SPEC section 7's bf16 matmul peak (:class:`MatmulPeak`, whatever the recipe's dtype),
measured in this process before the first variant and after the last, on ``--device`` (the
services' GPU; this process keeps a CUDA context there, ~0.5 GiB, in the memory figures). The
prompt lengths are those of the run's own prompts (the coordinator's order, read back after
the run); the empty-context branch has context 0 (as ``trainer_flops`` counts it); a rollout
sampling with unmerged LoRA (``rollout.lora_mode=peft``) pays the LoRA matmuls too.

Every per-step figure is the median (min-max) over the steps after the first (the warm-up;
services/bench/stats.py). Default: the tiny CPU demo recipe; on a GPU host pass ``--recipe``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowgrpo.algorithms.objective import recomputed_rows
from flowgrpo.configs.run import RunConfig, load_run_config
from flowgrpo.configs.trainer import AwmConfig, DgpoConfig, FlowGrpoConfig, NftConfig
from flowgrpo.data import load_split
from flowgrpo.models.bagel.checkpoint import read_bagel_config
from flowgrpo.models.bagel.config import BagelConfig
from flowgrpo.models.bagel.sampling import needs_uncond, token_grid
from flowgrpo.sampler_math import window_begin
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.bench.common import GiB, MatmulPeak, spec_step_flops
from flowgrpo.services.bench.schedule import images_per_s, steps_arg
from flowgrpo.services.bench.stats import MIN_REPEATS, Figure, ratio, write_json
from flowgrpo.services.bench.trainer_flops import nft_pass_flops, pass_flops, row_flops
from flowgrpo.services.coordinator.run import PromptOrder
from flowgrpo.services.coordinator.train import prepare_data, prepare_model, train

# the parts of a step's time: (part, the metrics whose sum it is)
SPLIT = {
    "rollout": ("timing_s/gen",),
    "reward": ("timing_s/reward",),
    "logp_old": ("timing_s/old_log_prob",),  # absent for DiffusionNFT (its old forwards are in update)
    "update": ("timing_s/update_actor",),
    "publication": ("timing_s/update_weights", "timing_s/load_weights"),
}
NOT_COUNTED = ("VAE decode", "prompt prefill", "reward model", "activation checkpointing's recompute")
BYPASSED = "actor/logp_old_bypassed"
NVIDIA_SMI = "nvidia-smi"  # the GPU memory sampler's command; absent: no memory figures


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]


def variant_arg(text: str) -> Variant:
    """``NAME[:KEY=VALUE,KEY=VALUE...]``; a comma splits only before the next ``KEY=`` (values
    such as ``[0,2]`` keep theirs)."""
    name, _, rest = text.partition(":")
    if not re.fullmatch(r"[\w.-]+", name):
        raise argparse.ArgumentTypeError(
            f"{text!r}: NAME[:KEY=VALUE,...] with a NAME of letters, digits, ._-"
        )
    overrides = tuple(re.split(r",(?=[\w.]+=)", rest)) if rest else ()
    if any("=" not in o for o in overrides):
        raise argparse.ArgumentTypeError(f"{text!r}: each override is KEY=VALUE")
    return Variant(name, overrides)


# --- FLOPs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lora:
    """The trained policy's shape, as trainer_flops takes it (``kind`` "full": no LoRA matmuls)."""

    kind: str
    rank: int
    targets: list[str]


BASE = Lora("lora", 0, [])  # no adapter: the base model's forward (the KL reference)


@dataclass(frozen=True)
class Workload:
    """What the FLOPs of one step depend on: the checkpoint's geometry and the run's config."""

    model: BagelConfig
    params: SamplerParams  # the training rollouts'
    cfg: RunConfig

    @property
    def latent_tokens(self) -> int:
        rows, cols = token_grid(self.params)
        return rows * cols

    @property
    def cfg_rows(self) -> int:
        """Rows per sample of one forward: 2 when the sampler (and the trainer) run the
        empty-context branch, else 1."""
        return 2 if needs_uncond(self.params) else 1

    def lora(self) -> Lora:
        policy = self.cfg.trainer.policy
        return Lora(policy.kind, policy.lora_rank, list(policy.lora_targets))


def rollout_flops(work: Workload, prompts: list[tuple[str, int]], step: int) -> float:
    """Forward FLOPs of one step's rollout over its prompt groups (uid, prompt length): each
    denoising step's rows, G per group (one before the group's window when branching: a group
    never split across sampler batches is assumed), conditional then empty-context."""
    params, group = work.params, work.cfg.data.group_size
    begins = [window_begin(params, work.cfg.schedule.seed, step, uid) for uid, _ in prompts]
    total = 0.0
    for i in range(params.num_steps):
        rows = [1 if params.branch and i < begin else group for begin in begins]
        cond = [length for (_, length), n in zip(prompts, rows, strict=True) for _ in range(n)]
        total += spec_step_flops(work.model, work.latent_tokens, cond + [0] * len(cond) * (work.cfg_rows - 1))
        total += len(cond) * work.cfg_rows * unmerged_lora_row_flops(work)
    return total


def unmerged_lora_row_flops(work: Workload) -> float:
    """The LoRA matmuls a rollout row adds when it samples with unmerged adapters
    (``rollout.lora_mode=peft``); 0 when merged or when nothing is LoRA."""
    lora = work.lora()
    if work.cfg.rollout.lora_mode != "peft" or lora.kind != "lora":
        return 0.0
    with_lora = row_flops(
        work.model, work.latent_tokens, 0, kind="lora", rank=lora.rank, targets=lora.targets
    )
    return (
        with_lora.forward
        - row_flops(work.model, work.latent_tokens, 0, kind="lora", rank=0, targets=[]).forward
    )


def training_flops(work: Workload, lengths: list[int], *, recomputed: bool) -> dict[str, float]:
    """FLOPs of one training step over trajectories with prompts of ``lengths`` tokens (in the
    batch's order, the prompts' groups one after the other): "logp_old" (its recompute, of the
    rows after the first mini-batch, whose own forwards give theirs; or DiffusionNFT's old-policy
    forward, timed in update), "reference" (the KL reference's forward: the base, no LoRA),
    "update" (forward + backward)."""
    trainer = work.cfg.trainer
    if isinstance(trainer.algorithm, DgpoConfig):
        return dgpo_flops(work, lengths, trainer.algorithm)
    flops = pass_rows(work, lengths, work.lora())
    algorithm = trainer.algorithm
    old_forward = isinstance(algorithm, NftConfig) or (
        isinstance(algorithm, AwmConfig) and algorithm.ema_kl_beta > 0
    )
    later = [lengths[row] for row in recomputed_rows(len(lengths), trainer.loss.mini_batches)]
    recompute = pass_rows(work, later, work.lora())["old"] if later else 0.0
    return {
        "logp_old": flops["old"] if old_forward else recompute if recomputed else 0.0,
        "reference": pass_rows(work, lengths, BASE)["old"] if trainer.loss.kl_beta > 0 else 0.0,
        "update": flops["update"],
    }


def dgpo_flops(work: Workload, lengths: list[int], dgpo: DgpoConfig) -> dict[str, float]:
    """DGPO's step: at each trained time, the coupling pass's forwards without gradients (the
    current policy's, and the old policy's where the DPO reference or the clip needs it: in
    "logp_old"; the frozen base's, with its CFG rows at ``reference_cfg`` > 1, where the DPO
    reference or the KL target is the base: "reference"), then a forward-backward of the
    conditional velocity ("update"). The trained velocity is the conditional one, CFG or not."""
    conditional = pass_rows(work, lengths, work.lora(), cfg_rows=1)
    old_pass = dgpo.reference == "old" or not math.isinf(dgpo.clip_range)
    base_pass = dgpo.reference == "base" or work.cfg.trainer.loss.kl_beta > 0
    base_rows = 2 if dgpo.reference_cfg > 1 else 1
    return {
        "logp_old": conditional["old"] * (2 if old_pass else 1),
        "reference": pass_rows(work, lengths, BASE, cfg_rows=base_rows)["old"] if base_pass else 0.0,
        "update": conditional["update"],
    }


def pass_rows(
    work: Workload, lengths: list[int], lora: Lora, *, cfg_rows: int | None = None
) -> dict[str, float]:
    """The trainer's forwards and backwards per trajectory: FlowGRPO's at each window step,
    DiffusionNFT's, AWM's and DGPO's at each trained time (the old forward: NFT's old policy, AWM's
    average); one row per CFG branch the trainer runs (it calls the sampler's ``guided_velocity``;
    ``cfg_rows``: another count than the sampler's). ``pass_flops`` counts both branches;
    ``nft_pass_flops`` the rows it is given (the conditional ones, and with CFG the empty-context
    ones too)."""
    algorithm = work.cfg.trainer.algorithm
    rows_per_sample = work.cfg_rows if cfg_rows is None else cfg_rows
    if isinstance(algorithm, NftConfig):
        times = algorithm.trained_times(work.params.num_steps)
    elif isinstance(algorithm, AwmConfig):
        times = algorithm.train_times
    elif isinstance(algorithm, DgpoConfig):
        times = algorithm.trained_times
    else:
        times = work.params.window_size
    geometry, kind, rank, targets = (work.model, work.latent_tokens), lora.kind, lora.rank, lora.targets
    if isinstance(algorithm, FlowGrpoConfig) and rows_per_sample == 2:  # the window's SDE steps
        return pass_flops(*geometry, lengths, times, kind=kind, rank=rank, targets=targets)
    rows = lengths + [0] * len(lengths) * (rows_per_sample - 1)  # the forward process, or CFG-free
    return nft_pass_flops(*geometry, rows, times, kind=kind, rank=rank, targets=targets)


def step_prompts(cfg: RunConfig, steps: int) -> list[list[tuple[str, int]]]:
    """The (uid, token count) of the prompt groups each step drew: the coordinator's training
    order (a function of the split and the seed) at the step."""
    cfg = prepare_data(prepare_model(cfg))  # the run made both already: this only resolves them
    split = load_split(cfg.data.dataset, "train", model_path=cfg.model.checkpoint)
    order = PromptOrder(len(split), cfg.schedule.seed, cfg.data.prompts_per_step)
    rows = [[split[row] for row in order.batch(s)] for s in range(1, steps + 1)]
    return [[(r.prompt_uid, int(r.prompt_ids.size)) for r in step] for step in rows]


def step_flops(work: Workload, prompts: list[tuple[str, int]], metrics: dict[str, float]) -> dict[str, Any]:
    step = int(metrics["training/global_step"])
    lengths = [length for _, length in prompts for _ in range(work.cfg.data.group_size)]
    recomputed = metrics.get(BYPASSED, 0.0) == 0.0
    return {"step": step, "prompt_lengths": [length for _, length in prompts],
            "logp_old_recomputed": recomputed, "rollout": rollout_flops(work, prompts, step),
            **training_flops(work, lengths, recomputed=recomputed)}  # fmt: skip


def per_image(flops: list[dict[str, Any]], images: float) -> dict[str, float]:
    """FLOPs per trained image over the given steps, by part and in all."""
    parts = {k: sum(f[k] for f in flops) / images for k in ("rollout", "logp_old", "reference", "update")}
    return parts | {"total": sum(parts.values())}


# --- time ----------------------------------------------------------------------------------------


def split_of(metrics: dict[str, float]) -> dict[str, float]:
    """Seconds of each part of one step, the step, and idle = the step less the parts."""
    parts = {part: sum(metrics.get(key, 0.0) for key in keys) for part, keys in SPLIT.items()}
    return parts | {"idle": metrics["timing_s/step"] - sum(parts.values()), "step": metrics["timing_s/step"]}


def mfu_per_step(flops: list[float], seconds: list[float], peak_flops: float) -> Figure:
    return Figure.of([f / s / peak_flops for f, s in zip(flops, seconds, strict=True)], "MFU")


class MemorySampler:
    """Each GPU's memory in use every 500 ms (``nvidia-smi`` in a subprocess) while inside;
    ``peak_gib``: the largest per GPU, or None where there is no ``nvidia-smi``."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.peak_gib: dict[str, float] | None = None

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        smi = shutil.which(NVIDIA_SMI)
        if smi is None:
            yield
            return
        query = [smi, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits", "-lms", "500"]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as out:
            process = subprocess.Popen(query, stdout=out, stderr=subprocess.DEVNULL)
        try:
            yield
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            self.peak_gib = peaks(self.log.read_text())


def peaks(csv: str) -> dict[str, float]:
    """``index, MiB`` lines -> the largest GiB per GPU index."""
    out: dict[str, float] = {}
    for line in csv.splitlines():
        index, _, mib = line.partition(",")
        with contextlib.suppress(ValueError):
            out[index.strip()] = max(out.get(index.strip(), 0.0), float(mib) * (1 << 20) / GiB)
    return out


# --- one variant ----------------------------------------------------------------------------------


def run_variant(variant: Variant, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One run of the recipe with the variant's overrides: every step's metrics and FLOPs, and
    the GPUs' peak memory; :func:`summarise` makes the figures."""
    cfg = load_run_config(args.recipe, variant_overrides(variant, args, folder))
    memory = MemorySampler(folder / f"{variant.name}-gpu-memory.csv")
    with memory.sampling():
        history = train(cfg, progress=args.progress)
    needed = MIN_REPEATS + (2 if args.mode == "async" else 1)  # a warm-up first; async: a drain last
    if len(history) < needed:
        raise SystemExit(f"{len(history)} steps: the figures of --mode {args.mode} need >= {needed}")
    resolved = prepare_model(cfg)
    work = Workload(read_bagel_config(resolved.trainer.checkpoint), cfg.sampling.params(), resolved)
    prompts = step_prompts(cfg, len(history))
    flops = [step_flops(work, prompts[int(m["training/global_step"]) - 1], m) for m in history]
    gpu_memory = memory.peak_gib if memory.peak_gib is not None else "no nvidia-smi: not measured"
    return {"overrides": list(variant.overrides), "gpu_memory_gib": gpu_memory, "flops_per_step": flops,
            "steps": history}  # fmt: skip


def variant_overrides(variant: Variant, args: argparse.Namespace, folder: Path) -> list[str]:
    """The benchmark's (a fresh run folder, the schedule, no validation or saves), then the
    command's, then the variant's own: the later wins."""
    steps = [f"schedule.steps={args.steps}"] if args.steps else []  # default: the recipe's
    launcher = [f"launch.launcher={args.launcher}"] if args.launcher else []
    return [f"run_dir={folder / variant.name}", f"schedule.mode={args.mode}", *steps, "schedule.eval_every=0",
            "schedule.save_every=0", *launcher, *args.overrides, *variant.overrides]  # fmt: skip


def used_peak(peak: MatmulPeak) -> Figure:
    """The measured peak (TFLOP/s) whose median is :attr:`MatmulPeak.used`."""
    return peak.after if peak.after is not None and peak.after.median > peak.before.median else peak.before


def summarise(run: dict[str, Any], peak: Figure, mode: str) -> dict[str, Any]:
    """The figures of a run's steady steps against the peak (TFLOP/s): after the warm-up, and in
    async before the last (which drains: no next rollout runs beside its training). The limit's
    range is what the peak's measured range allows."""
    end = -1 if mode == "async" else None
    steady, flops, peak_flops = run["steps"][1:end], run["flops_per_step"][1:end], peak.median * 1e12
    fpi = per_image(flops, sum(m["trainer/samples"] for m in steady))
    achieved = images_per_s(steady)
    limit = peak.scaled(1e12 / fpi["total"], "images/s")
    splits = [split_of(m) for m in steady]
    split_s = {part: Figure.of([s[part] for s in splits]) for part in splits[0]}
    trained = [f["logp_old"] + f["reference"] + f["update"] for f in flops]
    return {
        "flops_per_image": fpi,
        "not_counted": list(NOT_COUNTED),
        "limit_images_per_s": limit,
        "images_per_s": achieved,
        "achieved_over_limit": ratio(achieved, limit, "MFU"),
        "split_s": split_s,
        "share_of_step": {
            part: ratio(fig, split_s["step"], "") for part, fig in split_s.items() if part != "step"
        },
        "split_per_step": splits,
        "mfu": {
            "rollout": mfu_per_step(
                [f["rollout"] for f in flops], [s["rollout"] for s in splits], peak_flops
            ),
            "trainer": mfu_per_step(trained, [s["logp_old"] + s["update"] for s in splits], peak_flops),
            "end_to_end": ratio(achieved, limit, "MFU"),
        },
    }


# --- the command ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)  # options after KEY=VALUE overrides too
    variants = args.variant or [Variant("recipe", ())]
    if len({v.name for v in variants}) < len(variants):
        raise SystemExit("two variants share a name: each gets a run folder of that name")
    device = torch.device(args.device)
    peak = MatmulPeak.measure(device)
    with tempfile.TemporaryDirectory(prefix="bench-system-") as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp)
        runs = {v.name: run_variant(v, args, folder) for v in variants}
    peak.measure_after(device)
    results = {name: summarise(run, used_peak(peak), args.mode) | run for name, run in runs.items()}
    report = {"recipe": args.recipe, "mode": args.mode, "device": str(device), "peak": peak,
              "variants": results}  # fmt: skip
    _print(report, peak)
    write_json(args.json, report)
    return 0


def _print(report: dict[str, Any], peak: MatmulPeak) -> None:
    print(f"{report['recipe']} ({report['mode']}) on {report['device']}: {peak.line()}; "
          f"used {peak.used:.4g} TFLOP/s")  # fmt: skip
    print(f"FLOPs not counted (they are in the time split): {', '.join(NOT_COUNTED)}")
    for name, r in report["variants"].items():
        fpi = r["flops_per_image"]
        print(f"\n{name} {' '.join(r['overrides'])}")
        print("  FLOPs per image: " + "  ".join(f"{k} {v:.4g}" for k, v in fpi.items()))
        print(f"  limit {r['limit_images_per_s'].median:.4g} images/s   achieved {r['images_per_s']:.4g}   "
              f"achieved / limit (end-to-end MFU) {r['achieved_over_limit'].brief('.3g')}")  # fmt: skip
        print("  per step (s): " + "  ".join(f"{k} {v.brief('.3g')}" for k, v in r["split_s"].items()))
        print("  share of step: " + "  ".join(f"{k} {v.median:.1%}" for k, v in r["share_of_step"].items()))
        print("  MFU: " + "  ".join(f"{k} {v.brief('.3g')}" for k, v in r["mfu"].items()))
        memory = r["gpu_memory_gib"]
        shown = (
            "  ".join(f"GPU {i} {g:.1f}" for i, g in memory.items()) if isinstance(memory, dict) else memory
        )
        print(f"  peak GPU memory in use (GiB): {shown}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowgrpo bench system", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipe", default=str(Path(__file__).resolve().parents[2] / "examples" / "tiny_jpeg.yaml")
    )
    parser.add_argument("--variant", action="append", type=variant_arg, metavar="NAME[:KEY=VALUE,...]",
                        help="a run with these overrides (repeatable; default: one, 'recipe')")  # fmt: skip
    parser.add_argument("--steps", type=steps_arg, default=5, help="steps per variant (0: the recipe's)")
    parser.add_argument(
        "--mode", default="sync", choices=["sync", "async"], help="async: the recipe's staleness"
    )
    parser.add_argument("--launcher", choices=["local", "inprocess"], help="default: the recipe's")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the matmul peak is measured")  # fmt: skip
    parser.add_argument("--json", help="also write the figures (and every step's metrics) here")
    parser.add_argument("--keep", metavar="DIR", help="keep the run folders under DIR (default: removed)")
    parser.add_argument("--progress", action="store_const", const=sys.stderr, default=None,
                        help="print each step's line")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of the recipe, for every variant")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
