"""A run as a process, tried as users and operators meet it: SIGTERM and Ctrl-C stop it cleanly
and say where it resumes, a second signal forces, a killed coordinator leaves no service behind,
one run per folder, and a resume logs every step once. Real ``flowgrpo train`` processes, the
``local`` launcher (every service its own process) unless said otherwise."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.services.coordinator.lifecycle import (
    LOCK_FILE,
    RunFolderBusy,
    RunLock,
    record_process,
    start_ticks,
    stop_leftovers,
)
from flowgrpo.services.coordinator.outputs import read_metrics

from .test_train import CLI, finish, start, wait_for_step

# 4 samples a prompt (not 16): what these tests try is the run as a process (signals, locks,
# leftovers), which a step of a smaller group shows as well, at a quarter of its cost
STEPS = ["schedule.steps=6", "schedule.save_every=0", "schedule.eval_every=0", "data.group_size=4"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("model"), seed=0)


def service_pids(run_dir: Path) -> dict[str, int]:
    """The service processes the launcher recorded, by replica id."""
    return {p.name.removesuffix(".pid.json"): json.loads(p.read_text())["pid"]
            for p in (run_dir / "services").glob("*.pid.json")}  # fmt: skip


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its parent, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], within_s: float, run_dir: Path | None = None) -> float:
    """Seconds until every one of ``pids`` has exited; past ``within_s`` the failure quotes the
    end of each service log of ``run_dir`` (what a replica still running was doing: a flake of
    the killed-coordinator test, seen twice, left nothing else) and kills the leftovers."""
    start_s = time.monotonic()
    while any(alive(p) for p in pids):
        if time.monotonic() - start_s >= within_s:
            running = [p for p in pids if alive(p)]
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"still running after {within_s} s: {running}{log_tails(run_dir)}")
        time.sleep(0.05)
    return time.monotonic() - start_s


def log_tails(run_dir: Path | None, lines: int = 15) -> str:
    if run_dir is None:
        return ""
    tails = []
    for log in sorted((run_dir / "logs").glob("*.log")):
        last = log.read_text(errors="replace").splitlines()[-lines:]
        tails.append(f"\n--- {log.name} (last {lines} lines)\n" + "\n".join(last))
    return "".join(tails)


def test_a_process_that_outlives_the_wait_is_killed_and_the_failure_quotes_the_logs(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trainer.log").write_text("started\nstill saving the checkpoint\n")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(AssertionError, match=r"(?s)still running after 0.2 s.*trainer.log.*still saving"):
        wait_gone([sleeper.pid], within_s=0.2, run_dir=tmp_path)
    assert sleeper.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.timeout(600)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_stops_the_run_after_its_step_saves_and_the_same_command_resumes(
    tiny: Path, tmp_path: Path, signum: signal.Signals
) -> None:
    proc = start(tmp_path, tiny, *STEPS)
    wait_for_step(tmp_path, 2, proc)
    pids = service_pids(tmp_path)
    assert set(pids) == {"rollout-0", "reward-0", "trainer"}
    os.kill(proc.pid, signum)
    stderr = finish(proc, expect=0)
    [line] = [x for x in stderr.splitlines() if x.startswith("flowgrpo train: ")]
    state = json.loads((tmp_path / "run_state.json").read_text())
    step = state["step"]
    assert step >= 2 and line == (
        f"flowgrpo train: interrupted at step {step}; run the same command to resume from step {step}"
    )
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    # drained and gone before the coordinator exited
    wait_gone(list(pids.values()), within_s=1, run_dir=tmp_path)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["released"] is True
    # the same command resumes from that step and logs each step once
    done = subprocess.run(proc.args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed at step {step}" in done.stderr
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))


@pytest.mark.timeout(600)
def test_a_second_signal_forces_the_stop_and_kills_the_services(tiny: Path, tmp_path: Path) -> None:
    proc = start(tmp_path, tiny, *STEPS, "schedule.save_every=1")
    wait_for_step(tmp_path, 1, proc)
    pids = service_pids(tmp_path)
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGINT)  # not SIGTERM twice: the kernel merges a pending signal's repeats
    stderr = finish(proc, expect=130)
    # before or after step 1's checkpoint, depending on when the signals land
    assert "forced to stop at step" in stderr and "run the same command to" in stderr
    wait_gone(list(pids.values()), within_s=1, run_dir=tmp_path)


@pytest.mark.timeout(600)
def test_a_killed_coordinator_leaves_no_service_running(tiny: Path, tmp_path: Path) -> None:
    """SIGKILL (an OOM kill, a lost node): every replica sees its coordinator's pipe close and
    drains at once, well inside ``launch.lost_after_s``."""
    proc = start(tmp_path, tiny, *STEPS, "launch.lost_after_s=10")
    wait_for_step(tmp_path, 1, proc)
    pids = service_pids(tmp_path)
    os.killpg(proc.pid, signal.SIGKILL)  # the coordinator's group: the services have their own
    proc.wait()
    took = wait_gone(list(pids.values()), within_s=10 + 5, run_dir=tmp_path)
    assert took < 10, f"the services outlived their coordinator by {took:.1f} s"
    log = (tmp_path / "logs" / "rollout-0.log").read_text()
    assert "the coordinator that launched this replica is gone" in log


@pytest.mark.timeout(120)
def test_a_launched_replica_whose_coordinator_never_answers_exits(tiny: Path, tmp_path: Path) -> None:
    """The other way out, for processes that cannot inherit the pipe (torchrun's workers): a
    replica launched with ``orphan_after_s`` that hears nothing from its coordinator drains."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"  # closed again: connections are refused
    cmd = [*CLI, "serve", "reward", f"coordinator={nobody}", "orphan_after_s=2",
           f"server.ready_file={tmp_path / 'ready.json'}", "log_format=text"]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"the coordinator at {nobody} has not answered for 2 s (orphan_after_s)" in done.stderr
    assert took < 30, took


@pytest.mark.timeout(600)
def test_one_run_per_folder_and_a_crashed_runs_leftovers_are_stopped(tiny: Path, tmp_path: Path) -> None:
    proc = start(tmp_path, tiny, *STEPS)
    wait_for_step(tmp_path, 1, proc)
    second = subprocess.run(proc.args, capture_output=True, text=True, timeout=120)
    assert second.returncode == 1
    assert f"{tmp_path} is in use by another flowgrpo train (pid {proc.pid} on host " in second.stderr
    # the holder crashes; a service it left (here: SIGSTOPped, so it cannot notice) is stopped
    # by the next run, which takes over the lock
    pids = service_pids(tmp_path)
    os.kill(pids["reward-0"], signal.SIGSTOP)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = subprocess.run(proc.args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"took over the lock of a run that stopped without releasing it (pid {proc.pid}" in done.stderr
    # the frozen one at least (the others may still be draining after their pipe closed)
    stopped = re.search(r"stopped (.*), left running by an earlier run", done.stderr)
    assert stopped is not None and f"reward-0 (pid {pids['reward-0']})" in stopped[1], done.stderr[:1500]
    assert not alive(pids["reward-0"])
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 7))


def test_the_lock_names_its_holder_and_is_free_once_released(tmp_path: Path) -> None:
    first = RunLock(tmp_path)
    assert first.acquire() == ""
    with pytest.raises(RunFolderBusy, match=rf"in use by another flowgrpo train \(pid {os.getpid()} on host"):
        RunLock(tmp_path).acquire()
    first.release()
    again = RunLock(tmp_path)
    assert again.acquire() == ""  # released cleanly: nothing to report
    again.release()


def test_leftovers_are_stopped_but_a_reused_pid_is_not(tmp_path: Path) -> None:
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    innocent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        record_process(tmp_path, "rollout-0", leftover.pid)
        ticks = start_ticks(innocent.pid)
        assert ticks is not None
        (tmp_path / "reward-0.pid.json").write_text(json.dumps({"pid": innocent.pid, "ticks": ticks - 1}))
        assert stop_leftovers(tmp_path, grace_s=5) == [f"rollout-0 (pid {leftover.pid})"]
        assert leftover.wait(timeout=5) == -signal.SIGTERM
        assert innocent.poll() is None  # its pid was recorded, but with another start time
        assert not list(tmp_path.glob("*.pid.json"))
    finally:
        for p in (leftover, innocent):
            p.kill()
            p.wait()
