"""What ``flowgrpo train`` tells its user, from real runs of the CPU demo through the CLI (two
runs, each read by several tests):

- ``finished``: 2 steps, the local launcher, the default ``logger.progress_every_s``: a line per
  service as it becomes ready, no within-step notes (its steps are short), an end summary whose
  paths exist and whose commands run, TensorBoard's config text and hparams session;
- ``stopped``: steps slowed by the load-test scorer (``reward.synthetic_delay_s``: 0.4 s an
  image, 3.2 s of scoring for a step's 8) with notes every second, stopped by SIGTERM after
  step 1: the notes name the samples drawn and scored, and the summary's resume command resumes it.

Both draw 2 prompts x 4 samples a step (the demo's 16 a prompt would only make each step cost 4x).
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from tensorboard.plugins.hparams import api_pb2

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.services.coordinator.outputs import read_metrics
from tests.tensorboard_view import hparams_view, texts

from .test_train import CLI, ROOT, finish, wait_for_step

RECIPE = ROOT / "examples" / "tiny_jpeg.yaml"
SERVICES = ("rollout-0", "reward-0", "trainer")
# what these tests read is what the run says, not what it learns: 4 samples a prompt (not 16) make
# its steps a quarter as costly; the scorer's delay keeps a slowed step's scoring at 3.2 s (was
# 32 images x 0.1 s)
SMALL = ["data.group_size=4"]
SLOW = ["reward.scorers=[{name: jpeg_compressibility, weight: 1.0}, {name: synthetic, weight: 0.0}]",
        "reward.synthetic_delay_s=0.4", "logger.progress_every_s=1"]  # fmt: skip


@dataclass
class Run:
    folder: Path
    args: list[str]  # after `flowgrpo`
    stderr: str

    def summary(self) -> dict[str, str]:
        """The end summary's entries (``checkpoint``, ``report``, ...) by name."""
        lines = self.stderr[self.stderr.rindex("\nrun folder ") :].splitlines()[2:]
        return dict(line.strip().split(maxsplit=1) for line in lines)


