"""``flowgrpo bench algos``: on a shortened JPEG demo and a shortened compose task every
algorithm's runs are paired with their controls and every figure of a row recomputes from the
stored curves; the thresholds of the compose table against a loop written out here."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.services.bench import algos, held_out
from flowgrpo.services.bench.learning import HELD_OUT_KEY, Case, validations_of

from .demo import SHORT_DEMO


@pytest.mark.timeout(900)
def test_the_jpeg_benchmark_pairs_and_recomputes(tmp_path: Path) -> None:
    model = make_tiny_bagel(tmp_path / "model", seed=0)
    out, figure = tmp_path / "algos.json", tmp_path / "algos.png"
    overrides = [f"model.checkpoint={model}", *SHORT_DEMO]  # first: --algorithms takes what follows it
    argv = [*overrides, "--task", "jpeg", "--seeds", "0", "--steps", "3", "--threads", "1", "--jobs", "2",
            "--json", str(out), "--plot", str(figure), "--algorithms", *algos.JPEG]  # fmt: skip
    assert algos.main(argv) == 0
    report = json.loads(out.read_text())
    assert [r["algorithm"] for r in report["rows"]] == list(algos.JPEG)
    assert figure.stat().st_size > 10_000
    for row, curve in zip(report["rows"], report["curves"], strict=True):
        assert curve["gain"][0] == 0.0  # step 1 precedes any update: the pair agrees there
        assert curve["images"] == [4.0, 8.0, 12.0]  # one prompt of 4 samples per step
        final = statistics.fmean(curve["gain"][-2:])  # steps 2 and 3: both after an update
        assert row["final_gain"]["median"] == pytest.approx(final)
        assert row["gain_per_kimage"]["median"] == pytest.approx(final / 12 * 1000)
        assert row["gain_per_trainer_s"]["median"] == pytest.approx(final / curve["trainer_s"][-1])
        assert all(b > a for a, b in zip(curve["trainer_s"], curve["trainer_s"][1:], strict=False))


SHORT_COMPOSE = [  # one prompt of 4 samples a step, 4 held-out prompts, one optimizer step
    "data.prompts_per_step=1",
    "data.group_size=4",
    "data.val_prompts=4",
    "trainer.loss.micro_batch_size=4",
    "trainer.loss.mini_batches=1",
]


@pytest.mark.timeout(900)
def test_the_compose_benchmark_pairs_held_out_validations(tmp_path: Path) -> None:
    out, again, kept = tmp_path / "algos.json", tmp_path / "again.json", tmp_path / "runs"
    chosen = ["flow_grpo_branch", "diffusion_nft_cfg_free"]  # both recipes the task's algorithms use
    argv = [*SHORT_COMPOSE, "--seeds", "0", "--images", "8", "--eval-images", "4", "--jobs", "2",
            "--val-samples", "2", "--reference", "flow_grpo_branch", "--algorithms", *chosen]  # fmt: skip
    assert algos.main([*argv, "--json", str(out), "--keep", str(kept)]) == 0
    report = json.loads(out.read_text())
    assert algos.main([*argv, "--json", str(again), "--tabulate", str(kept)]) == 0  # nothing run again
    assert json.loads(again.read_text()) == report
    with pytest.raises(SystemExit, match=r"no flow_grpo/seed0-native-t1-trained/metrics\.jsonl"):
        algos.main([*argv[:-2], "flow_grpo", "--tabulate", str(kept)])
    assert report["task"] == "compose" and [r["algorithm"] for r in report["rows"]] == chosen
    assert report["val_samples"] == 2
    finals = []
    for row, curve in zip(report["rows"], report["curves"], strict=True):
        assert curve["steps"] == [0, 1, 2] and curve["images"] == [0, 4, 8]  # a validation each 4 images
        assert curve["trainer_s"][0] == 0.0 < curve["trainer_s"][1] < curve["trainer_s"][2]
        assert curve["accuracy"][0] == curve["control"]  # the lr = 0 control: step 0's validation
        assert all(a * 8 == round(a * 8) for a in curve["accuracy"])  # 4 prompts, 2 images each (mean@2)
        firsts = validations_of(kept / row["algorithm"] / "seed0-native-t1-trained", HELD_OUT_KEY)
        assert all(a * 4 == round(a * 4) for a in firsts.values()) and len(firsts) == 3  # mean@1 beside it
        final = (curve["accuracy"][-1] - curve["control"]) * 100
        assert row["gain"]["median"] == pytest.approx(final)
        assert row["peak"]["median"] == pytest.approx(max(curve["accuracy"]) * 100 - curve["control"] * 100)
        assert row["accuracy"]["median"] == pytest.approx(curve["accuracy"][-1] * 100)
        finals.append(final)
    assert report["best_final_gain"] == pytest.approx(max(finals))
    reference_gain = finals[0]  # the reference's (one seed): its final gain, where it learnt anything
    assert report["frontier"]["reference_final_gain"] == reference_gain
    assert report["frontier"]["target"] == (reference_gain if reference_gain > 0 else None)  # JSON: no inf
    # CFG 4 (two rows) over 9 steps, a group of 4 sharing steps before a window starting in 2..6
    # (4 on average); the CFG-free demo recipe: one row over 9 steps
    assert report["frontier"]["forwards_per_image"] == {
        "flow_grpo_branch": pytest.approx(2 * (9 - 4 * (1 - 1 / 4))),
        "diffusion_nft_cfg_free": 9.0,
    }


def synthetic(algorithm: str, seed: int, accuracy: list[float]) -> held_out.HeldOutCurve:
    n = len(accuracy)
    axis = [float(i) for i in range(n)]
    return held_out.HeldOutCurve(algorithm, seed, steps=[10 * i for i in range(n)], accuracy=accuracy,
                              control=accuracy[0], images=[640 * x for x in axis],
                              trainer_s=[15 * x for x in axis], rollout_s=[20 * x for x in axis])  # fmt: skip


def test_the_thresholds_are_the_first_validations_at_half_and_90_percent_of_the_best_gain() -> None:
    curves = [
        synthetic("fast", 0, [0.30, 0.50, 0.60, 0.60]),  # +30 points at the end
        synthetic("fast", 1, [0.20, 0.25, 0.45, 0.50]),  # +30
        synthetic("fast", 2, [0.25, 0.40, 0.40, 0.45]),  # +20
        synthetic("slow", 0, [0.30, 0.30, 0.36, 0.46]),  # +16
        synthetic("slow", 1, [0.20, 0.10, 0.20, 0.30]),  # +10
        synthetic("slow", 2, [0.25, 0.30, 0.35, 0.40]),  # +15
    ]
    best = held_out.best_final_gain(curves)
    assert best == pytest.approx(30.0)  # the median of fast's finals; slow's median is 15

    def first(c: held_out.HeldOutCurve, target: float, axis: list[float]) -> float:
        for i, a in enumerate(c.accuracy):
            if (a - c.control) * 100 >= target:
                return axis[i]
        return math.inf

    frontier = held_out.frontier_of(curves, "slow", {"fast": 10.0, "slow": 20.0, "flat": 10.0})
    for name in ("fast", "slow"):
        mine = [c for c in curves if c.algorithm == name]
        row = held_out.held_out_row(name, mine, best, frontier)
        half = sorted(first(c, 15.0, c.images) for c in mine)
        most = sorted(first(c, 27.0, c.trainer_s) for c in mine)
        for figure, expected in ((row.images_to_half, half), (row.trainer_s_to_most, most)):
            assert (figure.min, figure.median, figure.max) == tuple(expected)
    fast = held_out.held_out_row("fast", curves[:3], best, frontier)
    assert (fast.images_to_half.median, fast.images_to_most.median) == (640.0, 1920.0)
    assert fast.images_to_most.max == math.inf  # seed 2 ends at +20 < 27: never
    assert held_out.reach_cell(fast.images_to_most) == "1,920 (1,280-never)"
    slow = held_out.held_out_row("slow", curves[3:], best, frontier)
    assert slow.images_to_most.median == math.inf and slow.images_to_half.median == 1920.0
    nothing = held_out.held_out_row("flat", [synthetic("flat", 0, [0.3, 0.3])], 0.0, frontier)
    assert nothing.images_to_half.median == math.inf  # no gain: no threshold is reached, not step 0's


def test_the_frontier_is_the_images_to_the_reference_algorithms_final_gain() -> None:
    """slow (the reference) ends +16, +10 and +15 points over its controls: the target is +15,
    which slow reaches at 1,920 images on seeds 0 and 2 and never on seed 1 (median 1,920); fast
    (gains 0/20/30/30, 0/5/25/30, 0/15/15/20) at 640, 1,280 and 640."""
    curves = [
        synthetic("fast", 0, [0.30, 0.50, 0.60, 0.60]),
        synthetic("fast", 1, [0.20, 0.25, 0.45, 0.50]),
        synthetic("fast", 2, [0.25, 0.40, 0.40, 0.45]),
        synthetic("slow", 0, [0.30, 0.30, 0.36, 0.46]),
        synthetic("slow", 1, [0.20, 0.10, 0.20, 0.30]),
        synthetic("slow", 2, [0.25, 0.30, 0.35, 0.40]),
    ]
    frontier = held_out.frontier_of(curves, "slow", {"fast": 10.0, "slow": 20.0})
    assert (frontier.target, frontier.reference_images) == (pytest.approx(15.0), 1920.0)
    best = held_out.best_final_gain(curves)
    fast = held_out.held_out_row("fast", curves[:3], best, frontier)
    assert (fast.images_to_target.min, fast.images_to_target.median, fast.images_to_target.max) == (
        640,
        640,
        1280,
    )
    assert (fast.fewer_images.min, fast.fewer_images.median) == (1.5, 3.0)
    assert fast.forwards_to_target.median == 6400.0  # 640 images x 10 forwards
    assert fast.wall_s_to_target.max == 2 * (15 + 20)  # seed 1, the second validation: trainer + rollout
    slow = held_out.held_out_row("slow", curves[3:], best, frontier)
    assert slow.images_to_target.max == math.inf and slow.fewer_images.median == 1.0
    assert (
        held_out.fewer_cell(fast.fewer_images) == "3.0 (1.5-3.0)" and held_out.fewer(1920.0, 0.0) == math.inf
    )
    with pytest.raises(SystemExit, match="--reference medium was not run"):
        held_out.frontier_of(curves, "medium", {})


def test_staying_at_the_target_ignores_a_crossing_the_next_validation_takes_back() -> None:
    """The target +15 (slow's median final: +16, +10, +15). spiky crosses it at 640 images (+20),
    falls back (+10), and stays from 1,920 (+20, +25); slow stays from its last validation on
    seeds 0 and 2 (1,920 images) and never on seed 1."""
    curves = [
        synthetic("spiky", 0, [0.30, 0.50, 0.40, 0.50, 0.55]),
        synthetic("slow", 0, [0.30, 0.30, 0.36, 0.46]),
        synthetic("slow", 1, [0.20, 0.10, 0.20, 0.30]),
        synthetic("slow", 2, [0.25, 0.30, 0.35, 0.40]),
    ]
    spiky = curves[0]
    assert spiky.reach(15.0, spiky.images) == 640.0 and spiky.stays(15.0, spiky.images) == 1920.0
    assert spiky.stays(30.0, spiky.images) == math.inf  # the last validation is below: never for good
    frontier = held_out.frontier_of(curves, "slow", {"spiky": 10.0, "slow": 20.0})
    assert (frontier.reference_images, frontier.reference_images_staying) == (1920.0, 1920.0)
    row = held_out.held_out_row("spiky", curves[:1], held_out.best_final_gain(curves), frontier)
    assert (row.images_to_target.median, row.fewer_images.median) == (640.0, 3.0)
    assert (row.images_to_stay.median, row.fewer_images_staying.median) == (1920.0, 1.0)


def test_a_reference_that_learnt_nothing_sets_no_target() -> None:
    """flat ends at or below its controls (0 and -10 points): no gain to reach, so no run reaches
    one and no ratio is given, where an accuracy target would have been met at step 0."""
    curves = [synthetic("flat", 0, [0.40, 0.45, 0.40]), synthetic("flat", 1, [0.30, 0.35, 0.20]),
              synthetic("fast", 0, [0.30, 0.50, 0.60])]  # fmt: skip
    frontier = held_out.frontier_of(curves, "flat", {"fast": 10.0, "flat": 10.0})
    assert frontier.target == math.inf and frontier.reference_final_gain == pytest.approx(-5.0)
    fast = held_out.held_out_row("fast", curves[2:], held_out.best_final_gain(curves), frontier)
    assert fast.images_to_target.median == math.inf and math.isnan(fast.fewer_images.median)
    assert held_out.fewer_cell(fast.fewer_images) == "n/a (n/a-n/a)"


def test_a_failed_run_ends_no_other_and_all_failures_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every case runs to its end; the failures come together, each with its run's message."""
    ran: list[str] = []

    def fake_run_case(case: Case, options: object, folder: Path, key: object = None) -> None:
        label = f"{folder.name}/{case.label}"
        ran.append(label)
        if label.startswith("diffusion_nft_cfg_free/seed1") and not case.control:
            raise SystemExit("seed1-native-t1-trained failed (exit 2):\nbad recipe")

    monkeypatch.setattr(algos, "run_case", fake_run_case)
    argv = [*SHORT_COMPOSE, "--seeds", "0", "1", "--images", "8", "--eval-images", "4", "--jobs", "2",
            "--algorithms", "flow_grpo_branch", "diffusion_nft_cfg_free",
            "--keep", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        algos.main(argv)
    assert len(ran) == 8  # 2 algorithms x 2 seeds x (trained, control)
    said = str(stop.value)
    assert said.startswith("1 of 8 runs failed; the same command with --keep runs only what is missing")
    assert "diffusion_nft_cfg_free/seed1-native-t1-trained: seed1-native-t1-trained failed (exit 2)" in said


def test_a_gain_equal_to_the_target_in_whole_prompts_reaches_it() -> None:
    """16 of 114 held-out prompts over the control, from controls of 32 and 25 prompts: the two
    gains differ in their last bit (14.035087719298245 and ...248), and are the same gain."""
    n = 114
    reference = synthetic("ref", 0, [25 / n, 41 / n])
    other = synthetic("other", 0, [32 / n, 40 / n, 48 / n])
    frontier = held_out.frontier_of([reference, other], "ref", {"ref": 9.0, "other": 9.0})
    assert other.gain[2] < frontier.target  # the bits differ ...
    assert other.reach(frontier.target, other.images) == 1280.0  # ... the prompts do not


def test_the_trained_runs_come_before_any_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device budget cut short keeps every algorithm's trained curve (the controls only repeat step 0)."""
    ran: list[str] = []

    def fake_run_case(case: Case, options: object, folder: Path, key: object = None) -> None:
        ran.append(case.label)
        raise SystemExit("not run")  # nothing to tabulate after

    monkeypatch.setattr(algos, "run_case", fake_run_case)
    argv = [*SHORT_COMPOSE, "--seeds", "0", "1", "--images", "8", "--eval-images", "4", "--jobs", "1",
            "--algorithms", "flow_grpo_branch", "diffusion_nft_cfg_free", "--keep",
            str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit, match="8 of 8 runs failed"):
        algos.main(argv)
    assert [label.endswith("-trained") for label in ran] == [True] * 4 + [False] * 4
