"""Which algorithm learns most per image and per second? (``flowgrpo bench algos``)

The CPU demo trained with each algorithm (FlowGRPO; FlowGRPO with shared-prefix branching;
DiffusionNFT), each seed twice: as it is and as a control with ``trainer.optim.lr=0`` and the same
seeds (the same prompts and initial noise at every step). What an algorithm learnt by step k is
the paired gain: trained reward minus control reward at step k (step 1 precedes any update, so
the pair agrees there). Cost axes, per run: images generated (steps x samples per step), trainer
seconds (``timing_s/train``: log-prob or old-policy passes and the update) and rollout seconds
(``timing_s/gen``).

Per algorithm, over the seeds (median and range): the final gain (mean paired gain over the last
quarter) absolute and relative to the control, the gain per 1k images, per trainer second and per
rollout second, the steps at which the trained run is ahead, and the seconds spent. A plot
(``--plot``): the paired gain against images generated and against trainer seconds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from flowgrpo.services.bench.learning import RECIPE, Case, run_case
from flowgrpo.services.bench.stats import Figure, write_json

# name: the overrides that make the demo recipe train with it (docs/algorithms.md)
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "flow_grpo": (),
    # the demo's window is the first two steps: nothing before it to share. Both of these start it at
    # step 1 (one prefix step), unbranched and branched, so the pair measures what sharing changes
    "flow_grpo_late": ("sampling.window_range=[1,3]",),
    "flow_grpo_branch": ("sampling.window_range=[1,3]", "sampling.branch=true"),
    # the demo's NFT settings (docs/LOG.md): the reference's beta 1 / adv_clip 5 learnt nothing in 9
    # steps here (r stayed within 0.37-0.67); beta 0.1 / adv_clip 2 at lr 3e-3 did; 2 of 5 times
    "diffusion_nft": (
        "trainer.algorithm=diffusion_nft",
        "sampling.noise_level=0",
        "trainer.optim.lr=3e-3",
        "trainer.nft.beta=0.1",
        "trainer.nft.adv_clip=2",
        "trainer.nft.timestep_fraction=0.5",
    ),
}


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


def step_records(run_dir: Path) -> list[dict[str, float]]:
    """The training records of a run, one per step (the last record of a step wins)."""
    steps: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind", "train") == "train" and "critic/rewards/mean" in record:
            steps[int(record["step"])] = record
    return [steps[k] for k in sorted(steps)]


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, algorithm in enumerate(dict.fromkeys(c.algorithm for c in curves)):
        color = f"C{index}"  # matplotlib's cycle: one colour per algorithm, however many
        for i, c in enumerate(x for x in curves if x.algorithm == algorithm):
            label = algorithm if i == 0 else None
            axes[0].plot(c.images, c.gain, color=color, alpha=0.8, label=label)
            axes[1].plot(c.trainer_s, c.gain, color=color, alpha=0.8, label=label)
    for ax, xlabel in zip(axes, ("images generated", "trainer seconds"), strict=True):
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("reward gain over the lr = 0 control")
        ax.legend()
    fig.suptitle("CPU demo, paired against lr = 0 controls (one line per seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    unknown = sorted(set(args.algorithms) - set(ALGORITHMS))
    if unknown:
        raise SystemExit(f"unknown algorithms {unknown}: choose from {sorted(ALGORITHMS)}")
    cases = [
        (a, Case(s, "", args.threads, control))
        for a in args.algorithms
        for s in args.seeds
        for control in (False, True)
    ]
    with tempfile.TemporaryDirectory(prefix="bench-algos-") as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp)

        def run(item: tuple[str, Case]) -> Path:
            algorithm, case = item
            options = argparse.Namespace(
                recipe=args.recipe,
                overrides=[*ALGORITHMS[algorithm], f"schedule.steps={args.steps}", *args.overrides],
            )
            run_case(case, options, folder / algorithm)
            return folder / algorithm / case.label

        with ThreadPoolExecutor(args.jobs) as pool:
            dirs = dict(zip(cases, pool.map(run, cases), strict=True))
        curves = [
            curve(a, case.seed, dirs[(a, case)], dirs[(a, Case(case.seed, "", args.threads, True))])
            for a, case in cases
            if not case.control
        ]
    rows = [row(a, [c for c in curves if c.algorithm == a]) for a in args.algorithms]
    print_table(rows)
    if args.plot:
        plot(curves, args.plot)
    write_json(
        args.json, {"rows": rows, "curves": curves, "algorithms": {a: ALGORITHMS[a] for a in args.algorithms}}
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowgrpo bench algos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(RECIPE))
    parser.add_argument(
        "--algorithms", nargs="+", default=list(ALGORITHMS), help=f"from {sorted(ALGORITHMS)}"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="schedule.seed values")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--json", help="also write every row and every pair's curve here")
    parser.add_argument("--plot", help="write the gain curves to this PNG")
    parser.add_argument("--keep", metavar="DIR", help="keep the run folders under DIR (default: removed)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of every run (give them first)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
