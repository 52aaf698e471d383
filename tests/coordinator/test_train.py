"""End-to-end FlowGRPO runs of all four services on a tiny random BAGEL (CPU), through the CLI
as a user runs them. The runs are shared between asserts to keep CI short:

- ``reference``: the ``inprocess`` launcher (one process, no sockets), 4 steps;
- ``two_rollouts``: the ``local`` launcher (every service its own process), 2 rollout replicas,
  the same recipe: must equal the reference bitwise (deterministic mode); with branched rollouts,
  2 short in-process runs of 1 and 2 replicas, equal bitwise;
- ``rollout_killed`` / ``reward_killed``: ``local``, 2 replicas of the role, one killed with
  SIGKILL after step 1;
- ``resumed``: ``local`` with ``launch.trainer_restarts=0``, the trainer killed with SIGKILL after
  step 3, then the same command again: resumes from the step-2 checkpoint and ends where the
  reference ends.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest
from PIL import Image
from shared_runs import shared_folder
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from flowgrpo.configs.run import load_run_config
from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.services.bench.paths import PATHS, plot, table
from flowgrpo.services.coordinator.compare import compare_runs
from flowgrpo.services.coordinator.outputs import read_metrics
from flowgrpo.services.coordinator.status import live_status, status
from flowgrpo.services.coordinator.trace import step_spans
from flowgrpo.telemetry import read_spans

K = TypeVar("K")  # a run's key among runs side by side
CLI = [sys.executable, "-m", "flowgrpo.services.cli"]  # the flowgrpo command of this interpreter

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "tiny_jpeg.yaml"
STEPS = 4
SAMPLES = load_run_config(RECIPE).samples_per_step
SHORT = [f"schedule.steps={STEPS}", "schedule.save_every=2", "schedule.eval_every=2"]
EXACT = ("critic/rewards/mean", "actor/pg_loss", "actor/grad_norm", "actor/ratio_mean",
         "critic/advantages/max")  # fmt: skip


# Each test may run on another xdist worker; the runs that several of them read are made once per
# test run (tests/shared_runs.py), the others belong to their test.
pytestmark = pytest.mark.spread


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_folder(tmp_path_factory, "tiny-bagel-seed0", lambda folder: make_tiny_bagel(folder, seed=0))


def command(run_dir: Path, tiny: Path, *overrides: str) -> list[str]:
    return [*CLI, "train", str(RECIPE), f"run_dir={run_dir}",
            f"model.checkpoint={tiny}", *SHORT, *overrides]  # fmt: skip


def train(run_dir: Path, tiny: Path, *overrides: str, expect: int = 0) -> str:
    done = subprocess.run(
        command(run_dir, tiny, *overrides), capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == expect, done.stderr[-4000:]
    return done.stderr


def start(run_dir: Path, tiny: Path, *overrides: str) -> subprocess.Popen[str]:
    return subprocess.Popen(command(run_dir, tiny, *overrides), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)  # fmt: skip


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen[str], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(r["step"] >= step for r in read_metrics(run_dir)):
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout_s} s"
        time.sleep(0.2)


def kill(run_dir: Path, replica: str) -> None:
    pid = json.loads((run_dir / "services" / f"{replica}.ready.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)


def finish(proc: subprocess.Popen[str], expect: int = 0) -> str:
    try:
        _, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == expect, stderr[-4000:]
    return stderr


def train_reference(run_dir: Path, tiny: Path) -> None:
    os.environ["WANDB_MODE"] = "offline"  # W&B as a user with no network has it: files in the run
    try:
        train(run_dir, tiny, "launch.launcher=inprocess", "logger.wandb=true")
    finally:
        del os.environ["WANDB_MODE"]


@pytest.fixture(scope="session")
def reference_dir(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_folder(tmp_path_factory, "train-reference", lambda run_dir: train_reference(run_dir, tiny))


@pytest.fixture(scope="session")
def reference(reference_dir: Path) -> list[dict[str, float]]:
    return read_metrics(reference_dir)


def test_a_run_writes_its_outputs(reference_dir: Path, reference: list[dict[str, float]]) -> None:
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))
    validations = read_metrics(reference_dir, kind="val")
    assert [r["step"] for r in validations] == [0, 2, 4]  # step 0: before any update
    key = "val-core/jpeg_compressibility/reward/mean@1"  # by scorer: the data set is "pickscore"
    assert all(r[key] < 0 for r in validations)
    # the testing share is the validations' time so far over the run's: the run time it implies grows
    testing = list(itertools.accumulate(r["timing_s/testing"] for r in validations))
    elapsed = [t / r["perf/testing_share"] for t, r in zip(testing, validations, strict=True)]
    assert all(a < b for a, b in itertools.pairwise(elapsed)), elapsed
    assert all(t <= e for t, e in zip(testing, elapsed, strict=True)), (testing, elapsed)
    assert not any("pickscore" in k for r in validations for k in r)
    assert validations[0][key] != validations[-1][key]  # the same prompts and noise: learnt
    grids = [f"train_{s:06d}" for s in range(1, STEPS + 1)] + ["val_000000", "val_000002", "val_000004"]
    images = sorted(p.name for p in (reference_dir / "images").iterdir())
    assert images == sorted(f"{g}.{ext}" for g in grids for ext in ("png", "json"))  # a grid and its captions
    [events] = (reference_dir / "tensorboard").iterdir()
    tags = {(e.step, v.tag) for e in EventFileLoader(str(events)).Load() for v in e.summary.value}
    assert {(s, "critic/rewards/mean") for s in range(1, STEPS + 1)} <= tags
    assert {(0, "images/val"), (4, key), (1, "images/train")} <= tags
    # one process, yet each span names the service whose code made it
    assert {s["service.name"] for s in step_spans(str(reference_dir), 2)} == {
        "coordinator", "rollout", "reward", "trainer"}  # fmt: skip
    # W&B (offline): one run in the run folder whose records hold every step's reward
    [wandb_file] = (reference_dir / "wandb").glob("offline-run-*/run-*.wandb")
    assert wandb_file.name == f"run-{(reference_dir / 'wandb_id').read_text().strip()}.wandb"
    records = wandb_file.read_bytes()
    assert all(json.dumps(r["critic/rewards/mean"]).encode() in records for r in reference)
    for record in reference:
        assert record["trainer/samples"] == SAMPLES
        assert record["actor/rollout_logp_gap/max"] == 0.0  # sync, deterministic: the same function
        assert record["training/policy_version"] == record["step"] == record["training/global_step"]
        assert record["coordinator/dropped_groups"] == 0


def test_the_report_renders_every_part_from_a_real_run(reference_dir: Path) -> None:
    done = subprocess.run([*CLI, "report", str(reference_dir)],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    page = (reference_dir / "report.html").read_text()
    sources = re.findall(r"src='([^']+)'", page)
    # each of the 4 validation prompts cut out at steps 0 and 4 (8 images), then the step-2 grid
    # folded away; the training grids are data
    assert len(sources) == 9
    for source in sources:  # every image is inside the page, and is a PNG
        assert source.startswith("data:image/png;base64,")
        assert Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1]))).format == "PNG"
    cell = Image.open(io.BytesIO(base64.b64decode(sources[0].split(",", 1)[1])))
    assert cell.size == (256, 256)  # one 64 px image, shown at 256 px
    grid = Image.open(io.BytesIO(base64.b64decode(sources[-1].split(",", 1)[1])))
    assert grid.size == (4 * 256, 256)  # the step-2 grid: four images
    data = json.loads(re.search(r"id='report-data'>(.*?)</script>", page, re.DOTALL).group(1))  # type: ignore[union-attr]
    assert [g["step"] for g in data["train_grids"][0]] == list(range(1, STEPS + 1))
    titles = [p["title"] for p in data["panels"]]
    assert titles[0] == "Optimised reward (critic/rewards/mean)"  # alone on its axis
    assert {"image_brightness (weight 0: watched, not optimised)", "jpeg_compressibility (optimised)"} <= set(
        titles
    )
    keys = {k for r in read_metrics(reference_dir) for k in r} - {"kind", "step", "time"}
    flat = set(re.findall(r"<td class='mono'>([^<]+)</td><td>[^<]* throughout</td>", page))
    assert keys <= set(titles) | flat  # every metric: a panel, or listed as flat
    assert "actor/rollout_logp_gap/max" in flat and "trainer/lag/max" in flat  # sync: all zero
    assert "services/trainer" in titles  # busy time per service, from the traces
    # each prompt above its images before and after, then the validation in between folded away
    assert page.index("Left: step 0; right: step 4") < page.index("validation(s) in between")
    assert page.index("validation(s) in between") < page.index("<b>Step 2</b>")
    cells = [json.loads((reference_dir / "images" / f"val_{s:06d}.json").read_text()) for s in (0, 4)]
    assert len(cells[1]["cells"]) == 4
    for before, after in zip(cells[0]["cells"], cells[1]["cells"], strict=True):
        assert before["prompt"] == after["prompt"]
        caption = f"<figcaption>{html.escape(before['prompt'])}</figcaption>"
        rewards = f"{before['reward']:+.6g} &rarr; {after['reward']:+.6g}"
        assert caption in page and rewards in page[page.index(caption) :]
    # the metadata: the command that ran, how it ended; the config against the recipe
    assert f"flowgrpo train {RECIPE}" in page and "<td>success</td>" in page
    assert "<td class='mono'>schedule.steps</td><td class='mono'>40</td><td class='mono'>4</td>" in page
    record = read_metrics(reference_dir)[-1]
    assert 0 < record["critic/score/image_brightness/mean"] < 1
    assert 0 <= record["critic/score/image_edge_density/mean"] <= 1


def test_compare_reports_identical_runs_and_finds_an_injected_difference(
    reference_dir: Path, tmp_path: Path
) -> None:
    cmd = [*CLI, "compare", str(reference_dir), str(reference_dir)]
    same = subprocess.run([*cmd, "--fail-on-difference"], capture_output=True, text=True, cwd=ROOT)
    assert same.returncode == 0 and "identical" in same.stdout, same.stdout + same.stderr
    changed = tmp_path / "changed"
    changed.mkdir()
    lines = (reference_dir / "metrics.jsonl").read_text().splitlines()
    edited = []
    for line in lines:
        record = json.loads(line)
        if record["kind"] == "train" and record["step"] == 3:
            record["actor/pg_loss"] *= 1 + 1e-6  # a change far below what a plot would show
        edited.append(json.dumps(record))
    (changed / "metrics.jsonl").write_text("\n".join(edited) + "\n")
    result = compare_runs([reference_dir, changed])
    assert not result.identical
    parting = result.first_parting()
    assert parting is not None and (parting.first_step, parting.key) == (3, "actor/pg_loss")
    assert [d.key for d in result.diffs if d.first_step is not None] == ["actor/pg_loss"]
    assert compare_runs([reference_dir, changed], rtol=1e-5).identical  # within a tolerance
    plot = ["--fail-on-difference", "--plot", str(tmp_path / "c.png")]
    shown = subprocess.run([*cmd[:-1], str(changed), *plot], capture_output=True, text=True, cwd=ROOT)
    assert shown.returncode == 1 and "they part at step 3 (actor/pg_loss" in shown.stdout
    assert Image.open(tmp_path / "c.png").format == "PNG"


# validating 3 images a prompt (split over the replicas) changes neither training nor mean@1
TWO_ROLLOUTS = ("launch.launcher=local", "launch.rollout_replicas=2", "data.val_samples=3")
ASYNC = ("launch.launcher=inprocess", "schedule.mode=async")


@pytest.fixture(scope="session")
def two_rollouts_dir(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_folder(
        tmp_path_factory, "train-two-rollouts", lambda run_dir: train(run_dir, tiny, *TWO_ROLLOUTS)
    )


@pytest.fixture(scope="session")
def eta_dirs(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Async runs at staleness 0 and 1."""
    return {
        eta: shared_folder(tmp_path_factory, f"train-async-eta{eta}",
                           lambda run_dir, eta=eta: train(run_dir, tiny, *ASYNC, f"schedule.staleness={eta}"))
        for eta in (0, 1)
    }  # fmt: skip


