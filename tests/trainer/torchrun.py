"""Run a script under torchrun on the CPU (gloo) as the trainer tests do, in its own process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def torchrun(nproc: int, script: Path, *args: str, timeout_s: float = 240) -> None:
    """``python -m torch.distributed.run --nproc_per_node N script args...``; must exit 0."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # its own process group: a hang ends torchrun AND its workers, not only torchrun
    proc = subprocess.Popen([*launcher, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, stderr[-3000:]
