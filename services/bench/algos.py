"""Which algorithm learns most per image and per second? (``flowgrpo bench algos``)

Every algorithm is trained from the same base with each seed twice: as its recipe says and as a
control with ``trainer.optim.lr=0`` and the same seeds (the same prompts and noise at every
step). What it learnt is the trained run minus its control, on one of two tasks (``--task``):

- ``compose`` (default): the prompt-following task of the demo (docs/compose_task.md) on the tiny
  BAGEL that ``flowgrpo sft`` taught to draw. The figure is the held-out accuracy: the compose
  verifier's all-or-nothing score on combinations no training prompt has, ODE, the same noise at
  every validation. The control's weights never move, so its accuracy is its step-0 validation
  at every step (checked: 3 validations bitwise equal, and equal to the trained run's step 0).
  Every algorithm gets the same images (``--images``) and validates after the same numbers of
  images (``--eval-images``), whatever its batch. Per algorithm, over the seeds (median and
  range): the final accuracy, its control, the final gain in points, and the images and trainer
  seconds (``timing_s/train``) at the first validation whose gain reaches 50% and 90% of the
  best final gain (the largest median over the algorithms run); a run that never reaches it
  counts as infinite. The sample-efficiency frontier: what the reference algorithm
  (``--reference``, FlowGRPO) has learnt at the end of its budget, its median final gain over its
  control in points, is the target (a gain, not an accuracy: algorithms sampled with and without
  CFG start from controls 10 points apart); per algorithm, the images, the rollout's denoiser
  forwards (``rollout_forwards_per_image``: CFG rows counted, a branched group's shared prefix
  once) and the wall-clock (rollout + trainer seconds) at the first validation whose gain reaches
  it, and how many times fewer images than the reference that is. A reference that ends at or
  below its control sets no target. A plot (``--plot``): the gain
  against images and against trainer seconds.
- ``jpeg``: the JPEG demo (``examples/tiny_jpeg.yaml``, a random tiny model rewarded for JPEG
  compressibility), the per-step mean reward paired with the control's (step 1 precedes any
  update, so the pair agrees there). Per algorithm: the final gain (the last quarter's mean)
  absolute and relative to the control, the gain per 1k images, per trainer second and per
  rollout second, the steps at which the trained run is ahead, and the seconds spent.

Every run is its own ``flowgrpo train`` process (the ``inprocess`` launcher), ``--jobs`` at once.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from flowgrpo.services.bench.held_out import (
    Frontier,
    HeldOutCurve,
    best_final_gain,
    frontier_of,
    held_out_curve,
    held_out_row,
    print_held_out_table,
    rollout_forwards_per_image,
)
from flowgrpo.services.bench.learning import (
    HELD_OUT_KEY,
    Case,
    held_out_key,
    run_case,
    step_records,
    validations_of,
)
from flowgrpo.services.bench.stats import Figure, write_json

if TYPE_CHECKING:
    from flowgrpo.configs.run import RunConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@dataclass(frozen=True)
class Algorithm:
    recipe: str  # a recipe of examples/
    overrides: tuple[str, ...] = ()


# the JPEG demo's NFT settings (docs/LOG.md): the reference's beta 1 / adv_clip 5 learnt nothing in 9
# steps here (r stayed within 0.37-0.67); beta 0.1 / adv_clip 2 at lr 3e-3 did; 2 of 5 times
JPEG_NFT = ("trainer.algorithm=diffusion_nft", "sampling.noise_level=0", "trainer.optim.lr=3e-3",
            "trainer.algorithm.beta=0.1", "trainer.algorithm.adv_clip=2",
            "trainer.algorithm.timestep_fraction=0.5")  # fmt: skip
# The JPEG demo's algorithms (docs/algorithms.md, "on the JPEG demo")
JPEG: dict[str, Algorithm] = {
    "flow_grpo": Algorithm("tiny_jpeg.yaml"),
    # the demo's window is the first two steps: nothing before it to share. Both of these start it at
    # step 1 (one prefix step), unbranched and branched, so the pair measures what sharing changes
    "flow_grpo_late": Algorithm("tiny_jpeg.yaml", ("sampling.window_range=[1,3]",)),
    "flow_grpo_branch": Algorithm("tiny_jpeg.yaml", ("sampling.window_range=[1,3]", "sampling.branch=true")),
    "diffusion_nft": Algorithm("tiny_jpeg.yaml", JPEG_NFT),
}

AWM = ("trainer.algorithm=awm", "trainer.loss.kl_beta=3e-3", "advantages.global_std=true",
       "advantages.std_ddof=0")  # fmt: skip
# The compose task's (docs/algorithms.md, "on the prompt-following task"): FlowGRPO as
# examples/tiny_compose.yaml tunes it (a window of one SDE step, CFG 4, KL 0.04), DiffusionNFT as
# the demo (examples/tiny_demo.yaml) trains it, with and without CFG
COMPOSE: dict[str, Algorithm] = {
    # the window anywhere in the first 7 of 9 steps, each sample its own noise
    "flow_grpo": Algorithm("tiny_compose.yaml", ("sampling.branch=false", "sampling.window_range=[0,7]")),
    # the window in steps 2-6 (the recipe's), unbranched and branched: what sharing the prefix changes
    "flow_grpo_late": Algorithm("tiny_compose.yaml", ("sampling.branch=false",)),
    "flow_grpo_branch": Algorithm("tiny_compose.yaml"),
    "grpo_guard": Algorithm("tiny_compose.yaml", ("trainer.loss.mode=grpo_guard",)),
    # the same at the learning rate measured for a LoRA (rank 64, trainer.policy.kind=lora) on this
    # task: the recipe's 2e-4, tuned for full training, moved a LoRA by +2.6 points in 3,840 images;
    # 1e-3 reached +16.7 by 1,920 and lost all of it; 3e-3 fell to 0 (docs/algorithms.md)
    "grpo_guard_lr5e-4": Algorithm(
        "tiny_compose.yaml", ("trainer.loss.mode=grpo_guard", "trainer.optim.lr=5e-4")
    ),
    # GRPO-Guard on FP8 rollouts (rollout.precision=fp8; on a CPU PyTorch's reference FP8 kernel,
    # the GPU's numbers): every sample weighted by min(pi_old / pi_fp8, trainer.loss.is_cap)
    "grpo_guard_fp8": Algorithm(
        "tiny_compose.yaml",
        ("trainer.loss.mode=grpo_guard", "rollout.precision=fp8", "rollout.lora_mode=merge"),
    ),
    "diffusion_nft": Algorithm("tiny_demo.yaml", ("sampling.cfg_text_scale=4.0",)),
    "diffusion_nft_cfg_free": Algorithm("tiny_demo.yaml"),
    # AWM on the demo's rollouts (CFG-free ODE, 8 x 8), with the reference's GenEval KL (3e-3) and
    # its advantages' normalisation (the std of the whole step's rewards, ddof 0)
    "awm": Algorithm("tiny_demo.yaml", AWM),
    # the same with 4 prompts a step instead of 8 (32 images): twice the updates per image
    "awm_4prompts": Algorithm("tiny_demo.yaml", (*AWM, "data.prompts_per_step=4")),
    # DGPO on the demo's rollouts, in the reference's CFG-free mode (the base's guided velocity,
    # CFG 4, as the DPO reference and KL target), beta 100, clip 1e-3 (its first CPU check)
    "dgpo": Algorithm(
        "tiny_demo.yaml",
        (
            "trainer.algorithm=dgpo",
            "trainer.algorithm.reference_cfg=4",
            "trainer.loss.kl_beta=1e-3",
            "trainer.algorithm.clip_range=1e-3",
        ),
    ),
    # FlowGRPO without CFG (flow_grpo's fast recipe, UniGRPO): the conditional branch alone samples
    # and is trained, one forward a step instead of two
    "flow_grpo_cfg_free": Algorithm(
        "tiny_compose.yaml",
        ("sampling.branch=false", "sampling.window_range=[0,7]", "sampling.cfg_text_scale=1.0"),
    ),
}
TASKS = {"compose": COMPOSE, "jpeg": JPEG}


# --- the JPEG demo: the per-step reward ------------------------------------------------------------


@dataclass
class Curve:
    """One (algorithm, seed) pair: the paired gain and the cumulative costs at every step."""

    algorithm: str
    seed: int
    gain: list[float]  # trained - control reward, per step
    control: list[float]
    images: list[float]  # images generated up to and including the step
    trainer_s: list[float]  # trainer seconds up to and including the step
    rollout_s: list[float]

    @property
    def final_gain(self) -> float:
        quarter = max(len(self.gain) // 4, 2)
        return statistics.fmean(self.gain[-quarter:])

    @property
    def ahead(self) -> float:
        later = self.gain[len(self.gain) // 4 :]
        return sum(g > 0 for g in later) / len(later)


@dataclass
class Row:
    algorithm: str
    final_gain: Figure
    relative_gain: Figure
    gain_per_kimage: Figure
    gain_per_trainer_s: Figure
    gain_per_rollout_s: Figure
    ahead: Figure
    trainer_s: Figure
    rollout_s: Figure


def curve(algorithm: str, seed: int, trained_dir: Path, control_dir: Path) -> Curve:
    trained, control = step_records(trained_dir), step_records(control_dir)
    rewards, baseline = (
        [r["critic/rewards/mean"] for r in trained],
        [r["critic/rewards/mean"] for r in control],
    )
    if len(rewards) != len(baseline) or rewards[0] != baseline[0]:
        raise SystemExit(f"{algorithm} seed {seed}: the runs are not paired (step 1 must precede any update)")
    return Curve(
        algorithm,
        seed,
        gain=[t - c for t, c in zip(rewards, baseline, strict=True)],
        control=baseline,
        images=list(itertools.accumulate(r["trainer/samples"] for r in trained)),
        trainer_s=list(itertools.accumulate(r["timing_s/train"] for r in trained)),
        rollout_s=list(itertools.accumulate(r["timing_s/gen"] for r in trained)),
    )


def row(algorithm: str, curves: list[Curve]) -> Row:
    def fig(values: list[float], unit: str) -> Figure:
        return Figure.of(values, unit)

    gains = [c.final_gain for c in curves]
    return Row(
        algorithm,
        final_gain=fig(gains, "reward"),
        relative_gain=fig(
            [g / abs(statistics.fmean(c.control)) for g, c in zip(gains, curves, strict=True)], ""
        ),
        gain_per_kimage=fig(
            [g / c.images[-1] * 1000 for g, c in zip(gains, curves, strict=True)], "reward/kimage"
        ),
        gain_per_trainer_s=fig([g / c.trainer_s[-1] for g, c in zip(gains, curves, strict=True)], "reward/s"),
        gain_per_rollout_s=fig([g / c.rollout_s[-1] for g, c in zip(gains, curves, strict=True)], "reward/s"),
        ahead=fig([c.ahead for c in curves], ""),
        trainer_s=fig([c.trainer_s[-1] for c in curves], "s"),
        rollout_s=fig([c.rollout_s[-1] for c in curves], "s"),
    )


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'algorithm':>18} {'final gain':>30} {'relative':>22} {'gain/kimage':>30} "
        f"{'gain/trainer s':>30} {'ahead':>20} {'trainer s':>22} {'rollout s':>22}"
    )
    print(header)
    for r in rows:
        print(
            f"{r.algorithm:>18} {r.final_gain.brief('+.2e'):>30} {r.relative_gain.brief('.1%'):>22} "
            f"{r.gain_per_kimage.brief('+.2e'):>30} {r.gain_per_trainer_s.brief('+.2e'):>30} "
            f"{r.ahead.brief('.0%'):>20} {r.trainer_s.brief('.0f'):>22} {r.rollout_s.brief('.0f'):>22}"
        )
    print("median (min-max) over the seeds; gain: trained minus control reward, the last quarter's mean")


def plot(curves: list[Curve], path: str) -> None:
    _plot_lines(
        [(c.algorithm, c.images, c.trainer_s, c.gain) for c in curves],
        "reward gain over the lr = 0 control",
        "the JPEG demo, paired against lr = 0 controls (one line per seed)",
        path,
    )


def _plot_lines(
    lines: list[tuple[str, list[float], list[float], list[float]]], ylabel: str, title: str, path: str
) -> None:
    """One line per (algorithm, images, trainer seconds, gain) against images and trainer seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors: dict[str, str] = {}
    for algorithm, images, trainer_s, gain in lines:
        label = None if algorithm in colors else algorithm
        color = colors.setdefault(algorithm, f"C{len(colors)}")  # matplotlib's cycle: one per algorithm
        axes[0].plot(images, gain, color=color, alpha=0.8, label=label)
        axes[1].plot(trainer_s, gain, color=color, alpha=0.8, label=label)
    for ax, xlabel in zip(axes, ("images generated", "trainer seconds"), strict=True):
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_held_out(curves: list[HeldOutCurve], path: str) -> None:
    _plot_lines(
        [(c.algorithm, c.images, c.trainer_s, c.gain) for c in curves],
        "held-out accuracy over the lr = 0 control (points)",
        "the compose task, paired against lr = 0 controls (one line per seed)",
        path,
    )


