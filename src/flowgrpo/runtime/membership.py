"""A replica's membership of a run: register with the coordinator, send heartbeats, leave.

Started by :func:`~flowgrpo.runtime.server.serve` when the service's config names a coordinator
(``coordinator=host:port``). The replica serves whether or not the coordinator answers: until it
does, registration is retried every few seconds (a coordinator may start after its replicas, or
restart). A heartbeat answered with ``known = false`` (the coordinator restarted, or declared this
replica lost) makes it register again, which is how a replica rejoins a run. On drain it says
goodbye (``Leave``), so the coordinator stops sending it work before its port closes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import cast

import grpc
import grpc.aio

from flowgrpo.runtime.actor import Actor
from flowgrpo.runtime.client import open_channel
from flowgrpo.runtime.config import ClientConfig
from flowgrpo.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

RETRY_S = 2.0  # between registration attempts while the coordinator does not answer
CALL_TIMEOUT_S = 10.0
JITTER = 0.2  # each pause is drawn from +-20% of its length: replicas started together drift apart
# A heartbeat that failed with one of these is tried again at the next beat; the coordinator, not
# one failed call, decides when a replica is lost. Registering again instead (what any other
# failure does) is far dearer for the coordinator: at 1,024 replicas an overloaded coordinator
# refusing beats (RESOURCE_EXHAUSTED) made every refused replica register again, each
# registration a call back to the replica, which overloaded it further (docs/scaling.md).
BEAT_AGAIN = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
)

# A registration answered with one of these was read and refused (another version, settings other
# than the run recipe's, a replica id in use): the replica says so, and tries again all the same
# (the coordinator may be restarted with another recipe, the other replica may go).
REFUSED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
)


def jittered(seconds: float) -> float:
    return seconds * random.uniform(1 - JITTER, 1 + JITTER)


class Membership:
    """Keeps ``actor`` registered with the coordinator at ``address`` until :meth:`leave`."""

    def __init__(
        self,
        actor: Actor,
        address: str,
        client: ClientConfig | None = None,
        orphan_after_s: float = 0.0,
        on_orphaned: Callable[[], None] | None = None,
    ) -> None:
        self.actor = actor
        self.address = address
        self.run_id = ""
        # a launched replica: call on_orphaned once the coordinator has been silent this long
        self.orphan_after_s, self.on_orphaned = orphan_after_s, on_orphaned
        self._answered = time.monotonic()  # the coordinator's last answer (or our start)
        self._channel = open_channel(address, client)
        self._stub = cast(
            "coordinator_pb2_grpc.CoordinatorAsyncStub", coordinator_pb2_grpc.CoordinatorStub(self._channel)
        )
        self._task: asyncio.Task[None] | None = None
        self._interval = 0.0  # the heartbeat period the coordinator asks for (0: not registered yet)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"membership {self.address}")

    async def leave(self, reason: str) -> None:
        """Stop the heartbeats and say goodbye (best effort: the coordinator may be gone)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.run_id:
            request = coordinator_pb2.LeaveRequest(replica_id=self.actor.replica_id, reason=reason)
            try:
                await self._stub.Leave(request, timeout=2.0)
            except grpc.aio.AioRpcError as error:
                log.info(
                    "could not say goodbye to the coordinator at %s: %s", self.address, error.code().name
                )
        await self._channel.close()

    async def _run(self) -> None:
        failures = 0  # failed attempts in a row
        said: grpc.StatusCode | None = None  # the status of them last said in the log
        while not self._orphaned():
            try:
                self._interval = await self._register()
                failures, said = 0, None
                while await self._heartbeat(self._interval):
                    if self._orphaned():
                        return
                    await asyncio.sleep(jittered(self._interval))
                log.warning(
                    "the coordinator at %s no longer knows this replica; registering again", self.address
                )
            except grpc.aio.AioRpcError as error:
                failures += 1
                if error.code() != said or failures % 30 == 0:  # each new reason at once, not every 2 s
                    said = error.code()
                    _say_failed(self.address, error)
                await asyncio.sleep(jittered(RETRY_S))

    async def _register(self) -> float:
        request = coordinator_pb2.RegisterRequest(info=self.actor.info())
        response: coordinator_pb2.RegisterResponse = await self._stub.Register(
            request, timeout=CALL_TIMEOUT_S
        )
        self.run_id = response.run_id
        self._answered = time.monotonic()
        log.info("registered with the coordinator at %s (run %s)", self.address, response.run_id)
        return max(response.heartbeat_interval_s, 0.1)

    async def _heartbeat(self, interval: float) -> bool:
        request = coordinator_pb2.HeartbeatRequest(
            replica_id=self.actor.replica_id,
            policy_version=self.actor.policy_version,
            in_flight=self.actor.in_flight,
        )
        try:
            response: coordinator_pb2.HeartbeatResponse = await self._stub.Heartbeat(
                request, timeout=max(CALL_TIMEOUT_S, 2 * interval)
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in BEAT_AGAIN:
                log.warning("heartbeat to %s failed (%s); trying again", self.address, error.code().name)
                return True  # the next beat may pass; the coordinator decides when we are lost
            raise
        self._answered = time.monotonic()
        if response.heartbeat_interval_s > 0:  # the coordinator slows its members down as they grow
            self._interval = max(response.heartbeat_interval_s, 0.1)
        return response.known

    def _orphaned(self) -> bool:
        """True (once ``on_orphaned`` was called) when a launched replica's coordinator has been
        silent for ``orphan_after_s``."""
        silent = time.monotonic() - self._answered
        patience = max(self.orphan_after_s, 3 * self._interval)  # a period the coordinator lengthened
        if not self.orphan_after_s or silent < patience or self.on_orphaned is None:
            return False
        self.on_orphaned()
        return True


def _say_failed(address: str, error: grpc.aio.AioRpcError) -> None:
    what = "refused this replica" if error.code() in REFUSED else "cannot be reached"
    log.warning(
        "the coordinator at %s %s (%s: %s); retrying every %.0f s",
        address, what, error.code().name, error.details(), RETRY_S,
    )  # fmt: skip
