"""Run a script under torchrun on the CPU (gloo) as the trainer tests do, in its own process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel


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


def one_and_two_ranks(
    out: Path, script: Path, one_process: Callable[[Path, Path, list[str]], None], kinds: list[str]
) -> Path:
    """Every kind trained in turn (a policy of its own each) by the worker ``script`` in this
    process (``one_process``: one rank, what a torchrun job of 1 process runs, at 1 thread as each
    rank) and by a torchrun job of 2, on a tiny BAGEL made in ``out``: ``out/one/<kind>``,
    ``out/two/<kind>``."""
    checkpoint = make_tiny_bagel(out / "tiny", seed=0)
    threads = torch.get_num_threads()
    try:
        one_process(checkpoint, out / "one", kinds)
    finally:
        torch.set_num_threads(threads)
    torchrun(2, script, str(checkpoint), str(out / "two"), *kinds)
    return out
