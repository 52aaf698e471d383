"""The ``local`` launcher's processes: each replica a ``flowgrpo serve`` process in its own process
group, its config a file, its output a log; how one is started, found ready, stopped, and named
when it dies while starting. The launcher (``launch.py``) decides which to start and when."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from flowgrpo.bus.config import SECRET_ENV
from flowgrpo.config import dump_yaml
from flowgrpo.runtime.launch import PARENT_FD_ENV
from flowgrpo.runtime.security import TOKEN_ENV
from flowgrpo.services.coordinator.lifecycle import record_process
from flowgrpo.services.coordinator.progress import StartupReport

T = TypeVar("T")


class ServiceStartError(RuntimeError):
    """A launched service process exited before it answered the READY handshake; the message
    quotes the last line of its log (the service's own one-line error)."""


def exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


class Lifeline:
    """A pipe whose read end every launched single-process replica inherits: when this process
    dies (even SIGKILL), the kernel closes the write end and each replica sees end-of-file at
    once and drains (``runtime.launch``). torchrun's workers do not inherit it; they rely on
    ``orphan_after_s``."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()  # neither inheritable (PEP 446) unless passed

    def close(self) -> None:
        for fd in (self.read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def spawn(rid: str, config: Any, run_dir: Path, nproc: int, lifeline: Lifeline) -> subprocess.Popen[bytes]:
    path = run_dir / "services" / f"{rid}.yaml"
    dump_yaml(config, path)
    Path(config.server.ready_file).unlink(missing_ok=True)
    role = rid.split("-", maxsplit=1)[0]
    # --debug: the log keeps the traceback, then the one-line error the coordinator quotes
    serve = ["-m", "flowgrpo.services.cli", "--debug", "serve", role, "--config", str(path)]
    if nproc > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        cmd = [sys.executable, *launcher, *serve]
    else:
        cmd = [sys.executable, *serve]
    logfile = open(run_dir / "logs" / f"{rid}.log", "ab")  # noqa: SIM115 (the child holds it)
    env = dict(os.environ)
    # OpenMP threads that finish a parallel region sleep at once instead of spinning for the next
    # one: the services share the machine's cores, and on a CPU run a spinning idle thread of one
    # takes the core another computes on (a 4-step tiny_jpeg run on 2 loaded cores: 50 s of CPU
    # spinning, 15 s passive, the same bits). The caller's own setting wins.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # a secret set in the config reaches the child through its environment: the file it reads
    # is written with secrets emptied (dump_yaml)
    for name, value in ((TOKEN_ENV, config.server.token), (SECRET_ENV, config.bus.secret)):
        if value:
            env[name] = value
    passed: tuple[int, ...] = ()
    if nproc == 1:
        env[PARENT_FD_ENV], passed = str(lifeline.read_fd), (lifeline.read_fd,)
    # its own process group: stopping the run stops torchrun's workers too, and a Ctrl-C in the
    # terminal reaches only the coordinator, which stops the services in order
    proc = subprocess.Popen(
        cmd, stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True, env=env, pass_fds=passed
    )
    logfile.close()
    record_process(run_dir / "services", rid, proc.pid)
    return proc


async def ready_address(  # noqa: PLR0917
    rid: str,
    proc: subprocess.Popen[bytes],
    config: Any,
    run_dir: Path,
    timeout_s: float,
    report: StartupReport | None = None,
) -> str:
    ready = Path(config.server.ready_file)
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None:
            raise start_failure(rid, proc, run_dir)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{rid} wrote no ready file ({ready}) within launch.start_timeout_s={timeout_s:.0f} s; "
                f"see {run_dir / 'logs' / (rid + '.log')}"
            )
        await asyncio.sleep(0.1)
    address: str = json.loads(ready.read_text())["grpc_address"]
    if report is not None:  # asked at once: its line comes as soon as it is ready, not once all listen
        report.listening(rid, address, rid.split("-", maxsplit=1)[0], timeout_s)
    return address


def terminate_groups(procs: Sequence[subprocess.Popen[bytes]] | Any, grace_s: float) -> None:
    """SIGTERM (a graceful drain), then SIGKILL of the whole process group after ``grace_s``."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def stop_groups(procs: Any, grace_s: float) -> None:
    """:func:`terminate_groups` off the event loop: while the services drain, their goodbyes
    (``Leave``) reach the coordinator's server, which a blocked loop would leave unanswered until
    its stop cancels them (a CancelledError traceback on the user's terminal). Cancelled, it kills
    at once rather than leave the processes running."""
    procs = list(procs)
    try:
        await asyncio.to_thread(terminate_groups, procs, grace_s)
    except asyncio.CancelledError:
        kill_groups(procs)
        raise


def kill_groups(procs: Any) -> None:
    """SIGKILL every process group still running (a forced stop)."""
    for proc in list(procs):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


async def unless_one_exits(
    connect: Awaitable[T], procs: dict[str, subprocess.Popen[bytes]], run_dir: Path
) -> T:
    """``connect``'s result, or :class:`ServiceStartError` as soon as one of ``procs`` exits.

    A connect that fails while a process is dying is that process's failure: a server that stops
    cancels the handshake in flight (CANCELLED) a moment before its process can be reaped, so a
    failed connect waits up to ``_EXIT_GRACE_S`` for an exit before it is raised as it is."""
    connecting = asyncio.ensure_future(connect)
    while not connecting.done():
        exited = _exited(procs)
        if exited is not None:
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
            raise start_failure(exited, procs[exited], run_dir)
        await asyncio.wait({connecting}, timeout=0.1)
    if connecting.exception() is not None:
        deadline = time.monotonic() + _EXIT_GRACE_S
        while time.monotonic() < deadline:
            exited = _exited(procs)
            if exited is not None:
                raise start_failure(exited, procs[exited], run_dir) from connecting.exception()
            await asyncio.sleep(0.05)
    return connecting.result()


_EXIT_GRACE_S = 2.0


def _exited(procs: dict[str, subprocess.Popen[bytes]]) -> str | None:
    return next((rid for rid, proc in procs.items() if proc.poll() is not None), None)


def start_failure(rid: str, proc: subprocess.Popen[bytes], run_dir: Path) -> ServiceStartError:
    log_path = run_dir / "logs" / f"{rid}.log"
    return ServiceStartError(
        f"{rid} exited with status {proc.returncode} while starting; its log ends: "
        f"{last_line(log_path)} (all of it: {log_path})"
    )


def last_line(path: Path, most: int = 500) -> str:
    """The last non-empty line of a log file, at most ``most`` characters (read from its end: a
    log may be large)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return "(no log)"
    line = next((line for line in reversed(lines) if line), "(an empty log)")
    return line if len(line) <= most else line[:most] + "..."
