"""Suite-wide hooks and fixtures.

Under pytest-xdist (``python -m pytest -n 2``, opt-in: CI runs the suite serially until its
2-core time is measured on a quiet machine), each worker is a process of its own:
- one intra-op thread each (``OMP_NUM_THREADS=1``, inherited by every process a test starts):
  two workers of two spinning OpenMP threads on 2 cores slow the tiny models' steps by an order
  of magnitude. The exact claims at every core's threads are re-run by
  tests/test_instruction_sets.py, which starts its runs without the cap;
- a temporary folder and compile caches of its own (``TMPDIR``, ``TORCHINDUCTOR_CACHE_DIR``,
  ``TRITON_CACHE_DIR``), so no two workers share a file they did not agree on; servers bind port
  0 (the kernel's free port) everywhere already;
- work is handed out by group (``--dist loadgroup``): a test that uses none of the suite's
  fixtures of a wider scope is a group of its own; the others are grouped by file (its module
  fixtures made once) unless the file is marked ``spread`` (what its tests share is made once
  per test run: tests/shared_runs.py) or a test names its group (``xdist_group``); tests marked
  ``long`` are handed out first, so none starts last and runs alone (``--no-loadscope-reorder``:
  xdist would otherwise hand out the groups of most tests first, and every long test, a group
  of one, last).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

# Before anything loads OpenMP (read once, when it starts), in this process and every process a
# test starts: idle OpenMP threads sleep instead of spinning, as the local launcher's services do
# (services/coordinator/processes.py); a test's services beside its own process share 2 cores
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
from exactness import claims_exactness

WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...: set in each worker's process
_worker_tmp = ""


def pytest_configure(config: pytest.Config) -> None:
    global _worker_tmp
    if not WORKER:
        return
    os.environ["OMP_NUM_THREADS"] = "1"  # before any test module imports torch
    _worker_tmp = tempfile.mkdtemp(prefix=f"fg-{WORKER}-")  # short: unix socket paths live in it
    os.environ["TMPDIR"] = _worker_tmp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_worker_tmp, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(_worker_tmp, "triton")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _worker_tmp:
        shutil.rmtree(_worker_tmp, ignore_errors=True)


def shares_a_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture of the suite's own that outlives it (module, class,
    session scope: made once for several tests); pytest's own (``tmp_path_factory``) do not count."""
    info = getattr(item, "_fixtureinfo", None)  # read only: what pytest resolved for the test
    if info is None:
        return False
    return any(defs[-1].scope != "function" and defs[-1].baseid for defs in info.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marks and xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that claims exact equality is ``exact`` (tests/exactness.py: the rule); every
    test without a group of its own is in its file's; ``long`` tests first (stable otherwise)."""
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and claims_exactness(item.path, function.__name__):
            item.add_marker(pytest.mark.exact)
        alone = item.get_closest_marker("spread") is not None or not shares_a_fixture(item)
        if item.get_closest_marker("xdist_group") is None and not alone:  # alone: no group at all
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if WORKER:  # a serial run keeps the files' order: its module fixtures are made once each
        items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(autouse=True)
def environment_restored() -> Iterator[None]:
    """Each test leaves the process environment as it found it. A test that let a token stay in
    ``FLOWGRPO_TOKEN`` made every later in-process server require it: 157 errors, far from the
    test that leaked it."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