# --- running ----------------------------------------------------------------------------------------


def images_per_step(algorithm: Algorithm, overrides: list[str]) -> int:
    cfg = run_config(algorithm, overrides)
    return cfg.data.prompts_per_step * cfg.data.group_size


def run_config(algorithm: Algorithm, overrides: list[str]) -> RunConfig:
    from flowgrpo.configs.run import load_run_config

    return load_run_config(EXAMPLES / algorithm.recipe, [*algorithm.overrides, *overrides])


def forwards_of(
    algorithms: dict[str, Algorithm], chosen: list[str], args: argparse.Namespace
) -> dict[str, float]:
    """Each chosen algorithm's rollout forwards per image (:func:`rollout_forwards_per_image`)."""
    configs = {a: run_config(algorithms[a], args.overrides) for a in chosen}
    return {a: rollout_forwards_per_image(cfg.sampling, cfg.data.group_size) for a, cfg in configs.items()}


def schedule_of(name: str, algorithm: Algorithm, args: argparse.Namespace) -> list[str]:
    """The schedule overrides that give ``algorithm`` the task's budget."""
    if args.task == "jpeg":
        return [f"schedule.steps={args.steps}"]
    per_step = images_per_step(algorithm, args.overrides)
    if args.images % per_step or args.eval_images % per_step or args.images % args.eval_images:
        raise SystemExit(
            f"{name}: --images {args.images} and --eval-images {args.eval_images} must be multiples of its "
            f"{per_step} images a step, and --images of --eval-images"
        )
    steps, every = args.images // per_step, args.eval_images // per_step
    return [f"schedule.steps={steps}", f"schedule.eval_every={every}"]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    algorithms = TASKS[args.task]
    chosen = args.algorithms or list(algorithms)
    unknown = sorted(set(chosen) - set(algorithms))
    if unknown:
        raise SystemExit(f"unknown {args.task} algorithms {unknown}: choose from {sorted(algorithms)}")
    schedules = {a: schedule_of(a, algorithms[a], args) for a in chosen}  # a bad budget stops here
    key = held_out_key(args.val_samples)
    validation = [f"data.val_samples={args.val_samples}"] if args.task == "compose" else []
    # the trained runs first: with --jobs as many as the algorithms they run side by side, and a
    # budget cut short keeps their curves (a control only repeats its step 0, checked after)
    cases = [(a, Case(s, "", args.threads, c)) for c in (False, True) for a in chosen for s in args.seeds]
    with tempfile.TemporaryDirectory(prefix="bench-algos-") as tmp:
        folder = Path(args.tabulate or args.keep or tmp)

        def run(item: tuple[str, Case]) -> None:
            name, case = item
            if args.tabulate:  # the runs are there already
                if not (folder / name / case.label / "metrics.jsonl").is_file():
                    raise SystemExit(f"--tabulate {folder}: no {name}/{case.label}/metrics.jsonl")
                return
            algorithm = algorithms[name]
            options = argparse.Namespace(
                recipe=str(EXAMPLES / algorithm.recipe),
                overrides=[*algorithm.overrides, *schedules[name], *validation, *args.overrides],
            )
            run_case(case, options, folder / name, key if args.task == "compose" else None)

        with ThreadPoolExecutor(args.jobs) as pool:
            failures = [error for error in pool.map(lambda item: _failure_of(run, item), cases) if error]
        if failures:  # every case ran: the finished runs stay in a --keep folder, and resume as finished
            again = "; the same command with --keep runs only what is missing" if args.keep else ""
            raise SystemExit(f"{len(failures)} of {len(cases)} runs failed{again}:\n" + "\n".join(failures))
        trained = [(a, case) for a, case in cases if not case.control]
        pairs = [
            (a, c.seed, folder / a / c.label, folder / a / replace(c, control=True).label) for a, c in trained
        ]
        report = (
            jpeg_report(pairs, chosen, args.plot)
            if args.task == "jpeg"
            else compose_report(
                pairs,
                chosen,
                args.plot,
                lambda curves: frontier_of(curves, args.reference, forwards_of(algorithms, chosen, args)),
                args.reference,
                key=key,
            )
        )
    write_json(args.json, {**report, "task": args.task, "algorithms": {a: algorithms[a] for a in chosen},
                           "val_samples": args.val_samples})  # fmt: skip
    return 0


