"""Does the demo learn, on this machine, for every seed and CPU code path? (``flowgrpo bench learning``)

For each run seed, each instruction set (``--isa``: ATen's vectorised kernels, oneDNN's
convolutions and MKL's matrix products all capped at it) and each intra-op thread count, the
recipe is trained twice with the same seeds, so the same prompts and the same noise at every
step: once as it is and once as a control with ``trainer.optim.lr=0``. Step 1 precedes any
update, so the two runs agree there; what they differ by afterwards is what was learnt. A single
run's first-vs-last comparison cannot tell learning from the step-to-step spread of the prompts,
the pairing can.

Per row: the trained run's first and last quarter (mean reward), the control's last quarter, the
paired gain (trained minus control over the last quarter) absolute and relative to the control,
the control's step-to-step spread (standard deviation of its per-step means) and the gain in
units of it, the steps after the first quarter at which the trained run is ahead, and a digest of
the trained run's rewards (equal digests: bitwise the same trajectory).

With ``--held-out`` (the prompt-following demo, ``examples/tiny_demo.yaml``) what is compared is
the held-out validation (``--val-key``: the compose verifier's accuracy on combinations no
training prompt has, ODE, the same noise every time), every ``schedule.eval_every`` steps of the
recipe. The control's weights never move, so its validation is the same at every step: it is run
for 2 steps with a validation at each, the three are checked bitwise equal, and that value is the
control at every step (the step-0 validation of the trained run must equal it too). Per row: the
held-out accuracy at step 0 and at the last step, the control, the paired gain (last minus
control, in points), the validations after step 0 at which the trained run is ahead, the best.

Every run is its own ``flowgrpo train`` process (the ``inprocess`` launcher: the same numbers
as local processes), so the capability and thread count apply from its first kernel.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "tiny_jpeg.yaml"
HELD_OUT_KEY = "val-aux/compose/accuracy/mean@1"
CONTROL_VALIDATIONS = ["schedule.steps=2", "schedule.eval_every=1"]  # an lr = 0 run: the same every time
CLI = [sys.executable, "-m", "flowgrpo.services.cli"]


def held_out_key(samples: int) -> str:
    """The held-out accuracy over ``samples`` images a validation prompt (``data.val_samples``)."""
    return HELD_OUT_KEY.removesuffix("@1") + f"@{samples}"


@dataclass(frozen=True)
class Case:
    seed: int
    # default, avx2 or avx512 (ATen, oneDNN and MKL capped at it: ISA_VALUES); "": the CPU's best
    isa: str
    threads: int
    control: bool

    @property
    def label(self) -> str:
        run = "control" if self.control else "trained"
        return f"seed{self.seed}-{self.isa or 'native'}-t{self.threads}-{run}"


@dataclass
class Row:
    seed: int
    isa: str
    threads: int
    first_quarter: float
    last_quarter: float
    control_last_quarter: float
    gain: float
    relative_gain: float
    control_spread: float
    gain_over_spread: float
    ahead: str
    digest: str
    once_s: dict[str, float]  # the wall time of each run of the pair, one run each (not a figure)


def rewards_of(run_dir: Path) -> list[float]:
    """The mean reward of each step, the last record of a step winning (as the report does)."""
    steps: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "critic/rewards/mean" in record:
            steps[int(record["step"])] = record["critic/rewards/mean"]
    return [steps[k] for k in sorted(steps)]


def step_records(run_dir: Path) -> list[dict[str, float]]:
    """The training records of a run, one per step (the last record of a step wins)."""
    steps: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind", "train") == "train" and "critic/rewards/mean" in record:
            steps[int(record["step"])] = record
    return [steps[k] for k in sorted(steps)]


def validations_of(run_dir: Path, key: str) -> dict[int, float]:
    """The held-out figure ``key`` of each validation, by step (step 0: before any update)."""
    found: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "val" and key in record:
            found[int(record["step"])] = record[key]
    if not found:
        raise SystemExit(f"{run_dir}: no validation holds {key!r} (is the recipe's eval_every 0?)")
    return found


# One instruction set for every library that picks its own: ATen's vectorised kernels
# (elementwise, norms, softmax), oneDNN's (convolutions) and MKL's (matrix products). ATen's
# variable alone leaves the GEMMs and convolutions, most of the arithmetic, on the CPU's best.
ISA_LIBRARIES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
ISA_VALUES = {
    "default": ("default", "SSE41", "SSE4_2"),
    "avx2": ("avx2", "AVX2", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE", "AVX512"),
}


def isa_environment(isa: str) -> dict[str, str]:
    """The variables that cap every library at ``isa`` ("" : none, this CPU's best)."""
    if not isa:
        return {}
    if isa not in ISA_VALUES:
        raise SystemExit(f"--isa {isa!r}: one of {sorted(ISA_VALUES)} or '' (this CPU's best)")
    return dict(zip(ISA_LIBRARIES, ISA_VALUES[isa], strict=True))


def case_environment(case: Case) -> dict[str, str]:
    """A run's environment: the caller's, with the case's threads and instruction-set caps (its
    caps alone: "" drops any the caller had, and runs on the CPU's best)."""
    env = {k: v for k, v in os.environ.items() if k not in ISA_LIBRARIES}
    return env | {"OMP_NUM_THREADS": str(case.threads), **isa_environment(case.isa)}


def run_case(
    case: Case, args: argparse.Namespace, folder: Path, val_key: str | None = None
) -> tuple[list[float], float]:
    """The run's per-step mean rewards, or with ``val_key`` that validation figure in step order
    (the recipe's own validations; the control's, ``CONTROL_VALIDATIONS``)."""
    run_dir = folder / case.label
    env = case_environment(case)
    schedule = ["schedule.eval_every=0"] if val_key is None else CONTROL_VALIDATIONS if case.control else []
    cmd = [*CLI, "train", args.recipe, f"run_dir={run_dir}", f"schedule.seed={case.seed}",
           "launch.launcher=inprocess", "schedule.save_every=0", *args.overrides, *schedule,
           *(["trainer.optim.lr=0"] if case.control else [])]  # fmt: skip
    # the control's lr = 0 comes last: an override of the lr applies to the trained run only
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{case.label} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    seconds = time.perf_counter() - start
    if val_key is None:
        return rewards_of(run_dir), seconds
    found = validations_of(run_dir, val_key)
    return [found[step] for step in sorted(found)], seconds


@dataclass
class HeldOutRow:
    seed: int
    isa: str
    threads: int
    first: float  # the held-out figure at step 0
    last: float  # at the last validation
    control: float
    gain_points: float  # (last - control) x 100
    best: float
    ahead: str  # validations after step 0 at which the trained run is above its control
    digest: str
    once_s: dict[str, float]


def held_out_row(
    case: Case, trained: list[float], seconds: float, control: list[float], control_s: float
) -> HeldOutRow:
    if len(set(control)) != 1 or trained[0] != control[0]:
        raise SystemExit(
            f"seed {case.seed}: the lr = 0 control's validations {control} must all equal the trained "
            f"run's step 0 ({trained[0]}): the same weights, prompts and noise"
        )
    later = trained[1:]
    return HeldOutRow(
        seed=case.seed,
        isa=case.isa or "native",
        threads=case.threads,
        first=trained[0],
        last=trained[-1],
        control=control[0],
        gain_points=(trained[-1] - control[0]) * 100,
        best=max(trained),
        ahead=f"{sum(v > control[0] for v in later)}/{len(later)}",
        digest=digest(trained),
        once_s={"trained_run": seconds, "control_run": control_s},
    )


def paired_row(
    case: Case, trained: list[float], seconds: float, control: list[float], control_s: float
) -> Row:
    if len(trained) != len(control) or trained[0] != control[0]:
        raise SystemExit(f"seed {case.seed}: the runs are not paired (step 1 must precede any update)")
    quarter = max(len(trained) // 4, 2)
    paired = [t - c for t, c in zip(trained, control, strict=True)]
    later = paired[len(paired) // 4 :]
    gain = statistics.fmean(paired[-quarter:])
    control_last = statistics.fmean(control[-quarter:])
    spread = statistics.stdev(control)
    return Row(
        seed=case.seed,
        isa=case.isa or "native",
        threads=case.threads,
        first_quarter=statistics.fmean(trained[:quarter]),
        last_quarter=statistics.fmean(trained[-quarter:]),
        control_last_quarter=control_last,
        gain=gain,
        relative_gain=gain / abs(control_last),
        control_spread=spread,
        gain_over_spread=gain / spread,
        ahead=f"{sum(d > 0 for d in later)}/{len(later)}",
        digest=digest(trained),
        once_s={"trained_run": seconds, "control_run": control_s},
    )


def digest(rewards: list[float]) -> str:
    """Equal digests: bitwise the same trajectory of mean rewards."""
    return hashlib.sha256(json.dumps(rewards).encode()).hexdigest()[:10]


COLUMNS = (  # header, width, format of each Row field
    ("seed", 4, "d"), ("isa", 7, "s"), ("threads", 7, "d"), ("first_quarter", 13, ".6f"),
    ("last_quarter", 12, ".6f"), ("control_last_quarter", 20, ".6f"), ("gain", 9, "+.2e"),
    ("relative_gain", 13, ".1%"), ("control_spread", 14, ".1e"), ("gain_over_spread", 16, ".1f"),
    ("ahead", 6, "s"), ("digest", 10, "s"),
)  # fmt: skip


HELD_OUT_COLUMNS = (
    ("seed", 4, "d"), ("isa", 7, "s"), ("threads", 7, "d"), ("first", 7, ".1%"), ("last", 7, ".1%"),
    ("control", 7, ".1%"), ("gain_points", 11, "+.1f"), ("best", 7, ".1%"), ("ahead", 6, "s"),
    ("digest", 10, "s"),
)  # fmt: skip


def print_held_out_table(rows: list[HeldOutRow]) -> None:
    print(" ".join(f"{name:>{width}}" for name, width, _ in HELD_OUT_COLUMNS))
    for row in rows:
        print(" ".join(f"{format(getattr(row, n), fmt):>{width}}" for n, width, fmt in HELD_OUT_COLUMNS))
    gains = sorted(r.gain_points for r in rows)
    median = statistics.median(gains)
    print(f"paired gain: median {median:+.1f} points, range {gains[0]:+.1f} to {gains[-1]:+.1f}")


def print_table(rows: list[Row]) -> None:
    print(" ".join(f"{name:>{width}}" for name, width, _ in COLUMNS))
    for row in rows:
        print(" ".join(f"{format(getattr(row, name), fmt):>{width}}" for name, width, fmt in COLUMNS))
    weakest = min(rows, key=lambda r: min(r.relative_gain / 0.1, r.gain_over_spread / 10))
    w = weakest
    print(f"weakest pair: seed {w.seed}, {w.isa}, {w.threads} thread(s): "
          f"{w.relative_gain:.1%} above its control, {w.gain_over_spread:.1f}x its spread")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for isa in args.isa:
        isa_environment(isa)  # a wrong name stops here, before any run
    cases = [
        Case(s, i, t, c)
        for s, i, t, c in itertools.product(args.seeds, args.isa, args.threads, (False, True))
    ]
    val_key = args.val_key if args.held_out else None
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp)
        with ThreadPoolExecutor(args.jobs) as pool:
            runs = pool.map(lambda c: run_case(c, args, folder, val_key), cases)
            results = dict(zip(cases, runs, strict=True))
    rows: list[Row] | list[HeldOutRow]
    if args.held_out:
        rows = [held_out_row(c, *results[c], *results[replace(c, control=True)]) for c in cases[::2]]
        print_held_out_table(rows)
    else:
        rows = [paired_row(c, *results[c], *results[replace(c, control=True)]) for c in cases[::2]]
        print_table(rows)
    if args.json:
        steps = {case.label: results[case][0] for case in cases}
        report = {"rows": [asdict(r) for r in rows], "validations" if args.held_out else "rewards": steps}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowgrpo bench learning", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(RECIPE))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="schedule.seed values")
    parser.add_argument("--isa", nargs="+", default=[""], metavar="CAPABILITY",
                        help="instruction sets: default, avx2, avx512 (ATen, oneDNN and MKL capped "
                             "at it; '' = the CPU's best)")  # fmt: skip
    parser.add_argument("--threads", type=int, nargs="+", default=[2], help="OMP_NUM_THREADS values")
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at once (each deterministic run computes on 1 thread)"
    )
    parser.add_argument(
        "--held-out", action="store_true", help="compare the held-out validation (--val-key), not the reward"
    )
    parser.add_argument("--val-key", default=HELD_OUT_KEY, help="the validation figure --held-out compares")
    parser.add_argument("--json", help="also write every row and every step's rewards here")
    parser.add_argument("--keep", metavar="DIR", help="keep the run folders under DIR (default: removed)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of both runs of every pair")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
