"""Storage faults during a checkpoint fail fast and say so, provoked for real.

``flowgrpo train`` runs with its trainer's ``checkpoint_dir`` on a tmpfs of its own, mounted in a
private user and mount namespace (``unshare -rm``: no root needed where user namespaces are
allowed). The filesystem is real, so the kernel itself answers the trainer's writes: a tmpfs
too small for a second checkpoint returns ENOSPC to whichever write crosses the limit (DCP's
shard files for the full gen path, safetensors' own writer for a LoRA adapter), exactly as a full
disk does; a tmpfs remounted read-only returns EROFS. (A chmod-ed folder would prove nothing
here: these tests may run as root, who writes through any mode bits.) The tmpfs vanishes with the
namespace, so what is left on it is checked inside, by a second command.

Each run must stop by itself, with one line naming the folder and the cause, in bounded time,
and leave the previous checkpoint intact (verified by hash) and no partial folder behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "tiny_jpeg.yaml"
RUN = ["schedule.steps=4", "schedule.save_every=1", "schedule.eval_every=100", "data.group_size=4"]
# what is left on the tmpfs, read inside the namespace before it goes: every checkpoint verified
INSPECT = """
import json, os, sys
from flowgrpo.services.trainer.checkpoint import checkpoint_steps, read_policy_update
folder = sys.argv[1]
steps = checkpoint_steps(folder)
for path in steps.values():
    read_policy_update(path)  # verifies the manifest and every hash, or raises
entries = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
print(json.dumps({"steps": sorted(steps), "entries": entries}))
"""


def _namespaces_allowed() -> bool:
    unshare = shutil.which("unshare")
    return (
        unshare is not None and subprocess.run([unshare, "-rm", "true"], capture_output=True).returncode == 0
    )


pytestmark = pytest.mark.skipif(
    not _namespaces_allowed(), reason="unshare -rm is refused here (user namespaces disabled)"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("model"), seed=0)


def train_on_tmpfs(
    tmp_path: Path, tiny: Path, size_kib: int, read_only: bool, *overrides: str
) -> tuple[subprocess.CompletedProcess[str], float, dict[str, list[object]]]:
    """``flowgrpo train`` with the checkpoints on a fresh tmpfs of ``size_kib``: the run (its
    output in ``stderr``), the seconds from its last step's line to its exit (the save, the
    error, the shutdown) and what the tmpfs held afterwards."""
    mount, folder = tmp_path / "mnt", tmp_path / "mnt" / "ckpt"
    mount.mkdir()
    readonly = f"mkdir {folder} && mount -o remount,ro {mount} && " if read_only else ""
    train = [sys.executable, "-m", "flowgrpo.services.cli", "train", str(RECIPE),
             f"run_dir={tmp_path / 'run'}", f"model.checkpoint={tiny}",
             f"trainer.checkpoint_dir={folder}", *RUN, *overrides]  # fmt: skip
    script = (
        f"mount -t tmpfs -o size={size_kib}k flowgrpo-test {mount} && {readonly}"
        f'{" ".join(train)}; status=$?; {sys.executable} -c "$INSPECT" {folder} >&3; exit $status'
    )
    command = ["unshare", "-rm", "sh", "-c", f"exec 3>{tmp_path / 'left.json'}; {script}"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={**os.environ, "INSPECT": INSPECT},
    ) as process:  # fmt: skip
        assert process.stdout is not None
        lines, last_step_at = [], time.perf_counter()
        for line in process.stdout:  # the progress lines as they come: when was the last step?
            lines.append(line)
            if line.startswith("step "):
                last_step_at = time.perf_counter()
        status = process.wait(timeout=300)
    after_last_step = time.perf_counter() - last_step_at
    done = subprocess.CompletedProcess(command, status, "", "".join(lines))
    return done, after_last_step, json.loads((tmp_path / "left.json").read_text())


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line and not line.startswith('{"time"')]


@pytest.mark.parametrize("policy", ["full", "lora"])
def test_a_full_disk_stops_the_run_at_once_naming_the_folder(tiny: Path, tmp_path: Path, policy: str) -> None:
    # room for the step-1 checkpoint (full: 0.9 MB, LoRA: 0.13 MB) and not for a second one
    size = {"full": 1500, "lora": 200}[policy]
    kind = [f"trainer.policy.kind={policy}"] + (["trainer.policy.lora_rank=4"] if policy == "lora" else [])
    done, wall, left = train_on_tmpfs(tmp_path, tiny, size, False, *kind)
    folder = tmp_path / "mnt" / "ckpt"
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    last = error_lines(done.stderr)[-1]
    assert f"cannot write the checkpoint of step 2 in {folder}: no space left on device" in last, last
    assert "the previous checkpoint step_00000001 is intact" in last
    assert "step 2/4" in done.stderr and "step 3/4" not in done.stderr  # stopped at the failed save
    assert left == {"steps": [1], "entries": ["step_00000001"]}  # verified; no partial folder
    assert wall < 30, f"{wall:.1f} s from the last step to the exit"
    print(f"{policy}: {wall:.1f} s from the last step to the exit; {last}")


def test_a_read_only_folder_stops_the_run_before_its_first_step_is_lost(tiny: Path, tmp_path: Path) -> None:
    done, wall, left = train_on_tmpfs(tmp_path, tiny, 1500, True)
    folder = tmp_path / "mnt" / "ckpt"
    assert done.returncode == 1, done.stderr[-2000:]
    last = error_lines(done.stderr)[-1]
    assert f"cannot write the checkpoint of step 1 in {folder}: read-only file system" in last, last
    assert "no earlier checkpoint exists" in last
    assert left == {"steps": [], "entries": []}
    assert wall < 30, f"{wall:.1f} s from the last step to the exit"
    print(f"read-only: {wall:.1f} s from the last step to the exit; {last}")
