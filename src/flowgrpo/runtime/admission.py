"""Admission before work: who a call is decides what it may take, before a handler exists.

A call that carries the token (or any call when the server has none: loopback) is *admitted* and
takes one of ``server.concurrency`` slots while it runs; past them it is refused with
RESOURCE_EXHAUSTED. Health probes need no token and take a slot of their own small pool. Every
other call is *refused* with UNAUTHENTICATED by a handler that parses nothing and takes no slot:

- a call whose request is one message is refused at once, its message never read (a caller
  sending 200 MiB reads UNAUTHENTICATED, where grpc.aio would have read the message first);
- a streamed request is refused after its caller has had time to finish writing: grpc-python's
  client turns its own write that fails on a closed stream into "INTERNAL: Internal error from
  Core", overwriting the UNAUTHENTICATED it was sent. So a refused stream waits
  ``REFUSED_WAIT_S`` reading nothing (what its caller writes meanwhile stays within the stream's
  flow-control window, which is all a small request needs) before the status goes out. A few are
  drained instead, for callers that write more than a window before they half-close: their
  messages read as bytes and dropped until the half-close, at most ``REFUSED_DRAIN_BYTES`` and
  ``REFUSED_DRAIN_S``, while at most ``REFUSED_DRAINS`` refused streams of the whole server and
  ``REFUSED_DRAINS_PER_CONNECTION`` of one connection are being drained. Few, because a stream
  being read lets gRPC take in a whole message (up to ``server.max_message_bytes``) for it.

Neither kind of refusal counts against ``server.concurrency``: a flood of strangers cannot starve
the callers that hold the token. What gRPC bounds on its own (connections, streams per
connection, idle and half-open connections) is set in ``server.py``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import grpc.aio

from flowgrpo.runtime.interceptors import guard_handler

HEALTH_PREFIX = "/grpc.health.v1.Health/"
AUTH_KEY = "authorization"
# a refused stream is drained at most this far, and at most this many at once (whole server, one
# connection). Drained, each may make gRPC hold one whole message (<= server.max_message_bytes):
# 32 refused streams of 15 MiB each on 32 connections grew the reward process by 491 MiB with 16
# drains (798 MiB on main, which drained them all), by 140 MiB on one connection (889 MiB with 64
# drains per connection, 512 in all). 2 s, not less: on the loaded 2-core machine a 0.5 s drain cut 301 of
# 3,937 flooding 3-message streams before their caller had half-closed, and those read INTERNAL
REFUSED_DRAIN_BYTES, REFUSED_DRAIN_S = 256 << 10, 2.0
REFUSED_DRAINS, REFUSED_DRAINS_PER_CONNECTION = 16, 1
# the others: time for the caller's writes to land in the stream's window, unread (0.1 s, with 4
# drains per connection, left 788 of 1,225 flooding 3-message streams INTERNAL: their callers
# were starved of CPU and had not written yet)
REFUSED_WAIT_S = 1.0
PROBES = 128  # health probes served at once (they need no token, so they cannot take a work slot)


class Admission(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Admit, refuse or limit every call from its metadata (see the module docstring).

    ``token`` empty: every call is admitted (loopback without a token). ``unauthenticated`` is the
    message refused callers get; ``busy`` the message of a call refused for want of a slot."""

    def __init__(self, token: str, concurrency: int, unauthenticated: str, busy: str) -> None:
        self._expected = f"Bearer {token}".encode() if token else b""
        self._unauthenticated = unauthenticated
        self._work = _Slots(concurrency, busy)
        self._probes = _Slots(PROBES, f"more than {PROBES} health probes at once; probe less often")
        self._draining = 0
        self._draining_by_peer: collections.Counter[str] = collections.Counter()
        self.refused = 0  # calls refused for want of a token, since start

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return handler
        if details.method.startswith(HEALTH_PREFIX):
            return guard_handler(handler, self._probes.hold)
        if not self._expected or self._authenticated(details):
            return guard_handler(handler, self._work.hold)
        self.refused += 1
        streamed = handler.stream_unary is not None or handler.stream_stream is not None
        behavior = self._refuse_stream if streamed else self._refuse
        # a stream-request handler whatever the method's kind: grpc.aio then reads no request
        # message before the behavior runs, and the behavior reads none (or only drops bytes)
        return grpc.stream_unary_rpc_method_handler(behavior)

    def _authenticated(self, details: grpc.HandlerCallDetails) -> bool:
        sent = next((v for k, v in details.invocation_metadata or () if k == AUTH_KEY), "")
        sent = sent.encode() if isinstance(sent, str) else bytes(sent)
        return hmac.compare_digest(sent, self._expected)

    async def _refuse(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, self._unauthenticated)

    async def _refuse_stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        peer = context.peer()  # "ipv4:ADDR:PORT": one TCP connection
        if self._draining < REFUSED_DRAINS and self._draining_by_peer[peer] < REFUSED_DRAINS_PER_CONNECTION:
            self._draining += 1
            self._draining_by_peer[peer] += 1
            try:
                await _drain(requests)
            finally:
                self._draining -= 1
                self._draining_by_peer[peer] -= 1
                if not self._draining_by_peer[peer]:
                    del self._draining_by_peer[peer]
        else:
            await asyncio.sleep(REFUSED_WAIT_S)
        await self._refuse(requests, context)


async def _drain(requests: AsyncIterator[bytes]) -> None:
    """Read and drop a refused stream's messages (bytes: nothing is parsed) until its caller
    half-closes, or ``REFUSED_DRAIN_BYTES`` or ``REFUSED_DRAIN_S`` are spent."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(REFUSED_DRAIN_S):
            received = 0
            async for message in requests:
                received += len(message) + 5  # with the message's length prefix
                if received >= REFUSED_DRAIN_BYTES:
                    return


class _Slots:
    """A count of calls running, at most ``limit``; one past it is refused with
    RESOURCE_EXHAUSTED. Entered when the handler starts (after grpc has read a unary request),
    so a call cancelled before that never holds one."""

    def __init__(self, limit: int, busy: str) -> None:
        self.limit = limit
        self.running = 0
        self._busy = busy

    @asynccontextmanager
    async def hold(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        if self.running >= self.limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._busy)
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
