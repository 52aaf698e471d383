"""The body of every ``flowgrpo serve ROLE``: logging, tracing, serve until drained, flush."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from flowgrpo.logs import setup_logging
from flowgrpo.runtime.actor import Actor
from flowgrpo.runtime.config import ServiceProcessConfig
from flowgrpo.runtime.server import Service, serve
from flowgrpo.telemetry import setup_tracing, shutdown_tracing


def run_service(actor: Actor, config: ServiceProcessConfig, services: Sequence[Service]) -> None:
    setup_logging(actor.role, actor.replica_id, fmt=config.log_format)
    setup_tracing(actor.role, replica_id=actor.replica_id, run_dir=config.run_dir or None)
    try:
        asyncio.run(serve(actor, config.server, services, coordinator=config.coordinator))
    finally:
        shutdown_tracing()