def _failure_of(run: Callable[[tuple[str, Case]], None], item: tuple[str, Case]) -> str:
    """ "" where ``run(item)`` succeeded, else what stopped it (one case's failure ends no other)."""
    try:
        run(item)
    except SystemExit as stop:
        name, case = item
        print(f"{name}/{case.label} failed", file=sys.stderr, flush=True)
        return f"{name}/{case.label}: {stop}"
    return ""


def jpeg_report(
    pairs: list[tuple[str, int, Path, Path]], chosen: list[str], png: str | None
) -> dict[str, object]:
    curves = [curve(*pair) for pair in pairs]
    rows = [row(a, [c for c in curves if c.algorithm == a]) for a in chosen]
    print_table(rows)
    if png:
        plot(curves, png)
    return {"rows": rows, "curves": curves}


def compose_report(
    pairs: list[tuple[str, int, Path, Path]],
    chosen: list[str],
    png: str | None,
    frontier_of_curves: Callable[[list[HeldOutCurve]], Frontier],
    reference: str,
    *,
    key: str = HELD_OUT_KEY,
) -> dict[str, object]:
    curves = [
        held_out_curve(a, seed, trained, [v for _, v in sorted(validations_of(control, key).items())], key)
        for a, seed, trained, control in pairs
    ]
    best = best_final_gain(curves)
    frontier = frontier_of_curves(curves)
    rows = [held_out_row(a, [c for c in curves if c.algorithm == a], best, frontier) for a in chosen]
    print_held_out_table(rows, best, frontier, reference)
    if png:
        plot_held_out(curves, png)
    return {"rows": rows, "curves": curves, "best_final_gain": best, "frontier": frontier}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowgrpo bench algos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="compose")
    parser.add_argument(
        "--algorithms",
        nargs="+",
        help=f"default: the task's all (compose: {' '.join(COMPOSE)}; jpeg: {' '.join(JPEG)})",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="schedule.seed values")
    parser.add_argument("--images", type=int, default=6400, help="compose: images every algorithm generates")
    parser.add_argument("--eval-images", type=int, default=640, help="compose: images between validations")
    parser.add_argument(
        "--val-samples",
        type=int,
        default=1,
        help="compose: images per held-out prompt at every validation (data.val_samples); the accuracy "
        "is over all of them (mean@N)",
    )
    parser.add_argument("--steps", type=int, default=40, help="jpeg: steps of every run")
    parser.add_argument(
        "--reference", default="flow_grpo", help="compose: the algorithm whose final accuracy is the target"
    )
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--json", help="also write every row and every pair's curve here")
    parser.add_argument("--plot", help="write the gain curves to this PNG")
    parser.add_argument("--keep", metavar="DIR", help="keep the run folders under DIR (default: removed)")
    parser.add_argument("--tabulate", metavar="DIR", help="run nothing: tabulate the runs a --keep DIR holds")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of every run (give them first)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
