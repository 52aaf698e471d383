"""A resume checks before it writes (services/coordinator/resume.py), on a real run folder: one
step of the shortened demo through ``flowgrpo train`` (the ``local`` launcher: every service its
own process), copied for each case, so each starts from the same saved run.

- a config the saved run cannot follow (another policy kind, group size) is refused in one line
  naming each key, within seconds, and the folder is byte-identical afterwards;
- a finished run says so at once and exits 0 without starting a service;
- a change it can follow (steps, learning rate, logging) is printed, applied and recorded, and
  the run goes on from its checkpoint;
- a damaged checkpoint: the trainer's own one-line error, quoted at once from its log.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flowgrpo.config import ConfigError, to_dict
from flowgrpo.configs.run import load_run_config, read_recipe_sections
from flowgrpo.configs.trainer import NftConfig
from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.services.coordinator.resume import FIXED, as_recorded, plan_resume

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "tiny_jpeg.yaml"
CLI = [sys.executable, "-m", "flowgrpo.services.cli", "train", str(RECIPE)]
# one prompt of 4 samples per step, 3 denoising steps, one micro-batch, no validation
SMALL = ["data.group_size=4", "data.prompts_per_step=1", "data.val_prompts=0", "sampling.num_points=4",
         "trainer.loss.micro_batch_size=4", "trainer.loss.mini_batches=1", "schedule.eval_every=0",
         "schedule.save_every=1"]  # fmt: skip


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(run folder, model): one step trained and saved."""
    model = make_tiny_bagel(tmp_path_factory.mktemp("model"), seed=0)
    run_dir = tmp_path_factory.mktemp("runs") / "one-step"
    done = train(run_dir, model, "schedule.steps=1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "run_state.json").read_text())["step"] == 1
    return run_dir, model


def train(run_dir: Path, model: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, f"run_dir={run_dir}", f"model.checkpoint={model}", *SMALL, *overrides],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip


def copy_of(saved_run: tuple[Path, Path], tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run[0], run_dir, symlinks=True)
    return run_dir


def digests(folder: Path) -> dict[str, str]:
    """Every file of the folder and its SHA-256 (what 'nothing was written' means)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_conflicting_resume_is_refused_in_one_line_and_writes_nothing(
    saved_run: tuple[Path, Path], tmp_path: Path
) -> None:
    run_dir = copy_of(saved_run, tmp_path)
    before, config = digests(run_dir), (run_dir / "config.yaml").read_bytes()
    start = time.monotonic()
    done = train(run_dir, saved_run[1], "schedule.steps=3", "trainer.policy.kind=lora", "data.group_size=8",
                 "trainer.loss.micro_batch_size=8")  # fmt: skip
    seconds = time.monotonic() - start
    line = done.stderr.strip()
    assert done.returncode == 2, done.stderr[-3000:]
    assert "\n" not in line, line
    assert line.startswith(f"flowgrpo train: cannot resume {run_dir} at step 1 with this config: ")
    assert "trainer.policy.kind 'full' -> 'lora' (the checkpoints hold this policy's tensors)" in line
    assert "data.group_size 4 -> 8" in line and "give another run_dir" in line
    assert "schedule.steps" not in line  # a change it could follow is not a reason
    assert seconds < 5, seconds
    assert (run_dir / "config.yaml").read_bytes() == config
    assert digests(run_dir) == before  # run.lock, metrics, logs: nothing touched
    print(f"refused in {seconds:.2f} s: {line}")


def test_a_finished_run_says_so_and_starts_nothing(saved_run: tuple[Path, Path], tmp_path: Path) -> None:
    run_dir = copy_of(saved_run, tmp_path)
    before = digests(run_dir)
    start = time.monotonic()
    done = train(run_dir, saved_run[1], "schedule.steps=1")
    seconds = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.strip() == (
        f"{run_dir}: the run is finished: step 1 of schedule.steps=1 trained; nothing to do "
        "(raise schedule.steps to train on)"
    )
    assert seconds < 5, seconds
    assert digests(run_dir) == before  # no service started: no log, no ready file, no lock taken


def test_a_change_it_can_follow_is_printed_applied_and_recorded(
    saved_run: tuple[Path, Path], tmp_path: Path
) -> None:
    run_dir = copy_of(saved_run, tmp_path)  # also a moved folder: its own model and data paths follow
    done = train(run_dir, saved_run[1], "schedule.steps=2", "trainer.optim.lr=0.05", "logger.progress=lines")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{run_dir}: resuming at step 1; changed since it was last started" in done.stderr
    changes = {
        "schedule.steps": (1, 2), "trainer.optim.lr": (0.1, 0.05), "logger.progress": ("auto", "lines")
    }  # fmt: skip
    for key, (old, new) in changes.items():
        assert f"  {key} {old!r} -> {new!r}\n" in done.stderr, done.stderr
    assert "resumed at step 1" in done.stderr and "step 2/2" in done.stderr
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (saved["schedule"]["steps"], saved["trainer"]["optim"]["lr"]) == (2, 0.05)
    [entry] = [json.loads(line) for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert entry["step"] == 1
    assert {c["key"]: (c["from"], c["to"]) for c in entry["changes"]} == changes
    assert json.loads((run_dir / "run_state.json").read_text())["step"] == 2


def test_a_damaged_checkpoint_is_named_by_the_trainer_at_once(
    saved_run: tuple[Path, Path], tmp_path: Path
) -> None:
    """The trainer writes its ready file before it loads the checkpoint: its death is noticed
    while the handshake waits, and its last log line quoted (not a 300 s timeout)."""
    run_dir = copy_of(saved_run, tmp_path)
    [shard] = (run_dir / "checkpoints" / "step_00000001" / "gen_path").glob("*.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    start = time.monotonic()
    done = train(run_dir, saved_run[1], "schedule.steps=2")
    seconds = time.monotonic() - start
    line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr[-3000:]
    assert line == (
        f"flowgrpo train: trainer exited with status 1 while starting; its log ends: flowgrpo serve "
        f"trainer: {shard} is corrupt or truncated (SHA-256 mismatch); nothing was loaded (all of it: "
        f"{run_dir / 'logs' / 'trainer.log'})"
    )
    assert "Traceback" not in done.stderr
    assert seconds < 120, seconds  # launch.start_timeout_s is 300
    assert "Traceback" in (run_dir / "logs" / "trainer.log").read_text()  # the log keeps it (--debug)


def test_every_fixed_key_names_a_field_of_the_run_config() -> None:
    """A misspelt entry of FIXED would let that change through unnoticed."""
    keys = _flat_keys(to_dict(load_run_config(RECIPE)))
    for prefix in FIXED:
        assert any(k == prefix or (prefix.endswith(".") and k.startswith(prefix)) for k in keys), prefix


def test_no_run_folder_is_no_resume(tmp_path: Path) -> None:
    cfg = load_run_config(RECIPE, [f"run_dir={tmp_path / 'fresh'}"])
    assert plan_resume(cfg) is None


def _flat_keys(data: dict[str, object], prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        if isinstance(value, dict):
            keys += _flat_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def test_a_run_saved_in_the_layout_before_the_algorithm_sections_merged_resumes_as_it_was(
    tmp_path: Path,
) -> None:
    """Before 2026-12-05 a run's config.yaml had ``trainer.algorithm: diffusion_nft`` beside
    ``trainer.nft`` (and the unused ``awm`` and ``dgpo``): read as today's section, nothing changed."""
    run_dir = tmp_path / "old"
    cfg = load_run_config(
        RECIPE, [f"run_dir={run_dir}", "trainer.algorithm=diffusion_nft", "trainer.algorithm.beta=0.1"]
    )
    old = to_dict(as_recorded(cfg))  # what the run wrote
    section = old["trainer"]["algorithm"]
    old["trainer"]["algorithm"] = section.pop("name")
    old["trainer"].update(nft=section, awm={"adv_clip": 5.0}, dgpo={"beta": 100.0})
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    plan = plan_resume(cfg)
    assert plan is not None and plan.changes == ()
    other = plan_resume(load_run_config(RECIPE, [f"run_dir={run_dir}", "trainer.algorithm=diffusion_nft"]))
    assert other is not None and [c.line() for c in other.changes] == ["trainer.algorithm.beta 0.1 -> 1.0"]
    assert read_recipe_sections(run_dir / "config.yaml", saved=True).trainer.algorithm == NftConfig(beta=0.1)
    with pytest.raises(
        ConfigError, match=r"'trainer.nft' is gone: .*trainer.algorithm: \{name: diffusion_nft"
    ):
        read_recipe_sections(run_dir / "config.yaml")  # a recipe a person wrote is told, not rewritten
