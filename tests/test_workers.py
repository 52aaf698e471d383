"""The suite's xdist workers share no folder, cache or thread budget they did not agree on
(tests/conftest.py), a group's tests share one worker, and a run made for several tests is made
once (tests/shared_runs.py).

A child ``pytest -n 2`` runs probe tests under the suite's conftest (loaded as a plugin): each
probe reports what its worker and a process it starts see."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

PROBE = """
import json, os, subprocess, sys, tempfile, time
from pathlib import Path

import pytest
from shared_runs import shared_folder

OUT = Path(os.environ["PROBE_OUT"])

def made_once(folder):
    (folder / "by").write_text(os.environ["PYTEST_XDIST_WORKER"])
    with open(OUT / "makes", "a") as log:
        log.write("made\\n")
    time.sleep(1.0)  # long enough for the other worker to ask meanwhile

@pytest.mark.xdist_group("pair")
@pytest.mark.parametrize("n", range(2))
def test_grouped(n):
    time.sleep(0.5)
    (OUT / f"grouped{n}").write_text(os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.parametrize("n", range(4))
def test_probe(n, tmp_path, tmp_path_factory):
    time.sleep(0.5)
    shared = shared_folder(tmp_path_factory, "once", made_once)
    code = "import tempfile, os; print(tempfile.gettempdir()); print(os.environ['OMP_NUM_THREADS'])"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import torch
    report = {"worker": os.environ["PYTEST_XDIST_WORKER"], "tmp": tempfile.gettempdir(),
              "tmp_exists": os.path.isdir(tempfile.gettempdir()), "tmp_path": str(tmp_path),
              "inductor": os.environ["TORCHINDUCTOR_CACHE_DIR"], "triton": os.environ["TRITON_CACHE_DIR"],
              "threads": torch.get_num_threads(), "child": child.stdout.split(), "shared": str(shared),
              "shared_by": (shared / "by").read_text()}
    (OUT / f"{n}.json").write_text(json.dumps(report))
"""


@pytest.mark.timeout(300)
def test_two_workers_get_their_own_folders_caches_and_one_thread_each(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PROBE_OUT": str(out), "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    env.pop("OMP_NUM_THREADS", None)  # the workers set their own, whoever started them
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-p", "conftest",
         "-n", "2", "--dist", "loadgroup", "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "base"),
         str(tmp_path / "test_probe.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = [json.loads((out / f"{n}.json").read_text()) for n in range(4)]
    by_worker = {r["worker"]: r for r in reports}
    assert sorted(by_worker) == ["gw0", "gw1"], reports  # both workers ran probes
    for worker, r in by_worker.items():
        tmp = r["tmp"]
        assert Path(tmp).name.startswith(f"fg-{worker}-") and r["tmp_exists"], r
        assert r["inductor"].startswith(tmp + os.sep) and r["triton"].startswith(tmp + os.sep), r
        assert r["threads"] == 1 and r["child"] == [tmp, "1"], r  # a process it starts inherits both
        assert f"popen-{worker}" in r["tmp_path"], r
    assert by_worker["gw0"]["tmp"] != by_worker["gw1"]["tmp"]
    assert not any(Path(r["tmp"]).exists() for r in reports)  # each worker removed its own at the end
    # the shared folder: one, made once by one worker, read by every probe on both workers
    assert len({r["shared"] for r in reports}) == 1 and len({r["shared_by"] for r in reports}) == 1
    assert (out / "makes").read_text() == "made\n"
    # a group's tests run on one worker (pytest 9 broke this silently: it ignores the node id
    # that --dist loadgroup rewrites, and every grouped test went its own way)
    assert (out / "grouped0").read_text() == (out / "grouped1").read_text()
