"""Sync vs async FlowGRPO schedules (``flowgrpo bench schedule``): the same recipe run twice in
one call, ``schedule.mode=sync`` and ``schedule.mode=async`` (staleness eta), reporting each
run's images/s (samples trained per second of step wall time), the async/sync ratio, and the
overlap fraction: the share of the trainer's busy time during which the next step's samples
were being drawn (0 for sync by construction), and per step: each service's busy seconds (the
union of its server spans in the run's traces), the coordinator's phases and the
rollout/trainer log-prob gap. Every per-step figure is the median over the steps after the
first (the warm-up; so at least 4 steps) with its range (services/bench/stats.py).

Default: the tiny CPU demo recipe with the ``local`` launcher (every service its own process, so
rollout and trainer can use different cores). On a GPU host, point ``--recipe`` at a real one.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from flowgrpo.configs.run import load_run_config
from flowgrpo.services.bench.stats import MIN_REPEATS, Figure, ratio, write_json
from flowgrpo.services.coordinator.trace import busy_per_step
from flowgrpo.services.coordinator.train import train

PHASES = ("timing_s/step", "timing_s/gen_and_reward", "timing_s/train", "timing_s/load_weights")
GAP = "actor/rollout_logp_gap/max"


def overlap_fraction(history: list[dict[str, float]]) -> float:
    """Sum over k of |draw(k+1) intersect train(k)| / sum over k of |train(k)|."""
    shared = busy = 0.0
    for done, nxt in itertools.pairwise(history):
        start, end = done["timestamp_s/trained_from"], done["timestamp_s/trained_until"]
        busy += end - start
        shared += max(
            0.0, min(end, nxt["timestamp_s/drawn_until"]) - max(start, nxt["timestamp_s/drawn_from"])
        )
    return shared / busy if busy else 0.0


def images_per_s(steady: list[dict[str, float]]) -> Figure:
    """Samples trained per second of step wall time, one value per step."""
    return Figure.of([m["trainer/samples"] / m["timing_s/step"] for m in steady], "images/s")


def run(recipe: str, mode: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One schedule of the recipe; its figures over the steps after the first (the warm-up)."""
    steps = [f"schedule.steps={args.steps}"] if args.steps else []  # default: the recipe's
    overrides = [f"run_dir={folder / mode}", f"schedule.mode={mode}", f"schedule.staleness={args.staleness}",
                 *steps, "schedule.eval_every=0", "schedule.save_every=0",
                 f"launch.launcher={args.launcher}", *args.overrides]  # fmt: skip
    history = train(load_run_config(recipe, overrides), progress=args.progress)
    steady = history[1:]
    if len(steady) < MIN_REPEATS:
        raise SystemExit(
            f"{len(history)} steps: the figures need >= {MIN_REPEATS + 1} (the first is a warm-up)"
        )
    busy = busy_per_step(str(folder / mode), list(range(2, len(history) + 1)))
    services = sorted({name for b in busy for name in b})
    return {
        "images_per_s": images_per_s(steady),
        "overlap": overlap_fraction(history),
        "max_lag": max(m["trainer/lag/max"] for m in history),
        "phase_s": {key: Figure.of([m[key] for m in steady]) for key in PHASES},
        "busy_s": {name: Figure.of([b.get(name, 0.0) for b in busy]) for name in services} if busy else {},
        "logp_gap_max": max((m[GAP] for m in history if GAP in m), default=math.nan),
        "steps": history,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-schedule-") as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp)
        report: dict[str, Any] = {mode: run(args.recipe, mode, args, folder) for mode in ("sync", "async")}
    report["async_over_sync"] = ratio(report["async"]["images_per_s"], report["sync"]["images_per_s"])
    for mode in ("sync", "async"):
        _print_mode(mode, report[mode])
    print(f"async (eta={args.staleness}) / sync: {report['async_over_sync'].brief('.2f')}x  "
          f"({args.launcher} launcher)")  # fmt: skip
    write_json(args.json, report)
    return 0


def _print_mode(mode: str, r: dict[str, Any]) -> None:
    print(f"{mode:<6} {r['images_per_s']:.2f}  overlap {r['overlap']:5.1%}  lag <= {r['max_lag']:.0f}  "
          f"log-prob gap <= {r['logp_gap_max']:.2g}")  # fmt: skip
    phases = "  ".join(f"{k.split('/')[-1]} {v.brief('.2f')}" for k, v in r["phase_s"].items())
    print(f"       per step (s): {phases}")
    print(
        "       busy per service (s): " + "  ".join(f"{k} {v.brief('.2f')}" for k, v in r["busy_s"].items())
    )


def steps_arg(text: str) -> int:
    value = int(text)
    if value and value <= MIN_REPEATS:
        raise argparse.ArgumentTypeError(
            f"{value}: 0 (the recipe's) or >= {MIN_REPEATS + 1} (a warm-up step first)"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowgrpo bench schedule", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipe", default=str(Path(__file__).resolve().parents[2] / "examples" / "tiny_jpeg.yaml")
    )
    parser.add_argument("--steps", type=steps_arg, default=8, help="steps per schedule (0: the recipe's)")
    parser.add_argument("--staleness", type=int, default=1, help="eta of the async run")
    parser.add_argument("--launcher", default="local", choices=["local", "inprocess"])
    parser.add_argument("--json", help="also write the figures (and every step's metrics) here")
    parser.add_argument("--keep", metavar="DIR", help="keep the two run folders under DIR (default: removed)")
    parser.add_argument("--progress", action="store_const", const=sys.stderr, default=None,
                        help="print each step's line")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of the recipe")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
