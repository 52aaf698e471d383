"""A trainer's death costs nothing: the run brings a trainer back and goes on by itself.

Real runs of ``flowgrpo train`` on the tiny BAGEL (four services as processes, CPU):

- the trainer SIGKILLed 5 times at seeded random moments of one run (while it trains, publishes,
  saves or starts, and once while a checkpoint is being written in the background,
  ``trainer.async_save``, ``schedule.save_every=1``):
  the run ends by itself, exit 0, and every metric of every step equals an undisturbed run's,
  bitwise (wall-clock keys and the restart counter aside);
- a trainer that cannot start again (its model file gone): the run ends after
  ``launch.trainer_restarts`` attempts with one line, no traceback, no hang;
- ``remote``: services started on their own; the trainer is killed and a new one, started by
  hand with the same checkpoint folder, registers; the run takes it and ends as the reference.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.services.coordinator.compare import CLOCK_PREFIXES
from flowgrpo.services.coordinator.outputs import read_metrics

CLI = [sys.executable, "-m", "flowgrpo.services.cli"]
ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "tiny_jpeg.yaml"
STEPS = 16
# 2 samples a prompt, the fewest a group advantage takes: what is compared is every metric of every
# step, bitwise, which a step of 4 samples shows as well as one of 32, at an eighth of its cost
TINY_RUN = [f"schedule.steps={STEPS}", "schedule.save_every=1", "schedule.eval_every=0", "data.group_size=2"]
ASYNC = ["trainer.async_save=true"]
KILLS = 5
NOT_TRAINING = ("coordinator/trainer_restarts",)  # what the deaths change: the counter of them


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("model"), seed=0)


def command(run_dir: Path, tiny: Path, *overrides: str) -> list[str]:
    return [
        *CLI,
        "train",
        str(RECIPE),
        f"run_dir={run_dir}",
        f"model.checkpoint={tiny}",
        *TINY_RUN,
        *overrides,
    ]


def start(run_dir: Path, tiny: Path, *overrides: str) -> subprocess.Popen[str]:
    return subprocess.Popen(command(run_dir, tiny, *overrides), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)  # fmt: skip


def finish(proc: subprocess.Popen[str], timeout_s: float = 300) -> str:
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return stderr


@pytest.fixture(scope="module")
def reference(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, float]], float]:
    """The undisturbed run (``local``, as the disturbed ones) and its wall time."""
    run_dir = tmp_path_factory.mktemp("reference")
    started = time.perf_counter()
    done = subprocess.run(
        command(run_dir, tiny, *ASYNC), capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return read_metrics(run_dir), time.perf_counter() - started


def assert_same_training(metrics: list[dict[str, float]], reference: list[dict[str, float]]) -> None:
    """Every metric of every step bitwise equal, but the clocks and the restart counter."""
    assert [r["step"] for r in metrics] == [r["step"] for r in reference] == list(range(1, STEPS + 1))
    for ours, theirs in zip(metrics, reference, strict=True):
        keys = {k for k in theirs if not k.startswith(CLOCK_PREFIXES) and k not in (*NOT_TRAINING, "time")}
        assert keys == {
            k for k in ours if not k.startswith(CLOCK_PREFIXES) and k not in (*NOT_TRAINING, "time")
        }
        different = {k: (ours[k], theirs[k]) for k in keys if ours[k] != theirs[k]}
        assert not different, (ours["step"], different)


def training_keys(record: dict[str, float]) -> set[str]:
    return {k for k in record if not k.startswith(CLOCK_PREFIXES) and k not in (*NOT_TRAINING, "time")}


def trainer_pid(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "services" / "trainer.ready.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None  # not written yet, or being replaced


def trained_steps(run_dir: Path) -> int:
    return max((int(r["step"]) for r in read_metrics(run_dir)), default=0)


def next_trainer(run_dir: Path, killed: set[int], proc: subprocess.Popen[str]) -> int:
    """The pid of a trainer process not killed yet (one that started after the last kill)."""
    deadline = time.monotonic() + 120
    while (pid := trainer_pid(run_dir)) is None or pid in killed:
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "no trainer came back"
        time.sleep(0.05)
    return pid


def kill_while_writing(run_dir: Path, pid: int, proc: subprocess.Popen[str]) -> bool:
    """SIGKILL ``pid`` as soon as a checkpoint is being written (its hidden partial folder
    exists); whether the write was cut (the partial folder is still there after the kill)."""
    folder = run_dir / "checkpoints"
    left = partials(folder)  # by earlier kills: not a write in progress
    deadline = time.monotonic() + 120
    while not partials(folder) - left:
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    return bool(partials(folder) - left)


def partials(folder: Path) -> set[tuple[str, int]]:
    found = set()
    for path in folder.glob(".step_*.partial"):
        try:
            found.add((path.name, path.stat().st_ino))
        except FileNotFoundError:  # renamed into place meanwhile
            pass
    return found


# When each kill comes, in the life of the trainer it kills: once it served a step, a random
# moment later (training, publishing, saving, the rollouts drawing: ~3 steps); while a checkpoint is
# being written in the background; soon after it is started (while it loads, or its first step)
MOMENTS = ("serving", "serving", "writing", "serving", "starting")


@pytest.mark.timeout(600)
def test_a_trainer_killed_five_times_costs_nothing(
    reference: tuple[list[dict[str, float]], float], tiny: Path, tmp_path: Path
) -> None:
    rng = random.Random(35)  # the kill moments: random, but the same in every run of the test
    started = time.perf_counter()
    proc = start(tmp_path, tiny, *ASYNC, f"launch.trainer_restarts={KILLS + 2}")
    killed: set[int] = set()
    cut_writes = 0
    for moment in MOMENTS:
        pid = next_trainer(tmp_path, killed, proc)
        if moment == "writing":
            cut_writes += kill_while_writing(tmp_path, pid, proc)
        else:
            if moment == "serving":
                wait_for_a_step(tmp_path, trained_steps(tmp_path) + 1, proc)
            time.sleep(rng.uniform(0.0, 0.8))
            assert trained_steps(tmp_path) <= STEPS - 3, "the run is too near its end to be killed"
            os.kill(pid, signal.SIGKILL)
        killed.add(pid)
    stderr = finish(proc)
    wall = time.perf_counter() - started
    assert proc.returncode == 0, stderr[-4000:]
    assert "Traceback" not in stderr
    metrics, reference_wall = reference
    assert_same_training(read_metrics(tmp_path), metrics)
    assert read_metrics(tmp_path)[-1]["coordinator/trainer_restarts"] == KILLS
    assert cut_writes == 1, "the kill meant to cut a checkpoint write came after it"
    # one line per restart: the death it answers (on the console), or a start that failed (a warning)
    said = [line for line in stderr.splitlines() if line.startswith("the trainer died while")]
    failed = [line for line in stderr.splitlines() if "WARNING" in line and "trainer restart " in line]
    assert len(said) + len(failed) == KILLS, stderr[-4000:]
    assert all("restart" in line and "resumed from the checkpoint of step" in line for line in said), said
    assert json.loads((tmp_path / "run_state.json").read_text())["step"] == STEPS
    print(f"{KILLS} kills ({cut_writes} during a checkpoint write): {wall:.1f} s against "
          f"{reference_wall:.1f} s undisturbed; " + " | ".join(said + failed))  # fmt: skip


def wait_for_a_step(run_dir: Path, step: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while trained_steps(run_dir) < step:
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no step {step}"
        time.sleep(0.02)


def test_a_trainer_that_cannot_start_again_ends_the_run_after_its_restarts(
    tiny: Path, tmp_path: Path
) -> None:
    """Its model file is gone (the rollouts hold theirs in memory): every start fails; the run
    ends after launch.trainer_restarts=2 of them, in one line naming the last failure."""
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    started = time.perf_counter()
    proc = start(tmp_path / "run", model, "launch.trainer_restarts=2")
    deadline = time.monotonic() + 120
    while trained_steps(tmp_path / "run") < 1:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    (model / "ema.safetensors").unlink()
    pid = trainer_pid(tmp_path / "run")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    stderr = finish(proc)
    wall = time.perf_counter() - started
    assert proc.returncode == 1
    assert "Traceback" not in stderr
    last = [line for line in stderr.splitlines() if line and not line.startswith('{"time"')][-1]
    assert last.startswith("flowgrpo train: the trainer died while "), last
    assert (
        "(killed by SIGKILL) and did not come back: launch.trainer_restarts=2 restarts used (the last: "
        in last
    )
    assert "trainer exited with status 1 while starting; its log ends: " in last and "ema.safetensors" in last
    assert "; run the same command to resume from " in last, last
    assert stderr.count("trainer restart ") == 2, stderr[-3000:]  # each failed start, one line
    assert wall < 150, f"{wall:.0f} s"
    print(f"restarts used up: {wall:.1f} s; {last}")


@pytest.mark.timeout(600)
def test_remote_a_trainer_that_registers_again_takes_over(
    reference: tuple[list[dict[str, float]], float], tiny: Path, tmp_path: Path
) -> None:
    """The deployment shape: services started on their own register with the coordinator
    (``remote``, no addresses). The trainer is SIGKILLed after step 2; a new one started with the
    same checkpoint folder registers, resumes, trains the kept steps again, and the run ends with
    the reference's metrics."""
    coordinator = start(tmp_path, tiny, "launch.launcher=remote", "launch.heartbeat_interval_s=0.5",
                        "launch.lost_after_s=3", "launch.trainer_rejoin_timeout_s=120")  # fmt: skip
    ready = tmp_path / "services" / "coordinator.ready.json"
    deadline = time.monotonic() + 120
    while not ready.is_file():
        assert coordinator.poll() is None and time.monotonic() < deadline, "the coordinator did not start"
        time.sleep(0.1)
    address = json.loads(ready.read_text())["grpc_address"]

    def serve(role: str, replica: str, *overrides: str) -> subprocess.Popen[bytes]:
        cmd = [*CLI, "serve", role, "--recipe", str(RECIPE), f"coordinator={address}",
               f"replica_id={replica}", f"run_dir={tmp_path}", "log_format=text", *overrides]  # fmt: skip
        log = (tmp_path / f"{replica}.log").open("ab")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    trainer = (
        "trainer",
        "trainer",
        f"trainer.checkpoint={tiny}",
        f"trainer.checkpoint_dir={tmp_path / 'ckpt'}",
    )
    services = [serve("rollout", "rollout-a", f"rollout.checkpoint={tiny}"), serve("reward", "reward-a")]
    services.append(serve(*trainer))
    try:
        while trained_steps(tmp_path) < 2:
            assert coordinator.poll() is None and time.monotonic() < deadline, coordinator.communicate()[1][
                -3000:
            ]
            time.sleep(0.1)
        services[-1].kill()
        services[-1].wait()
        services.append(serve(*trainer))  # what a container's restart policy does
        stderr = finish(coordinator)
    finally:
        for proc in services:
            proc.terminate()
        for proc in services:
            proc.wait(timeout=60)
    assert coordinator.returncode == 0, stderr[-4000:]
    assert_same_training(read_metrics(tmp_path), reference[0])
    said = [line for line in stderr.splitlines() if line.startswith("the trainer died while")]
    assert len(said) == 1 and "(it stopped answering); restart 1 of launch.trainer_restarts=3" in said[0], (
        said
    )
    assert read_metrics(tmp_path)[-1]["coordinator/trainer_restarts"] == 1
