"""The server of one actor: its gRPC services, standard health, the READY handshake, security,
tracing, and a graceful drain.

Life cycle: bind (port 0 picks a free one), write the ready file, run the actor's ``start()``,
then report SERVING. On SIGTERM, SIGINT or the Drain RPC: report NOT_SERVING, refuse new actor
messages with UNAVAILABLE, let the accepted ones finish within ``drain_grace_s``, stop the server
and run the actor's ``stop()``. A second signal cancels what is still running.

Every call to a ``flowgrpo.*`` service must carry a deadline (health probes need none); what a
handler raises comes back as a status whose details say where and what went wrong.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from flowgrpo import PROTOCOL_VERSION
from flowgrpo.fileio import atomic_write
from flowgrpo.runtime.actor import Actor
from flowgrpo.runtime.admission import Admission
from flowgrpo.runtime.config import ServerConfig
from flowgrpo.runtime.errors import ServiceError, Unavailable
from flowgrpo.runtime.interceptors import GuardInterceptor, MethodGuard, ParseGuard
from flowgrpo.runtime.membership import Membership
from flowgrpo.runtime.security import (
    UNAUTHENTICATED,
    check_bind_credentials,
    resolve_token,
    server_credentials,
)
from flowgrpo.runtime.startup import IMPORTS, process_age_s
from flowgrpo.telemetry import grpc_server_interceptor
from flowgrpo.v1 import common_pb2, common_pb2_grpc

log = logging.getLogger(__name__)

FLOWGRPO_PREFIX = "/flowgrpo."
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
REPLY_FLUSH_S = 1.0  # after the last message: time for its reply to reach the caller
ORPHAN_GRACE_S = 1.0  # a replica whose coordinator is gone: its replies have no reader


@dataclass(frozen=True)
class Service:
    """A generated service to serve::

        Service("flowgrpo.v1.Reward", actor, reward_pb2_grpc.add_RewardServicer_to_server)

    The name is explicit because the generated code does not expose it; health reports it.
    """

    name: str  # full name, reported by the health service
    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]  # the generated add_<Name>Servicer_to_server


class ServiceServer:
    """Serves one actor. ``start()`` returns the address; ``wait_stopped()`` returns after a drain."""

    def __init__(self, actor: Actor, config: ServerConfig, services: Sequence[Service] = ()) -> None:
        self.actor = actor
        self.config = config
        self.services = list(services)
        self.address = ""  # "host:port" peers dial, known once bound
        self._health = health_aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._drain: asyncio.Task[None] | None = None
        self._drain_wait: asyncio.Task[bool] | None = None
        self._serving = False  # the actor started: messages are accepted (until a drain)
        self._stopped = asyncio.Event()
        self.on_drain: list[Callable[[], Awaitable[None]]] = []  # run first when a drain begins

    async def start(self) -> str:
        """Bind, write the ready file, start the actor and report SERVING; return the address."""
        check_bind_credentials(self.config, f"{self.actor.role} {self.actor.replica_id}")
        server = self._build()
        port = self._bind(server)
        self._server = server
        self.address = f"{self._advertised_host()}:{port}"
        self.actor.grpc_address = self.address
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        if self.config.ready_file:
            self._write_ready_file(Path(self.config.ready_file))
        log.info("listening on %s; starting %s", self.address, self.actor.role, extra=self._log_fields())
        bound = process_age_s()  # Python, imports and config: the process's age at its port
        if bound is not None:
            self.actor.startup.insert(0, common_pb2.StartupPhase(name=IMPORTS, seconds=bound))
        try:
            await self.actor.launch()
        except BaseException:
            await server.stop(0)
            self._remove_ready_file()
            raise
        self.actor.startup_s = process_age_s() or self.actor.startup_s
        self._serving = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "ready: %s %s at %s",
            self.actor.role,
            self.actor.replica_id,
            self.address,
            extra=self._log_fields(),
        )
        return self.address

    def drain(self, grace_s: float | None = None) -> int:
        """Begin a graceful drain (once; later calls only report); return the messages in flight."""
        if not self._serving:
            raise Unavailable("cannot drain before the service has started; stop the process instead")
        if self._drain is None:
            grace = self.config.drain_grace_s if grace_s is None else grace_s
            in_flight = self.actor.begin_drain()
            log.info(
                "draining: %d message(s) in flight, grace %.1fs",
                in_flight,
                grace,
                extra={"in_flight": in_flight, "grace_s": grace},
            )
            self._drain = asyncio.create_task(self._finish_drain(grace), name="drain")
        return self.actor.in_flight

    async def stop(self, grace_s: float = 0.0) -> None:
        """Drain with ``grace_s`` and wait until the server has stopped."""
        self.drain(grace_s)
        await self.wait_stopped()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def install_signal_handlers(self) -> None:
        """SIGTERM / SIGINT drain; a second one cancels the messages still running."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._drain is None:
            log.info("%s: draining", name)
            self.drain()
        elif self._drain_wait is not None:
            log.warning("%s again: cancelling the %d message(s) still running", name, self.actor.in_flight)
            self._drain_wait.cancel()

    async def _finish_drain(self, grace_s: float) -> None:
        assert self._server is not None  # drain() needs a started server
        for hook in self.on_drain:
            await hook()
        await self._health.enter_graceful_shutdown()
        self._drain_wait = asyncio.create_task(self.actor.wait_idle(grace_s))
        await asyncio.wait([self._drain_wait])
        if self._drain_wait.cancelled() or not self._drain_wait.result():
            log.warning("drain: cancelling %d message(s) still in flight", self.actor.in_flight)
            await self.actor.cancel_messages(
                f"draining: cancelled before it finished (drain grace {grace_s:g}s); "
                "send it to another replica"
            )
        await self._server.stop(REPLY_FLUSH_S)
        try:
            await self.actor.shutdown()
        finally:
            self._remove_ready_file()
            self._stopped.set()
            log.info("stopped: %s %s", self.actor.role, self.actor.replica_id)

    def _build(self) -> grpc.aio.Server:
        where = f"{self.actor.role} {self.actor.replica_id}"
        # admission first: a refused call gets no span, no guard, no slot (runtime/admission.py);
        # no maximum_concurrent_rpcs: grpc.aio counts every call against it, refused ones too
        busy = (f"{where}: more than server.concurrency={self.config.concurrency} calls at once; "
                "retry later, or raise server.concurrency")  # fmt: skip
        token = resolve_token(self.config.token)
        admission = Admission(token, self.config.concurrency, UNAUTHENTICATED, busy)
        server = grpc.aio.server(
            interceptors=[
                admission,
                grpc_server_interceptor(),
                GuardInterceptor(call_policy(where), lambda m: m.startswith(FLOWGRPO_PREFIX)),
                ParseGuard(where),  # last: next to the handler, after the token and the deadline
            ],
            options=self._options(),
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        common_pb2_grpc.add_LifecycleServicer_to_server(Lifecycle(self), server)
        for service in self.services:
            service.add_to_server(service.servicer, server)
        return server

    def _options(self) -> list[tuple[str, int]]:
        handshake_ms = int(self.config.handshake_timeout_s * 1000)
        streams = max(self.config.max_streams_per_connection, self.config.concurrency)
        return [
            ("grpc.max_send_message_length", self.config.max_message_bytes),
            ("grpc.max_receive_message_length", self.config.max_message_bytes),
            # what gRPC bounds before any call exists (docs/security.md, "Admission"): idle and
            # half-open connections, how many, and the streams of each
            ("grpc.max_allowed_incoming_connections", self.config.max_connections),
            # at least server.concurrency: a client's burst of calls sent before it has read this
            # setting is reset past it (REFUSED_STREAM), which its caller reads as UNAVAILABLE
            ("grpc.max_concurrent_streams", streams),
            ("grpc.max_connection_idle_ms", int(self.config.idle_connection_s * 1000)),
            ("grpc.server_handshake_timeout_ms", handshake_ms),
            ("grpc.http2.settings_timeout", handshake_ms),  # a peer that never acknowledges SETTINGS
            ("grpc.keepalive_permit_without_calls", 1),
            (
                "grpc.http2.min_ping_interval_without_data_ms",  # the server-side limit (not "min_recv_...")
                int(self.config.min_ping_interval_s * 1000),
            ),
        ]

    def _bind(self, server: grpc.aio.Server) -> int:
        address = f"{self.config.host}:{self.config.port}"
        if self.config.port:
            check_port_free(self.config.host, self.config.port, f"cannot bind {self.actor.role} to {address}")
        credentials = server_credentials(self.config.tls)
        try:
            if credentials is None:
                port: int = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, credentials)
        except RuntimeError as error:
            raise OSError(f"cannot bind {self.actor.role} to {address}: {error}") from error
        if port == 0:
            raise OSError(f"cannot bind {self.actor.role} to {address}: is the port in use?")
        return port

    def _advertised_host(self) -> str:
        if self.config.advertise_host:
            return self.config.advertise_host
        return socket.gethostname() if self.config.host in WILDCARD_HOSTS else self.config.host

    async def _set_health(self, status: int) -> None:
        for name in ["", *(service.name for service in self.services)]:
            await self._health.set(name, status)

    def _remove_ready_file(self) -> None:
        """The file exists while the server listens; a stale one from a killed process may remain."""
        if self.config.ready_file:
            Path(self.config.ready_file).unlink(missing_ok=True)

    def _log_fields(self) -> dict[str, str]:
        return {"grpc_address": self.address, "role": self.actor.role}

    def _write_ready_file(self, path: Path) -> None:
        """Atomically (tmp + rename): a launcher polling the path never reads half a file."""
        record = {
            "grpc_address": self.address,
            "pid": os.getpid(),
            "role": self.actor.role,
            "replica_id": self.actor.replica_id,
        }
        atomic_write(path, json.dumps(record))


