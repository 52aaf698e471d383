"""A damaged checkpoint is named at once and the run takes the previous intact one, saying so.

Real runs of ``flowgrpo train`` (local launcher, four service processes): a run saves steps 1
and 2 (once: the first test resumes it where it was made, the second a copy), then the step-2
gen-path shard is truncated to half, as a crash or a full disk would leave it. The resumed run
must say which checkpoint it could not load and which it took, train step 2 again to the same
metrics as the first time, and finish. With every checkpoint damaged (both shards truncated)
there is nothing to fall back to: the trainer's start failure is one line naming the newest
one's file, at once (not the coordinator's start timeout)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "tiny_jpeg.yaml"
OPTIONS = ["schedule.save_every=1", "schedule.eval_every=100", "data.group_size=4"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("model"), seed=0)


@dataclass(frozen=True)
class Saved:
    """A run that trained and saved steps 1 and 2 (``run``, resumed in place by one test: the run
    state names its checkpoints where they were made) and an untouched copy of it (``pristine``)."""

    run: Path
    pristine: Path


@pytest.fixture(scope="module")
def saved(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    folder = tmp_path_factory.mktemp("saved")
    first, _ = train(folder / "run", tiny, 2)
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.copytree(folder / "run", folder / "pristine", symlinks=True)
    return Saved(folder / "run", folder / "pristine")


def train(run: Path, tiny: Path, steps: int) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "flowgrpo.services.cli", "train", str(RECIPE), f"run_dir={run}",
         f"model.checkpoint={tiny}", f"schedule.steps={steps}", *OPTIONS],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    return done, time.perf_counter() - started


def truncate_shard(checkpoint: Path) -> Path:
    shard = next((checkpoint / "gen_path").glob("*.safetensors"))
    os.truncate(shard, shard.stat().st_size // 2)
    return shard


def rewards(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r["critic/rewards/mean"] for r in records if "critic/rewards/mean" in r}


def lines_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line and not line.startswith('{"time"')]


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one(tiny: Path, saved: Saved) -> None:
    run = saved.run
    before = rewards(run)
    shard = truncate_shard(run / "checkpoints" / "step_00000002")

    resumed, wall = train(run, tiny, 3)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    said = lines_of(resumed.stderr)
    fallback = next(line for line in said if line.startswith("the trainer could not load"))
    assert fallback == (
        f"the trainer could not load its checkpoint of step 2 ({run / 'checkpoints' / 'step_00000002'}: "
        f"damaged: its log names the file) and took the previous intact one, "
        f"{run / 'checkpoints' / 'step_00000001'}: step 2 is trained again"
    )
    assert "resumed at step 1 (policy version 1)" in said
    log = (run / "logs" / "trainer.log").read_text()
    assert f"{shard} is corrupt or truncated (SHA-256 mismatch); nothing was loaded" in log
    after = rewards(run)
    assert sorted(after) == [1, 2, 3]
    assert after[1] == before[1] and after[2] == before[2]  # step 2 trained again from step 1: the same
    print(f"fallback: whole resumed run {wall:.1f} s; {fallback}")


def test_with_no_intact_checkpoint_the_start_failure_is_one_line_at_once(
    tiny: Path, saved: Saved, tmp_path: Path
) -> None:
    run = tmp_path / "run"  # a copy: the trainer loads (and names) the checkpoints of its own run_dir
    shutil.copytree(saved.pristine, run, symlinks=True)
    truncate_shard(run / "checkpoints" / "step_00000001")
    shard = truncate_shard(run / "checkpoints" / "step_00000002")  # the newest: the one named

    resumed, wall = train(run, tiny, 3)
    assert resumed.returncode == 1
    assert "Traceback" not in resumed.stderr
    last = lines_of(resumed.stderr)[-1]
    assert last.startswith("flowgrpo train: trainer exited with status 1 while starting; its log ends: ")
    assert f"{shard} is corrupt or truncated (SHA-256 mismatch); nothing was loaded" in last
    assert wall < 120, f"{wall:.0f} s: the start timeout (300 s) must not be what ends it"
    print(f"no intact checkpoint: {wall:.1f} s; {last}")
