"""Runs that several tests read, made once per test run, whichever xdist worker asks first.

A module-scoped fixture is made again by every worker that runs one of its tests, and again
when a worker comes back to the module after another one. A folder made through
:func:`shared_folder` is made once under the run's shared temporary root: the first process to
ask makes it under an exclusive lock, the others wait on the lock and read what it made. A make
that failed leaves nothing behind, so each asker then fails with the error of its own try.
Readers must not change what they read (a report written beside it is fine).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def shared_root(factory: pytest.TempPathFactory) -> Path:
    """The folder every worker of this test run sees: the base temporary folder's parent under
    xdist (each worker's own is ``popen-gwN`` inside it), the base folder itself without."""
    base = factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    return root


def shared_folder(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """``root/name``, made by ``make(folder)`` (into an empty folder) once per test run."""
    root = shared_root(factory)
    folder = root / name
    done = root / f"{name}.done"
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                make(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            done.touch()
    return folder
