"""A ``flowgrpo`` command run through the CLI's ``main`` in the test process: what the command
runs, without starting another interpreter (seconds a command)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

from flowgrpo.services.cli import main


def flowgrpo(*args: str, cwd: Path | None = None, threads: int | None = None) -> None:
    """``flowgrpo --debug ARGS`` (from ``cwd``; at ``threads`` intra-op threads, as a process of its
    own with OMP_NUM_THREADS would be); must exit 0, else its output and traceback are the
    failure's message. What a command changes globally (the thread count, the generator's state,
    fp32's TF32 switches) is put back afterwards: the test process goes on as it was."""
    said = io.StringIO()
    saved_threads = torch.get_num_threads()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with (
            contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext(),
            torch.random.fork_rng(devices=[]),
            contextlib.redirect_stdout(said),
            contextlib.redirect_stderr(said),
        ):
            status = main(["--debug", *args])
    finally:
        torch.set_num_threads(saved_threads)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert status == 0, said.getvalue()[-3000:]