class Lifecycle(common_pb2_grpc.LifecycleServicer):
    """The READY handshake and the remote drain, served beside every actor's own services."""

    def __init__(self, server: ServiceServer) -> None:
        self._server = server

    async def Handshake(
        self, request: common_pb2.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.HandshakeResponse:
        actor = self._server.actor
        if request.protocol_version != PROTOCOL_VERSION:
            raise ServiceError(
                f"protocol mismatch: the client {request.client_role or '(unnamed)'} speaks "
                f"{request.protocol_version or '(none)'!r}, this {actor.role} speaks {PROTOCOL_VERSION!r}; "
                "run the same flowgrpo version on both sides"
            )
        if actor.refusal is not None:
            raise Unavailable(actor.refusal)
        return common_pb2.HandshakeResponse(info=actor.info())

    async def Drain(
        self, request: common_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.DrainResponse:
        return common_pb2.DrainResponse(in_flight=self._server.drain(request.grace_s or None))


def call_policy(where: str) -> MethodGuard:
    """The guard of every flowgrpo call: a deadline is required, and what the handler raises
    becomes a typed status (ServiceError: its code; anything else: INTERNAL, traceback logged)."""

    @asynccontextmanager
    async def guard(method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        if context.time_remaining() is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: {method} was called without a deadline; every flowgrpo call needs one "
                "(set timeout=, or use flowgrpo.runtime.open_channel, which adds a default)",
            )
        try:
            yield
        except grpc.aio.AbortError:
            raise
        except ServiceError as error:
            await context.abort(error.code, f"{where}: {error}")
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as error:  # not only Exception: a library's BaseException (DCP's
            # CheckpointException) would escape and leave the call unanswered until its deadline
            log.exception("%s: %s failed", where, method)
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"{where}: {method} failed: {type(error).__name__}: {error} (traceback in the service log)",
            )

    return guard


def check_port_free(host: str, port: int, what: str) -> None:
    """Raise ``OSError`` naming ``what`` and the cause when ``host:port`` cannot be bound (in use,
    an address not of this machine). Tried with a plain socket first because gRPC only says
    "Failed to bind" (and logs a native error line to stderr); it binds with SO_REUSEADDR too, so
    a port in TIME_WAIT passes here as there."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
    except OSError as error:
        cause = error.strerror or str(error)
        hint = " (another process holds it: choose another server.port, or 0 for a free one)"
        raise OSError(f"{what}: {cause}{hint if error.errno == errno.EADDRINUSE else ''}") from error


async def serve(
    actor: Actor,
    config: ServerConfig,
    services: Sequence[Service] = (),
    *,
    coordinator: str = "",
    orphan_after_s: float = 0.0,
    parent_fd: int | None = None,
) -> None:
    """Run ``actor`` until SIGTERM, SIGINT or Drain has drained it: the body of a service main.
    With ``coordinator`` (host:port) the replica registers there once started, sends heartbeats,
    and leaves when the drain begins; with ``orphan_after_s`` it also drains when the coordinator
    has not answered for that long. ``parent_fd``: a pipe from the process that launched this one;
    its end-of-file (that process died) drains too.

    Signals are handled once the actor has started; one during start-up ends the process.
    """
    server = ServiceServer(actor, config, services)
    await server.start()
    if coordinator:
        orphaned = functools.partial(_orphaned, server, f"the coordinator at {coordinator} has not answered "
                                     f"for {orphan_after_s:g} s (orphan_after_s)")  # fmt: skip
        membership = Membership(actor, coordinator, orphan_after_s=orphan_after_s, on_orphaned=orphaned)
        membership.start()
        server.on_drain.append(functools.partial(membership.leave, "draining"))
    if parent_fd is not None:
        _watch_parent(server, parent_fd)
    server.install_signal_handlers()
    await server.wait_stopped()


def _watch_parent(server: ServiceServer, fd: int) -> None:
    loop = asyncio.get_running_loop()

    def readable() -> None:
        try:
            data = os.read(fd, 1)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            return  # nothing is ever written; ignore it
        loop.remove_reader(fd)
        _orphaned(server, "the coordinator that launched this replica is gone (its pipe closed)")

    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)


def _orphaned(server: ServiceServer, why: str) -> None:
    log.warning("%s: draining and exiting", why)
    # no one is left to read a reply: a message in flight is cancelled after ORPHAN_GRACE_S, not
    # after the full drain grace (30 s by default), so an orphan never outlives launch.lost_after_s
    server.drain(ORPHAN_GRACE_S)