def test_local_processes_with_two_rollouts_equal_the_inprocess_run(
    reference_dir: Path, reference: list[dict[str, float]], two_rollouts_dir: Path
) -> None:
    local = read_metrics(two_rollouts_dir)
    assert len(local) == STEPS
    for ours, theirs in zip(local, reference, strict=True):
        for key in EXACT:
            assert ours[key] == theirs[key], (ours["step"], key)
    key = "val-core/jpeg_compressibility/reward/mean@"
    validations = read_metrics(two_rollouts_dir, kind="val")
    for ours, theirs in zip(validations, read_metrics(reference_dir, kind="val"), strict=True):
        assert ours[f"{key}1"] == theirs[f"{key}1"], ours["step"]  # sample 0: the same noise, image
        assert f"{key}3" not in theirs and ours[f"{key}3"] != ours[f"{key}1"]
    assert (two_rollouts_dir / "config.yaml").is_file() and (two_rollouts_dir / "run_state.json").is_file()
    assert sorted(p.name for p in (two_rollouts_dir / "logs").iterdir()) == [
        "reward-0.log", "rollout-0.log", "rollout-1.log", "trainer.log"]  # fmt: skip
    # `flowgrpo trace --step 2`: spans of all four services, the services' under the coordinator's
    spans = step_spans(str(two_rollouts_dir), 2)
    assert {s["service.name"] for s in spans} == {"coordinator", "rollout", "reward", "trainer"}
    assert {"coordinator.draw", "rollout.generate", "reward.score", "trainer.step"} <= {
        s["name"] for s in spans
    }
    shown = subprocess.run([*CLI, "trace", str(two_rollouts_dir), "--step", "2"],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "trainer.step" in shown and "rollout.generate" in shown
    report = status(two_rollouts_dir)  # `flowgrpo status`
    assert f"checkpointed at step {STEPS}" in report and f"last validation (step {STEPS})" in report


def test_branched_rollouts_on_two_replicas_train_as_on_one(tiny: Path, tmp_path: Path) -> None:
    """``sampling.branch=true`` with windows in [0, 4], so groups have ODE prefixes of 0-2 steps: 2
    rollout replicas sampling in batches of 8 (each computing the prefix of its half of a group)
    train exactly as 1 replica sampling whole groups. 2 steps in process (an update between them)."""
    branched = ("launch.launcher=inprocess", "sampling.branch=true", "sampling.window_range=[0,4]",
                "schedule.steps=2", "schedule.save_every=0", "schedule.eval_every=0")  # fmt: skip
    train(tmp_path / "one", tiny, *branched)
    train(tmp_path / "two", tiny, *branched, "launch.rollout_replicas=2", "rollout.max_batch_samples=8")
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert len(one) == len(two) == 2
    for ours, theirs in zip(two, one, strict=True):
        for key in EXACT:
            assert ours[key] == theirs[key], (ours["step"], key)


def test_a_killed_rollout_replica_loses_no_group_and_rejoins_with_the_current_weights(
    reference: list[dict[str, float]], tiny: Path, tmp_path: Path
) -> None:
    """SIGKILL of one of two rollout replicas after step 1: its work goes to the other; the
    launcher starts it again, it registers, loads the current weights and takes work again. Two
    more steps than the reference leave time for the restart (a few seconds on 2 cores)."""
    proc = start(tmp_path, tiny, "launch.launcher=local", "launch.rollout_replicas=2",
                 f"schedule.steps={STEPS + 2}")  # fmt: skip
    wait_for_step(tmp_path, 1, proc)
    first_pid = json.loads((tmp_path / "services" / "rollout-1.ready.json").read_text())["pid"]
    kill(tmp_path, "rollout-1")
    stderr = finish(proc)
    metrics = read_metrics(tmp_path)
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 3))
    assert all(r["trainer/samples"] == SAMPLES and r["coordinator/dropped_groups"] == 0 for r in metrics)
    assert metrics[-1]["coordinator/retries"] >= 1  # the dead replica's work went to the other
    assert metrics[-1]["coordinator/rejoins"] == 1, stderr[-3000:]
    assert "rollout rollout-1 rejoined the run" in stderr
    for ours, theirs in zip(metrics, reference, strict=False):  # the same samples, wherever drawn
        assert ours["critic/rewards/mean"] == theirs["critic/rewards/mean"]
    # the new process served Generate after it caught up (its spans: in rollout-1's trace file,
    # told from its predecessor's by the process.pid of their resource)
    spans = [s for s in read_spans(str(tmp_path)) if s["resource"]["service.instance.id"] == "rollout-1"
             and s["resource"]["process.pid"] != first_pid]  # fmt: skip
    loads = [s["start_ns"] for s in spans if s["name"] == "/flowgrpo.v1.Rollout/LoadWeights"]
    generates = [s["start_ns"] for s in spans if s["name"] == "rollout.generate"]
    assert loads and generates and min(loads) < min(generates)


