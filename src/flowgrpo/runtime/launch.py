"""The body of every ``flowgrpo serve ROLE``: logging, tracing, serve until drained, flush.

A replica started by the ``local`` launcher inherits the read end of a pipe whose write end only
its coordinator holds (its number in ``FLOWGRPO_PARENT_FD``): end-of-file there means the
coordinator is gone, however it died, and the replica drains and exits rather than live on as an
orphan holding ports, memory and shared-memory files.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from flowgrpo.logs import setup_logging
from flowgrpo.runtime.actor import Actor
from flowgrpo.runtime.config import ServiceProcessConfig
from flowgrpo.runtime.server import Service, serve
from flowgrpo.telemetry import setup_tracing, shutdown_tracing

PARENT_FD_ENV = "FLOWGRPO_PARENT_FD"


def run_service(actor: Actor, config: ServiceProcessConfig, services: Sequence[Service]) -> None:
    setup_logging(actor.role, actor.replica_id, fmt=config.log_format)
    setup_tracing(actor.role, replica_id=actor.replica_id, run_dir=config.run_dir or None)
    try:
        asyncio.run(serve(actor, config.server, services, coordinator=config.coordinator,
                          orphan_after_s=config.orphan_after_s, parent_fd=inherited_parent_fd()))  # fmt: skip
    finally:
        shutdown_tracing()


def inherited_parent_fd() -> int | None:
    """The coordinator's pipe, when this process was given one (and it is open); the variable is
    removed so that processes this one starts do not take an unrelated descriptor for it."""
    value = os.environ.pop(PARENT_FD_ENV, "")
    if not value.isdigit():
        return None
    fd = int(value)
    try:
        os.fstat(fd)
    except OSError:
        return None
    return fd


def end_process() -> NoReturn:
    """The last call of a service process whose actor stopped cleanly (its stores, sockets and
    files already released by its ``stop()``, its spans exported): flush the logs and stdio, then
    end with exit status 0 without Python's finalization (``os._exit``).

    Why: the finalization tears down native threads still alive (gRPC's, libzmq's, torch's,
    gloo's under FSDP2) in whatever order the modules go, and one of them can abort the process
    ("terminate called without an active exception", SIGABRT) after its work was done: a rollout
    did in 4 of 27 runs of the Kubernetes rehearsal, a torchrun trainer rank in about 1 of 17
    2-rank jobs. A launcher, a pod's restart policy or torchrun then counts a clean stop as a
    crash. Nothing of a clean stop is left to the finalization, so skipping it loses nothing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
