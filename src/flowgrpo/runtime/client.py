"""Client side: channels with the runtime's policies, and the READY wait.

Every channel from :func:`open_channel` gives a call without a deadline the default one, sends
the shared token, and carries the trace context. :func:`wait_ready` is how a launcher or the
coordinator waits for a replica: with a deadline, naming what it waits for when it gives up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import cast

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flowgrpo import PROTOCOL_VERSION
from flowgrpo.runtime.config import ClientConfig
from flowgrpo.runtime.errors import HandshakeError, NotReadyError
from flowgrpo.runtime.interceptors import call_details_interceptors
from flowgrpo.runtime.security import channel_credentials, resolve_token, token_client_interceptor
from flowgrpo.telemetry import grpc_client_interceptors
from flowgrpo.v1 import common_pb2, common_pb2_grpc

log = logging.getLogger(__name__)

# Answers that mean "not yet": nothing listens yet, or the actor is still starting.
_NOT_YET = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_FIRST_PAUSE_S = 0.05
_MAX_PAUSE_S = 1.0


def open_channel(address: str, config: ClientConfig | None = None) -> grpc.aio.Channel:
    """A channel to ``address`` ("host:port") with TLS per ``config.tls``, the token, the
    default deadline, keepalive and tracing."""
    config = config or ClientConfig()
    interceptors: list[grpc.aio.ClientInterceptor] = default_deadline(config.default_deadline_s)
    token = resolve_token(config.token)
    if token:
        interceptors.extend(token_client_interceptor(token))
    interceptors.extend(grpc_client_interceptors())
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging an idle connection
    ]
    credentials = channel_credentials(config.tls)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def default_deadline(seconds: float) -> list[grpc.aio.ClientInterceptor]:
    """Give every call made without a timeout this one: no call waits forever."""
    return call_details_interceptors(
        lambda details: details if details.timeout is not None else details._replace(timeout=seconds)
    )


async def wait_ready(
    address: str,
    *,
    role: str,
    timeout_s: float | None = None,
    config: ClientConfig | None = None,
    channel: grpc.aio.Channel | None = None,
    client_role: str = "",
    on_not_ready: Callable[[str], None] | None = None,
) -> common_pb2.ServiceInfo:
    """Retry the READY handshake with ``role`` at ``address`` until it answers; return its info.

    Waits at most ``timeout_s`` (default ``config.connect_timeout_s``), then raises
    :class:`NotReadyError` naming the address, the role and the wait. A refusal that retrying
    cannot cure (protocol mismatch, wrong token, another role) raises :class:`HandshakeError` at
    once. ``channel`` reuses an open channel to ``address``; otherwise one is opened and closed.
    ``on_not_ready`` is given each "not yet" answer's details (a starting replica says what it
    loads: :func:`flowgrpo.runtime.startup.starting_phase`).
    """
    config = config or ClientConfig()
    timeout_s = config.connect_timeout_s if timeout_s is None else timeout_s
    own_channel = channel is None
    channel = channel or open_channel(address, config)
    try:
        # The stub is async on an aio channel; the .pyi can only tell when grpc itself is typed.
        stub = cast("common_pb2_grpc.LifecycleAsyncStub", common_pb2_grpc.LifecycleStub(channel))
        info = await _handshake_until(stub, address, role, timeout_s, client_role, on_not_ready)
    finally:
        if own_channel:
            await channel.close()
    if info.role != role:
        raise HandshakeError(f"{address} is a {info.role} ({info.replica_id}), not the {role} expected there")
    log.info("%s %s at %s is ready", info.role, info.replica_id, address)
    return info


async def _handshake_until(  # noqa: PLR0917 (wait_ready's arguments, passed on)
    stub: common_pb2_grpc.LifecycleAsyncStub,
    address: str,
    role: str,
    timeout_s: float,
    client_role: str,
    on_not_ready: Callable[[str], None] | None,
) -> common_pb2.ServiceInfo:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    request = common_pb2.HandshakeRequest(client_role=client_role, protocol_version=PROTOCOL_VERSION)
    last, pause = "nothing answered", _FIRST_PAUSE_S
    while (remaining := deadline - loop.time()) > 0:
        try:
            response: common_pb2.HandshakeResponse = await stub.Handshake(
                request, timeout=remaining, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as error:
            if error.code() not in _NOT_YET:
                raise HandshakeError(
                    f"{role} at {address} refused the handshake: {error.code().name}: {error.details()}"
                ) from error
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                last = f"UNAVAILABLE: {error.details()}"
            if on_not_ready is not None:
                on_not_ready(error.details() or "")
            await asyncio.sleep(min(pause, max(deadline - loop.time(), 0.0)))
            pause = min(2 * pause, _MAX_PAUSE_S)
            continue
        return response.info
    raise NotReadyError(
        f"{role} at {address} was not ready within {timeout_s:g}s (waited for its READY handshake; "
        f"last: {last})"
    )


async def health(
    address: str, service: str = "", timeout_s: float = 5.0, config: ClientConfig | None = None
) -> str:
    """The grpc.health.v1 status of ``service`` ("" = the whole server) at ``address``:
    ``SERVING``, ``NOT_SERVING`` (starting or draining) or ``SERVICE_UNKNOWN``; raises
    :class:`grpc.aio.AioRpcError` when nothing answers within ``timeout_s``."""
    channel = open_channel(address, config)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            response = await stub.Check(request, timeout=timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:  # the server does not know that service
                return "SERVICE_UNKNOWN"
            raise
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
    finally:
        await channel.close()