def test_a_killed_reward_replica_loses_no_group(
    reference: list[dict[str, float]], tiny: Path, tmp_path: Path
) -> None:
    # not started again (launch.restarts=0): the coordinator retries it with back-off, in vain
    proc = start(tmp_path, tiny, "launch.launcher=local", "launch.reward_replicas=2", "launch.restarts=0")
    wait_for_step(tmp_path, 1, proc)
    kill(tmp_path, "reward-1")  # the replica the next step's scores go to (round robin)
    finish(proc)
    metrics = read_metrics(tmp_path)
    assert all(r["trainer/samples"] == SAMPLES and r["coordinator/dropped_groups"] == 0 for r in metrics)
    assert metrics[-1]["coordinator/retries"] >= 1
    for ours, theirs in zip(metrics, reference, strict=True):
        for key in EXACT:
            assert ours[key] == theirs[key], (ours["step"], key)


def test_a_killed_trainer_stops_the_run_and_the_same_command_resumes(
    reference: list[dict[str, float]], tiny: Path, tmp_path: Path
) -> None:
    """With ``launch.trainer_restarts=0`` a trainer's death ends the run (test_trainer_restart.py:
    what the restarts do)."""
    proc = start(tmp_path, tiny, "launch.launcher=local", "launch.trainer_restarts=0")
    wait_for_step(tmp_path, 3, proc)
    kill(tmp_path, "trainer")
    stderr = finish(proc, expect=1)
    assert (
        "the trainer failed while training step 4" in stderr and "resume from the last checkpoint" in stderr
    )
    assert json.loads((tmp_path / "run_state.json").read_text())["step"] == 2
    stderr = train(tmp_path, tiny, "launch.launcher=local")
    assert "resumed at step 2" in stderr
    resumed = read_metrics(tmp_path)  # the last record of each step: steps 3 and 4 again
    for key in EXACT:
        assert resumed[-1][key] == reference[-1][key], key


