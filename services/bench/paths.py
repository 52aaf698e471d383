"""Do the ways of running the same recipe train the same? (``flowgrpo bench paths``)

The tiny CPU demo recipe (deterministic mode), one run per path: the ``inprocess`` launcher
(the reference: one process, no sockets), the ``local`` launcher with one and with two rollout
replicas, async with eta = 0, and async with eta = 1 beside them (it trains on samples one
version old, so it is expected to part). Each is compared with the reference step for step
(``flowgrpo compare``); the table and a plot go to ``--out`` (``docs/sync-paths.md`` and
``.png`` are its committed output for 40 steps).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from flowgrpo.configs.run import load_run_config
from flowgrpo.services.coordinator.compare import compare_runs
from flowgrpo.services.coordinator.train import train

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "tiny_jpeg.yaml"
PATHS = {  # name -> overrides; the first is the reference
    "inprocess": ["launch.launcher=inprocess"],
    "local, 1 rollout": ["launch.launcher=local"],
    "local, 2 rollouts": ["launch.launcher=local", "launch.rollout_replicas=2"],
    "async eta=0": ["launch.launcher=inprocess", "schedule.mode=async", "schedule.staleness=0"],
    "async eta=1": ["launch.launcher=inprocess", "schedule.mode=async", "schedule.staleness=1"],
}
KEYS = (
    "critic/rewards/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/ratio_mean",
    "critic/advantages/max",
)


def run_paths(steps: int, folder: Path, model: str = "") -> dict[str, Path]:
    """Train every path for ``steps`` steps under ``folder``; returns name -> run folder."""
    runs = {}
    for i, (name, overrides) in enumerate(PATHS.items()):
        run_dir = folder / f"path{i}"
        extra = [
            f"run_dir={run_dir}",
            f"schedule.steps={steps}",
            "schedule.save_every=0",
            "schedule.eval_every=0",
        ]
        if model:
            extra.append(f"model.checkpoint={model}")
        train(load_run_config(RECIPE, [*overrides, *extra]), progress=None)
        runs[name] = run_dir
    return runs


def table(runs: dict[str, Path]) -> tuple[str, dict[str, Any]]:
    """A markdown table: per path, the largest |difference| from the reference per key and the
    first step where any compared key parts (bitwise)."""
    names = list(runs)
    reference = runs[names[0]]
    rows, verdicts = [], {}
    header = "| path | " + " | ".join(f"max abs diff `{k}`" for k in KEYS) + " | first step that differs |"
    rows.append(header)
    rows.append("|" + "---|" * (len(KEYS) + 2))
    for name in names[1:]:
        result = compare_runs([reference, runs[name]])
        by_key = {d.key: d for d in result.diffs}
        parting = result.first_parting()
        first_step = parting.first_step if parting else None
        verdicts[name] = {"identical": result.identical, "first_step": first_step, "steps": len(result.steps)}
        cells = [f"{by_key[k].max_abs:.3g}" if k in by_key else "n/a" for k in KEYS]
        first = "none (bitwise equal)" if parting is None else f"{parting.first_step} (`{parting.key}`)"
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {first} |")
    return "\n".join(rows), verdicts


def plot(runs: dict[str, Path], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from flowgrpo.services.coordinator.outputs import read_metrics

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), dpi=100)
    reference = {r["step"]: r for r in read_metrics(runs[next(iter(runs))])}
    for i, (name, run_dir) in enumerate(runs.items()):
        records = read_metrics(run_dir)
        steps = [r["step"] for r in records]
        style = {"linestyle": "--" if i else "-", "linewidth": 2.5 if i == 0 else 1.2, "color": f"C{i}"}
        axes[0].plot(steps, [r["critic/rewards/mean"] for r in records], label=name, **style)
        if i:
            gaps = [
                abs(r["critic/rewards/mean"] - reference[r["step"]]["critic/rewards/mean"]) for r in records
            ]
            axes[1].plot(steps, gaps, label=name, **style)
    axes[0].set_title("mean reward per step")
    axes[1].set_title("|mean reward - the inprocess run's| (0 drawn at the axis)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.replot and not args.keep:
        parser.error("--replot needs --keep DIR (the runs of an earlier call)")
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="bench-paths-") as tmp:
        folder = Path(args.keep or tmp)
        if args.replot:
            runs = {name: folder / f"path{i}" for i, name in enumerate(PATHS)}
        else:
            runs = run_paths(args.steps, folder, args.model)
        text, _ = table(runs)
        out.parent.mkdir(parents=True, exist_ok=True)
        plot(runs, out.with_suffix(".png"))
    out.with_suffix(".md").write_text(page(text, args.steps, out.with_suffix(".png").name))
    print(text)
    return 0


def page(text: str, steps: int, picture: str) -> str:
    """The markdown page (docs/sync-paths.md): what was run, the table, the plot."""
    return (
        f"# Do the ways of running one recipe train the same?\n\n"
        f"`flowgrpo bench paths --steps {steps}`: the tiny CPU demo recipe (`examples/tiny_jpeg.yaml`, "
        "deterministic mode), each path compared with the `inprocess` run step for step, bitwise "
        "(`flowgrpo compare`). Async with eta = 1 trains on samples one policy version old: it is "
        "expected to part from the first step it trains at lag 1.\n\n"
        f"{text}\n\n![mean reward per step, and the difference from the inprocess run]({picture})\n"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowgrpo bench paths", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="docs/sync-paths", help="writes OUT.md (the table) and OUT.png")
    parser.add_argument("--model", default="", help="a tiny checkpoint folder (default: each run makes one)")
    parser.add_argument("--keep", metavar="DIR", help="keep the runs under DIR (default: removed)")
    parser.add_argument(
        "--replot", action="store_true", help="only redo the table and plot of the runs in --keep"
    )
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
