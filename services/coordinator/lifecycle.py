"""A run's life as a process: one coordinator per run folder, what a crashed one left behind, and
what SIGTERM / SIGINT mean.

- :class:`RunLock`: ``<run_dir>/run.lock`` holds an exclusive ``flock`` for the run's whole life
  and names its holder (pid, host, start time). A second ``flowgrpo train`` on the folder is
  refused with that name. The kernel drops the lock when its holder dies, however it dies, so a
  stale lock is simply taken over (and said so).
- :func:`stop_leftovers`: the ``local`` launcher records each process it starts
  (``services/<replica>.pid.json``: pid and kernel start time, so a reused pid is not mistaken
  for it); a run that holds the lock stops every recorded process still alive, since only a
  coordinator that died without stopping them can have left them.
- :class:`StopSignals`: the first SIGTERM or SIGINT asks the run to stop (it finishes the step
  being trained, saves, drains the services and exits 0 saying where it will resume); before the
  run loop it abandons the start-up. A second signal forces: the step in flight is abandoned and
  the service processes are killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import fcntl
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowgrpo.fileio import atomic_write

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
PID_SUFFIX = ".pid.json"


class RunFolderBusy(RuntimeError):
    """Another coordinator holds the run folder."""


class RunInterrupted(Exception):
    """The run stopped on a signal: ``step`` steps trained, resumable after ``resume_step``."""

    def __init__(self, step: int, resume_step: int, forced: bool = False) -> None:
        self.step, self.resume_step, self.forced = step, resume_step, forced
        super().__init__(self.line())

    def line(self) -> str:
        how = "forced to stop" if self.forced else "interrupted"
        if self.resume_step == 0:
            return (
                f"{how} at step {self.step}; nothing was checkpointed yet: "
                "run the same command to start from step 0"
            )
        lost = ""
        if self.step > self.resume_step:
            lost = f" (steps {self.resume_step + 1}-{self.step} are trained again)"
        return f"{how} at step {self.step}; run the same command to resume from step {self.resume_step}{lost}"


class RunLock:
    """The run folder's lock, held from :meth:`acquire` until :meth:`release` (or death)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> str:
        """Take the lock or raise :class:`RunFolderBusy` naming its holder; returns a note about a
        previous holder that died without releasing it ("" when there was none)."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # checkpoints: the weights
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_holder(fd))
            os.close(fd)
            raise RunFolderBusy(
                f"{self.path.parent} is in use by another flowgrpo train ({holder}); stop it "
                "(SIGTERM or Ctrl-C: it saves and says where to resume), or give another run_dir"
            ) from None
        previous = _read_holder(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me()).encode() + b"\n", 0)
        self._fd = fd
        if previous and not previous.get("released"):
            return f"took over the lock of a run that stopped without releasing it ({_describe(previous)})"
        return ""

    def release(self) -> None:
        if self._fd is None:
            return
        record = {**_me(), "released": True}
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, json.dumps(record).encode() + b"\n", 0)
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None


def _me() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
    }  # no argv: it may hold a secret


def _read_holder(fd: int) -> dict[str, Any]:
    raw = os.pread(fd, 65536, 0)
    try:
        holder = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown"
    started = datetime.datetime.fromtimestamp(float(holder.get("started", 0))).isoformat(timespec="seconds")
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {started}"


# --- processes a crashed run left behind ---------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from field 3 on (after "(comm)"), or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), or
    None when it does not exist: with the pid, it names one process, never a later reuse."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])


def _running(pid: int, ticks: int) -> bool:
    """Whether the process ``pid`` started at ``ticks`` still runs: a zombie (exited, not yet
    reaped: its parent does not wait, as a container's init may not) has stopped already."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z" and int(fields[19]) == ticks


def record_process(folder: Path, replica: str, pid: int) -> None:
    """Note a started service process, so a later run can stop it if this one crashes."""
    record = {"pid": pid, "ticks": start_ticks(pid)}
    atomic_write(folder / f"{replica}{PID_SUFFIX}", json.dumps(record) + "\n")


def stop_leftovers(folder: Path, grace_s: float = 10.0) -> list[str]:
    """Stop every recorded process of ``folder`` (``<run_dir>/services``) that is still alive:
    SIGTERM to its process group (a drain), SIGKILL after ``grace_s``. Call it holding the run
    lock. Returns what was stopped, as lines for the log."""
    stopped, alive = [], []
    for record in sorted(folder.glob(f"*{PID_SUFFIX}")) if folder.is_dir() else []:
        replica = record.name.removesuffix(PID_SUFFIX)
        try:
            info = json.loads(record.read_text())
            pid, ticks = int(info["pid"]), info["ticks"]
        except (OSError, ValueError, KeyError, TypeError):
            record.unlink(missing_ok=True)
            continue
        if ticks is not None and start_ticks(pid) == ticks:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
                os.killpg(pid, signal.SIGCONT)  # a frozen one (SIGSTOP) drains too, once woken
            alive.append((replica, pid, ticks, record))
        else:
            record.unlink(missing_ok=True)
    deadline = time.monotonic() + grace_s
    for replica, pid, ticks, record in alive:
        while _running(pid, ticks) and time.monotonic() < deadline:
            time.sleep(0.05)
        if start_ticks(pid) == ticks:  # running, or a zombie whose group may still hold workers
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        stopped.append(f"{replica} (pid {pid})")
        record.unlink(missing_ok=True)
    return stopped


# --- signals --------------------------------------------------------------------------------------


class StopSignals:
    """SIGTERM and SIGINT for a run in this event loop (the main thread's; elsewhere a no-op).

    Once the run loop has started (:meth:`running`), the first signal calls ``on_stop``: the run
    finishes the step it trains and stops. Before that, it cancels ``task``: the start-up is
    abandoned, there is nothing to save. A second signal forces: ``on_force`` (which kills the
    service processes, so nothing waits on them) and ``task`` is cancelled."""

    def __init__(
        self, task: asyncio.Task[Any], on_stop: Callable[[], None], on_force: Callable[[], None]
    ) -> None:
        self.task, self.on_stop, self.on_force = task, on_stop, on_force
        self.signals = 0
        self._running = False
        self._installed: list[int] = []
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(signum, self._on_signal, signum)
            except (ValueError, RuntimeError, NotImplementedError):  # not the main thread's loop
                continue
            self._installed.append(signum)

    @property
    def forced(self) -> bool:
        return self.signals > 1

    def running(self) -> None:
        self._running = True

    def _on_signal(self, signum: int) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals == 1 and self._running:
            log.warning("%s: finishing the step in flight, then saving and stopping (again: force)", name)
            self.on_stop()
        elif self.signals == 1:
            log.warning("%s: abandoning the start-up", name)
            self.task.cancel()
        elif self.signals == 2:
            log.warning("%s again: forcing the stop (the step in flight is abandoned)", name)
            self.on_force()
            self.task.cancel()

    def remove(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in self._installed:
            loop.remove_signal_handler(signum)
        self._installed.clear()