def test_async_with_eta_0_is_sync(reference: list[dict[str, float]], eta_dirs: dict[int, Path]) -> None:
    for ours, theirs in zip(read_metrics(eta_dirs[0]), reference, strict=True):
        for key in EXACT:
            assert ours[key] == theirs[key], (ours["step"], key)
        assert ours["trainer/lag/max"] == 0


def test_async_with_eta_1_trains_at_lag_1_while_the_next_batch_is_drawn(eta_dirs: dict[int, Path]) -> None:
    metrics = read_metrics(eta_dirs[1])
    assert [r["trainer/lag/max"] for r in metrics] == [0.0] + [1.0] * (STEPS - 1)  # never above eta
    assert all(r["coordinator/stale_groups"] == 0 for r in metrics)
    # off-policy: importance weights w = p_prox / p_behaviour, |log w| <= the largest logp gap g, so
    # (Kantorovich) 1 / cosh(g)^2 <= ESS; below 1 as the weights are not all equal
    for r in metrics[1:]:
        assert 1 / math.cosh(r["actor/rollout_logp_gap/max"]) ** 2 <= r["actor/is_ess"] < 1, r
    for done, nxt in itertools.pairwise(metrics):  # step k+1 drawn while step k trains
        assert nxt["timestamp_s/drawn_from"] < done["timestamp_s/trained_until"]


