"""Start a service as its own process (``flowgrpo serve ROLE KEY=VALUE...``), wait for its ready
file and READY handshake, stop it with SIGTERM and check that it drained and exited 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from flowgrpo.runtime import wait_ready

PYTHON_M = (sys.executable, "-m")


def spawn_service(
    role: str,
    overrides: Sequence[str],
    ready: Path,
    launcher: Sequence[str] = PYTHON_M,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[str], str]:
    """The process and its gRPC address, once it answers the READY handshake."""
    ready.unlink(missing_ok=True)
    cmd = [
        *launcher,
        "flowgrpo.services.cli",
        "serve",
        role,
        f"server.ready_file={ready}",
        "log_format=text",
        *overrides,
    ]
    # its own process group, so a failed test ends every process it started (torchrun's workers too)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(f"{role} exited with {proc.returncode}: {proc.communicate()[1][-4000:]}")
        if time.monotonic() > deadline:
            kill_service(proc)
            raise AssertionError(f"the {role} service wrote no ready file in 60 s")
        time.sleep(0.05)
    address = json.loads(ready.read_text())["grpc_address"]
    asyncio.run(wait_ready(address, role=role, timeout_s=60))
    return proc, address


def stop_service(proc: subprocess.Popen[str]) -> None:
    """SIGTERM drains the service; it must exit 0."""
    proc.terminate()
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        kill_service(proc)
        raise
    assert proc.returncode == 0, stderr[-4000:]


def kill_service(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the service's whole process group (only what this test started)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