def flowgrpo(command: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """A command the summary printed, run as printed (``flowgrpo`` as this interpreter's)."""
    argv = shlex.split(command)
    program = CLI if argv[0] == "flowgrpo" else [sys.executable, "-m", "tensorboard.main"]
    return subprocess.run([*program, *argv[1:]], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          **kwargs)  # type: ignore[call-overload]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("model"), seed=0)


def train_args(folder: Path, tiny: Path, *overrides: str) -> list[str]:
    return ["train", str(RECIPE), f"run_dir={folder}", f"model.checkpoint={tiny}", *overrides]


@pytest.fixture(scope="module")
def finished(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    folder = tmp_path_factory.mktemp("finished")
    args = train_args(
        folder, tiny, "schedule.steps=2", "schedule.save_every=2", "schedule.eval_every=2", *SMALL
    )
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return Run(folder, args, done.stderr)


@pytest.fixture(scope="module")
def stopped(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    folder = tmp_path_factory.mktemp("stopped")
    args = train_args(
        folder, tiny, "schedule.steps=3", "schedule.save_every=1", "schedule.eval_every=0", *SMALL, *SLOW
    )
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True)  # fmt: skip
    wait_for_step(folder, 1, proc)
    proc.send_signal(signal.SIGTERM)
    return Run(folder, args, finish(proc))


def test_each_service_says_when_it_is_ready_with_how_long_each_part_of_its_start_took(finished: Run) -> None:
    s = r"\d+\.\d s"
    loaded = {
        "rollout-0": rf"model {s} \(native engine on cpu, float32\)",
        "reward-0": rf"scorers {s} \(jpeg_compressibility, image_brightness, image_edge_density\)",
        "trainer": rf"model {s} \(full policy on cpu, float32\), checkpoint {s} \(none to resume\)",
    }
    first_validation = finished.stderr.index("  validation:")
    for replica in SERVICES:
        line = re.search(
            rf"^{replica} ready in (\d+\.\d) s: imports (\d+\.\d) s, (.*)$", finished.stderr, re.M
        )
        assert line is not None, finished.stderr[:3000]
        assert re.fullmatch(loaded[replica], line[3]), line[0]
        phases = [float(s) for s in re.findall(r"(\d+\.\d) s", line[0])[1:]]
        assert float(line[2]) > 0 and sum(phases) <= float(line[1]) + 0.1 * len(phases)  # rounded to 0.1
        assert line.start() < first_validation  # said as it became ready, before the run goes on
    assert "still starting" not in finished.stderr  # the services started within progress_every_s


def test_short_steps_get_no_progress_notes(finished: Run) -> None:
    assert "drawn" not in finished.stderr and "scored" not in finished.stderr


def test_the_summary_names_the_runs_outputs_and_its_commands_run(finished: Run) -> None:
    folder = finished.folder.resolve()
    assert f"\nrun folder {folder} (2 of 2 steps trained)\n" in finished.stderr
    said = finished.summary()
    assert said["checkpoint"] == f"{folder / 'checkpoints' / 'step_00000002'} (step 2)"
    assert (folder / "checkpoints" / "step_00000002").is_dir()
    assert said["metrics"] == f"{folder / 'metrics.jsonl'} (2 steps, 2 validations)"
    assert [r["step"] for r in read_metrics(folder)] == [1, 2]
    assert flowgrpo(said["report"]).returncode == 0 and (folder / "report.html").is_file()
    assert said["images"].startswith(f"flowgrpo generate --run {folder} --prompt ")
    grid = json.loads(sorted((folder / "images").glob("val_*.json"))[-1].read_text())
    assert shlex.split(said["images"])[5] == grid["cells"][0]["prompt"]  # a prompt it was validated on
    generated = flowgrpo(said["images"])
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert len(list((folder / "generated").glob("*.png"))) == 1
    assert said["TensorBoard"] == f"tensorboard --logdir {folder / 'tensorboard'}"
    inspected = flowgrpo(said["TensorBoard"] + " --inspect")  # what TensorBoard finds there
    assert f"Found event files in:\n{folder / 'tensorboard'}" in inspected.stdout, inspected.stdout[-2000:]
    assert "val-core/jpeg_compressibility/reward/mean@1" in inspected.stdout
    assert "resume" not in said


def test_tensorboard_shows_the_config_and_the_run_with_its_final_validation(finished: Run) -> None:
    logdir = finished.folder / "tensorboard"
    config = (finished.folder / "config.yaml").read_text()
    assert texts(logdir, "config") == ["".join(f"    {line}" for line in config.splitlines(keepends=True))]
    experiment, groups = hparams_view(logdir)
    (session,) = [s for g in groups.session_groups for s in g.sessions]
    assert session.status == api_pb2.STATUS_SUCCESS
    last = read_metrics(finished.folder, kind="val")[-1]
    shown = {m.name.tag: m.value for m in session.metric_values}
    keys = [k for k in last if k.startswith("val-core/")]
    assert len(keys) == 4 and all(shown[k] == pytest.approx(last[k], rel=1e-6) for k in keys)
    assert shown["critic/rewards/mean"] == pytest.approx(
        read_metrics(finished.folder)[-1]["critic/rewards/mean"]
    )
    hparams = groups.session_groups[0].hparams
    assert hparams["trainer.optim.lr"].number_value == 0.1 and hparams["schedule.steps"].number_value == 2
    assert hparams["model.checkpoint"].string_value == finished.args[3].split("=", 1)[1]
    assert {i.name for i in experiment.hparam_infos} == set(hparams)


def test_a_slow_step_says_how_far_it_is_at_most_every_progress_every_s(stopped: Run) -> None:
    notes = re.findall(
        r"^  step (\d)/3 \((\d+) s\): drawn (\d+)/8, scored (\d+)/8(.*)$", stopped.stderr, re.M
    )
    assert len(notes) >= 2, stopped.stderr[-3000:]  # scoring 8 images at 0.4 s each takes > 3 s
    assert {n[0] for n in notes} <= {"1", "2"}
    assert all(int(drawn) in (0, 8) and 0 <= int(scored) <= int(drawn) for _, _, drawn, scored, _ in notes)
    assert any(int(scored) > 0 for *_, scored, _ in notes)  # seen while it was scoring
    step_1 = [int(seconds) for step, seconds, *_ in notes if step == "1"]
    assert step_1 == sorted(step_1) and len(set(step_1)) == len(step_1)  # one line a second at most


def test_a_run_stopped_by_a_signal_says_how_to_resume_and_that_command_resumes_it(stopped: Run) -> None:
    assert re.search(
        r"flowgrpo train: interrupted at step \d; run the same command to resume", stopped.stderr
    )
    said = stopped.summary()
    assert shlex.split(said["resume"]) == ["flowgrpo", *stopped.args]
    assert said["checkpoint"].endswith("(step 1)") or said["checkpoint"].endswith("(step 2)")
    (session,) = [
        s for g in hparams_view(stopped.folder / "tensorboard")[1].session_groups for s in g.sessions
    ]
    assert session.status == api_pb2.STATUS_RUNNING  # it goes on when resumed
    resumed = flowgrpo(said["resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"^resumed at step [12] ", resumed.stderr, re.M)
    assert [r["step"] for r in read_metrics(stopped.folder)] == [1, 2, 3]
    assert "checkpoint   " + str(stopped.folder.resolve() / "checkpoints" / "step_00000003") in resumed.stderr