def mean_rewards(
    run_dir: Path, tiny: Path, *overrides: str, threads: int | None = None
) -> tuple[list[float], str]:
    """The mean reward of every step of the recipe, in process (the same numbers as local
    processes, see above), and the run's log; ``threads``: torch's CPU threads (its default: all)."""
    cmd = [*CLI, "train", str(RECIPE), f"run_dir={run_dir}", f"model.checkpoint={tiny}",
           "launch.launcher=inprocess", "schedule.save_every=0", *overrides]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return [r["critic/rewards/mean"] for r in read_metrics(run_dir)], done.stderr


def mean_rewards_side_by_side(
    tiny: Path, runs: dict[K, tuple[Path, list[str]]]
) -> dict[K, tuple[list[float], str]]:
    """:func:`mean_rewards` of several runs (their folders and overrides) at once, a thread each:
    on 2 cores a pair takes the time of one run at 2 threads."""
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {key: pool.submit(mean_rewards, run_dir, tiny, *overrides, threads=1)
                   for key, (run_dir, overrides) in runs.items()}  # fmt: skip
        return {key: future.result() for key, future in futures.items()}


CONTROL = "trainer.optim.lr=0"  # the same seeds: the same prompts and noise at every step


def assert_paired(trained: list[float], control: list[float]) -> None:
    """The two runs differ only by what was learnt: step 1 precedes any update."""
    assert len(trained) == len(control) and trained[0] == control[0], "step 1 precedes any update"


def assert_learns(trained: list[float], control: list[float], min_gain: float, spreads: float) -> None:
    """Paired: the trained run is above its control at nearly every step after the first few, and
    its last quarter beats the control's by ``min_gain`` of the reward's size and by more than
    ``spreads`` times the control's own step-to-step spread (the noise that a single run's
    first-vs-last comparison would mistake for learning)."""
    paired = [t - c for t, c in zip(trained, control, strict=True)]
    later = paired[len(paired) // 4 :]
    quarter = max(len(paired) // 4, 2)
    gain = sum(paired[-quarter:]) / quarter
    spread = max(control) - min(control)
    size = abs(sum(control) / len(control))
    detail = f"paired {[f'{d:+.2e}' for d in paired]}, control spread {spread:.2e}, size {size:.2e}"
    assert sum(d > 0 for d in later) >= 0.8 * len(later), detail
    assert gain > spreads * spread and gain > min_gain * size, detail


JPEG_DEMO_STEPS = 20  # of the recipe's 40


@pytest.mark.timeout(900)
@pytest.mark.long
def test_the_demo_learns_against_its_control(tiny: Path, tmp_path: Path) -> None:
    """The JPEG demo recipe (compressibility), its first 20 steps against its control (``lr =
    0``). Measured here (a thread each, 2026-12-08): the paired gain is positive from step 3 and
    at step 20 is +5.2e-4 on a reward of -4.8e-3 (10.8%), 8.1x the control's spread; over the
    recipe's 40 steps +1.0e-3 (21.5%), 8.3x. At 16 steps it was 4.6x: 20 is the shortest run
    that clears the bounds below with room."""
    steps = f"schedule.steps={JPEG_DEMO_STEPS}"
    runs = mean_rewards_side_by_side(tiny, {"trained": (tmp_path / "trained", [steps]),
                                            "control": (tmp_path / "control", [steps, CONTROL])})  # fmt: skip
    (trained, log), (control, _) = runs["trained"], runs["control"]
    assert_paired(trained, control)
    assert len(trained) == JPEG_DEMO_STEPS
    assert_learns(trained, control, min_gain=0.05, spreads=5)
    assert "mean reward of the first 4 steps" in log


BRIGHTNESS = "flowgrpo.services.bench.reward:mean_brightness"  # a plug-in: the image's mean in [0, 1]
BRIGHTNESS_RUN = ["schedule.steps=8", "schedule.eval_every=0"]


def brightness_scorer(weight: float) -> str:
    return f"reward.scorers=[{{name: brightness, weight: {weight}, plugin: {BRIGHTNESS}}}]"


@pytest.fixture(scope="module")
def brightness_runs(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[float, list[float]]:
    """Each direction's mean rewards (weight 1: brighter, -1: darker) and its control, the three
    runs side by side, a thread each. With lr = 0 the images do not depend on the reward, so the
    negated reward's control is the other one negated (exactly): one control run serves both."""
    overrides = {1.0: [brightness_scorer(1.0)], -1.0: [brightness_scorer(-1.0)],
                 0.0: [brightness_scorer(1.0), CONTROL]}  # fmt: skip
    runs = {weight: (tmp_path_factory.mktemp(f"brightness{weight:+}"), [*BRIGHTNESS_RUN, *extra])
            for weight, extra in overrides.items()}  # fmt: skip
    return {weight: rewards for weight, (rewards, _) in mean_rewards_side_by_side(tiny, runs).items()}


@pytest.mark.timeout(900)
@pytest.mark.xdist_group("train-brightness")  # the two share their module's three runs
@pytest.mark.long
@pytest.mark.parametrize("weight", [1.0, -1.0], ids=["brighter", "darker"])
def test_a_second_reward_is_learnt_in_both_directions(
    brightness_runs: dict[float, list[float]], weight: float
) -> None:
    """A plug-in reward of another image statistic, mean brightness, and its negation: the policy
    moves the images the way each asks, so the demo's gain is learning, not drift (measured here,
    8 steps: +0.13 and -0.28 on a brightness of 0.58, 6x and 14x the control's spread)."""
    trained = brightness_runs[weight]
    control = [weight * r for r in brightness_runs[0.0]]
    assert_paired(trained, control)
    assert_learns(trained, control, min_gain=0.02, spreads=3)


def test_services_started_on_their_own_register_and_a_frozen_one_is_lost_then_rejoins(
    reference: list[dict[str, float]], tiny: Path, tmp_path: Path
) -> None:
    """The deployment shape (compose, Kubernetes): the coordinator (``remote``, no addresses)
    waits for services started by someone else with ``flowgrpo serve ROLE --recipe RECIPE
    coordinator=HOST:PORT``. One rollout replica is frozen (SIGSTOP) after step 1: its heartbeats
    stop, it is declared lost, its call in flight ends at once and the work goes to the other;
    thawed, it registers again and rejoins with the current weights. Training equals the
    reference throughout."""
    beat = ["launch.heartbeat_interval_s=0.5", "launch.lost_after_s=3"]
    coordinator = start(tmp_path, tiny, "launch.launcher=remote", "launch.rollout_replicas=2",
                        f"schedule.steps={STEPS + 1}", *beat)  # fmt: skip
    ready = tmp_path / "services" / "coordinator.ready.json"
    deadline = time.monotonic() + 120
    while not ready.is_file():
        assert coordinator.poll() is None and time.monotonic() < deadline, "the coordinator did not start"
        time.sleep(0.1)
    address = json.loads(ready.read_text())["grpc_address"]

    def serve(role: str, replica: str, *overrides: str) -> subprocess.Popen[bytes]:
        cmd = [*CLI, "serve", role, "--recipe", str(RECIPE),
               f"coordinator={address}", f"replica_id={replica}", f"run_dir={tmp_path}", "log_format=text",
               *overrides]  # fmt: skip
        log = (tmp_path / f"{replica}.log").open("wb")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    services = [
        serve("rollout", "rollout-a", f"rollout.checkpoint={tiny}"),
        serve("rollout", "rollout-b", f"rollout.checkpoint={tiny}"),
        serve("reward", "reward-a"),
        serve(
            "trainer",
            "trainer-a",
            f"trainer.checkpoint={tiny}",
            f"trainer.checkpoint_dir={tmp_path / 'ckpt'}",
        ),
    ]
    try:
        wait_for_step(tmp_path, 1, coordinator)
        shown = live_status(address)  # `flowgrpo status --address`
        assert all(f"{r} " in shown for r in ("rollout-a", "rollout-b", "reward-a", "trainer-a")), shown
        os.kill(services[1].pid, signal.SIGSTOP)
        time.sleep(5)  # > launch.lost_after_s
        os.kill(services[1].pid, signal.SIGCONT)
        stderr = finish(coordinator)
    finally:
        for proc in services:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
        for proc in services:
            proc.wait(timeout=60)
    assert "rollout rollout-b rejoined the run" in stderr, stderr[-3000:]
    metrics = read_metrics(tmp_path)
    assert metrics[-1]["coordinator/rejoins"] == 1
    assert metrics[-1]["coordinator/retries"] >= 1  # its Generate in flight ended when it was lost
    assert all(r["trainer/samples"] == SAMPLES and r["coordinator/dropped_groups"] == 0 for r in metrics)
    for ours, theirs in zip(metrics, reference, strict=False):
        for key in EXACT:
            assert ours[key] == theirs[key], (ours["step"], key)


def test_the_paths_benchmark_finds_the_sync_paths_equal_and_eta_1_apart(
    reference_dir: Path, two_rollouts_dir: Path, eta_dirs: dict[int, Path], tmp_path: Path
) -> None:
    """`flowgrpo bench paths`'s table and plot (docs/sync-paths.md is its 40-step output) of the
    runs above, which are its paths but one (local with 1 rollout: test_a_killed_reward_replica_...
    trains on it bitwise like the reference)."""
    runs = {"inprocess": reference_dir, "local, 2 rollouts": two_rollouts_dir,
            "async eta=0": eta_dirs[0], "async eta=1": eta_dirs[1]}  # fmt: skip
    assert list(runs) == [name for name in PATHS if name != "local, 1 rollout"]
    text, verdicts = table(runs)
    for name in ("local, 2 rollouts", "async eta=0"):
        assert verdicts[name] == {"identical": True, "first_step": None, "steps": STEPS}, text
    assert verdicts["async eta=1"]["first_step"] == 2, text  # step 2 trains samples drawn with v0
    assert text.count("none (bitwise equal)") == 2
    plot(runs, tmp_path / "paths.png")
    assert Image.open(tmp_path / "paths.png").format == "PNG"


# The algorithms end to end, in process, groups of 4 (2 prompts x 4 samples a step, not 16): their
# arithmetic is checked against formulas in tests/trainer; here, that the services carry it.
SMALL_GROUPS = ("launch.launcher=inprocess", "data.group_size=4")


def test_diffusion_nft_trains_async_at_lag_1_on_optimalities(tiny: Path, tmp_path: Path) -> None:
    """DiffusionNFT end to end, async with eta = 1 (no importance ratio: staleness only means an
    older sampling policy made the image): ODE rollouts, the trainer reading clean latents only,
    every sample's optimality r in [0, 1], the old policy trailing the trained one."""
    nft = ("trainer.algorithm=diffusion_nft", "sampling.noise_level=0",
           "trainer.algorithm.old_decay_rate=0.25", "trainer.algorithm.timestep_fraction=0.5")  # fmt: skip
    train(tmp_path, tiny, *SMALL_GROUPS, "schedule.mode=async", "schedule.staleness=1", *nft)
    metrics = read_metrics(tmp_path)
    assert [r["trainer/lag/max"] for r in metrics] == [0.0] + [1.0] * (STEPS - 1)
    for r in metrics:
        assert 0.0 <= r["critic/advantages/min"] <= 0.5 <= r["critic/advantages/max"] <= 1.0, r
        assert r["actor/nft/old_decay"] == min(0.25 * 2 * r["step"], 0.5)  # 2 optimizer steps a step
        assert r["actor/grad_norm"] > 0 and "actor/pg_clipfrac" not in r and "actor/ratio_mean" not in r
    assert metrics[-1]["actor/nft/old_deviation"] > 0  # the trained policy has left the sampling one


AWM = ("trainer.algorithm=awm", "trainer.algorithm.train_times=3", "trainer.algorithm.ema_decay_rate=0.25",
       "trainer.loss.kl_beta=3e-3")  # fmt: skip
FLOW_GRPO_ONLY = ("actor/pg_clipfrac", "actor/ratio_mean", "actor/is_ess", "actor/rollout_logp_gap/max")


def assert_awm_trained(metrics: list[dict[str, float]]) -> None:
    """Every step: weights A in [-1, 1] on both sides of 0, gradients, AWM's own metrics, the
    average of past policies decayed by the recipe's 2 optimizer steps a step, no FlowGRPO metric."""
    for r in metrics:
        assert -1.0 <= r["critic/advantages/min"] < 0.0 < r["critic/advantages/max"] <= 1.0, r
        assert r["actor/grad_norm"] > 0 and r["actor/awm/matching_loss"] > 0, r
        assert r["actor/awm/ema_decay"] == min(0.25 * 2 * r["step"], 0.3), r
        assert not [key for key in FLOW_GRPO_ONLY if key in r], r
    assert metrics[-1]["actor/awm/ema_kl"] > 0 and metrics[-1]["actor/kl_loss"] > 0  # trained off both


def test_awm_trains_sync_on_sde_rollouts_with_cfg(tiny: Path, tmp_path: Path) -> None:
    """AWM end to end as the recipe samples (SDE window, CFG 2): the loss reads only the clean
    latents and fits the guided velocity the sampler used."""
    train(tmp_path, tiny, *SMALL_GROUPS, "schedule.save_every=0", *AWM)
    metrics = read_metrics(tmp_path)
    assert [r["trainer/lag/max"] for r in metrics] == [0.0] * STEPS
    assert_awm_trained(metrics)


def test_awm_trains_async_at_lag_1_on_ode_rollouts(tiny: Path, tmp_path: Path) -> None:
    """AWM async with eta = 1: no ratio (the reference's is identically 1 on-policy), a sample of
    the previous version trained as it is; its checkpoint carries the average of past policies."""
    train(tmp_path, tiny, *SMALL_GROUPS, "schedule.mode=async", "schedule.staleness=1",
          "sampling.noise_level=0", *AWM)  # fmt: skip
    metrics = read_metrics(tmp_path)
    assert [r["trainer/lag/max"] for r in metrics] == [0.0] + [1.0] * (STEPS - 1)
    assert_awm_trained(metrics)
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert [p.name for p in saved] == ["step_00000002", "step_00000004"]
    assert all((p / "old_policy").is_dir() for p in saved)


DGPO = ("trainer.algorithm=dgpo", "sampling.noise_level=0", "trainer.algorithm.trained_times=2",
        "trainer.algorithm.time_points=3", "trainer.algorithm.old_decay_rate=0.25",
        "trainer.algorithm.old_decay_max=0.5", "trainer.algorithm.sample_old_after=2",
        "trainer.optim.lr=1e-3")  # fmt: skip


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dgpo_trains_on_group_preferences_sync_and_async(tiny: Path, tmp_path: Path, mode: str) -> None:
    """DGPO end to end: ODE rollouts, the trainer reading clean latents only, each group's samples
    weighed by their clipped advantages against the frozen base, which the policy leaves from its
    first update on (the recipe's 2 optimizer steps a step: the second mini-batch already sees it);
    the old policy follows its EMA after every optimizer step and, after 2 of them, is what the
    rollouts sample. Async with eta = 1: every sample after the first step is a version old (no
    ratio: the image is data)."""
    schedule = ("schedule.mode=async", "schedule.staleness=1") if mode == "async" else ()
    train(tmp_path, tiny, *SMALL_GROUPS, *schedule, *DGPO)
    metrics = read_metrics(tmp_path)
    lag = [0.0] + [1.0 if mode == "async" else 0.0] * (STEPS - 1)
    assert [r["trainer/lag/max"] for r in metrics] == lag
    for r in metrics:
        assert -5.0 <= r["critic/advantages/min"] < 0.0 < r["critic/advantages/max"] <= 5.0, r
        assert r["actor/dgpo/old_decay"] == min(0.25 * (2 * r["step"] - 1), 0.5)  # after the 2nd update
        assert r["actor/grad_norm"] > 0 and 0.0 <= r["actor/pg_clipfrac"] <= 1.0
        assert r["actor/dgpo/error_gap"] != 0.0 and 0.0 < r["actor/dgpo/weight"] < 1.0
        assert "actor/ratio_mean" not in r and "actor/nft/old_deviation" not in r


def test_batch_invariant_runs_train_bitwise_alike_without_recomputing_logp_old(
    tiny: Path, tmp_path: Path
) -> None:
    """Batched sampling (every thread, not the deterministic mode's batch of one) with
    ``sampling.batch_invariant``: a run that takes the rollout's log-probs as logp_old under the
    strictest weight-sync alarm (gap 0) trains bitwise like the run that recomputes them."""
    invariant = (*SMALL_GROUPS, "sampling.deterministic=false",
                 "sampling.batch_invariant=true", "trainer.loss.micro_batch_size=2",
                 "schedule.save_every=0", "schedule.eval_every=0")  # fmt: skip
    train(tmp_path / "recompute", tiny, *invariant)
    train(
        tmp_path / "bypass", tiny, *invariant, "trainer.loss.logp_old=bypass", "trainer.loss.max_logp_gap=0"
    )
    recomputed, bypassed = read_metrics(tmp_path / "recompute"), read_metrics(tmp_path / "bypass")
    for ours, theirs in zip(bypassed, recomputed, strict=True):
        for key in EXACT:
            assert ours[key] == theirs[key], (ours["step"], key)
        assert ours["actor/on_policy_logp_gap/max"] == 0.0
    assert recomputed[0]["actor/rollout_logp_gap/max"] == 0.0
    assert [m["actor/logp_old_bypassed"] for m in bypassed] == [
        0.0,
        1.0,
        1.0,
        1.0,
    ]  # measured once, then trusted


def test_an_fp8_rollout_run_reports_its_gap_and_trains_with_the_importance_weights(
    tiny: Path, tmp_path: Path
) -> None:
    """rollout.precision=fp8 through the services (CPU: PyTorch's reference FP8 kernel): every
    sample arrives marked, the trainer measures the quantization's log-prob gap and weights every
    sample by the truncated ratio, at lag 0 too; the weights stay within what the gap allows."""
    train(tmp_path, tiny, *SMALL_GROUPS, "rollout.precision=fp8", "rollout.lora_mode=merge")
    metrics = read_metrics(tmp_path)
    assert len(metrics) == STEPS and all(r["trainer/lag/max"] == 0 for r in metrics)
    for r in metrics:
        gap = r["actor/fp8_logp_gap/max"]
        assert 0 < r["actor/fp8_logp_gap/p50"] <= r["actor/fp8_logp_gap/p90"] <= gap, r
        assert gap == r["actor/rollout_logp_gap/max"]  # every sample was drawn in FP8
        bound = math.exp(gap) * (1 + 1e-6)  # the weights' fp32 rounding
        assert 1 / bound <= r["actor/is_weight/min"] <= r["actor/is_weight/max"] <= bound, r
        assert 1 / math.cosh(gap) ** 2 <= r["actor/is_ess"] < 1
        assert r["actor/on_policy_fp8_logp_gap/rows"] > 0 and r["actor/on_policy_logp_gap/rows"] == 0
