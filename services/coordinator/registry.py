"""The coordinator's gRPC service: the registry of the run's replicas and the run's status.

Replicas started with ``coordinator=host:port`` (compose, Kubernetes, the ``local`` launcher)
register here, send a heartbeat every ``heartbeat_interval_s`` and leave when they drain. A
replica whose heartbeats stop for ``lost_after_s`` is declared lost: the run loop cancels its
calls in flight and sends the work elsewhere, without waiting for the call's own deadline. A
lost replica that beats again is told it is unknown, registers again and rejoins (the run loop
first brings its weights up to date). Every change is put on :attr:`events` for the run loop.

A registration is refused (INVALID_ARGUMENT, the replica keeps trying) when the replica's
settings, sent in its ``ServiceInfo``, differ from the run recipe's (``flowgrpo.config_digest``):
it gets no slot, the coordinator's log says why once, and :meth:`CoordinatorService.refusals`
keeps the reason for the run's own messages (a start-up that times out, a trainer not back).

Served in the coordinator's process by the same runtime as the services (health, handshake,
tracing, token), so ``flowgrpo status`` and container probes reach it like any service.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from flowgrpo import PROTOCOL_VERSION
from flowgrpo.config_digest import Settings, refusal
from flowgrpo.runtime import Actor, InvalidArgument, ServiceError, message, wait_ready
from flowgrpo.runtime.errors import HandshakeError, NotReadyError
from flowgrpo.runtime.membership import JITTER
from flowgrpo.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

ROLES = ("rollout", "reward", "trainer")
VERIFY_S = 3.0  # how long a registrant (or the replica it would replace) has to answer the handshake
MAX_REFUSALS = 64  # refused registrants whose reason is kept (the newest)


@dataclass
class Member:
    info: common_pb2.ServiceInfo
    state: str = "up"  # "up", "lost", "left"
    last_seen: float = 0.0  # time.monotonic()
    joins: int = 1
    in_flight: int = 0
    beats: bool = True  # False: an actor in this process (``inprocess``), never lost


@dataclass
class RegistryLoad:
    """What the registry has handled since it started (``flowgrpo bench scale`` reads it)."""

    registrations: int = 0  # Register calls accepted (first joins and rejoins)
    heartbeats: int = 0  # heartbeats answered
    late_heartbeats: int = 0  # beats that came more than 1.5 intervals after the member's last one
    missed_heartbeats: int = 0  # intervals with no beat, counted when the next beat finally comes
    lost: int = 0  # members declared lost (silent for lost_after_s)


@dataclass(frozen=True)
class MemberEvent:
    kind: str  # "joined" (registered: new, or back), "lost", "left"
    info: common_pb2.ServiceInfo


class CoordinatorService(Actor, coordinator_pb2_grpc.CoordinatorServicer):
    role = "coordinator"

    def __init__(
        self,
        run_id: str,
        heartbeat_interval_s: float = 2.0,
        lost_after_s: float = 20.0,
        verify: bool = True,
        max_heartbeats_per_s: float = 50.0,
        *,
        settings: Mapping[str, Settings] | None = None,
    ) -> None:
        super().__init__(replica_id="coordinator")
        self.run_id = run_id
        # per role, the settings of the run's recipe a registrant must have (launch.run_settings);
        # a role not in it is not compared (a registry without a run: tests, benchmarks)
        self.expected: dict[str, Settings] = dict(settings or {})
        self.refused: dict[str, tuple[str, str]] = {}  # replica id -> (role, why it was refused)
        # call a registrant back before accepting it (False only for tests of the bookkeeping)
        self.verify = verify
        self.heartbeat_interval_s = heartbeat_interval_s
        self.lost_after_s = lost_after_s
        # the beats handled per second stay below this: the period handed out grows with the
        # members (a thousand replicas beating every 2 s starved the run loop, docs/scaling.md)
        self.max_heartbeats_per_s = max_heartbeats_per_s
        self.interval_s = heartbeat_interval_s  # the period in force, kept by the watchdog
        self.members: dict[str, Member] = {}
        self.events: asyncio.Queue[MemberEvent] = asyncio.Queue()
        self.changed = asyncio.Event()  # set on every event; waiters clear it
        # what RunStatus reports; the run loop sets them after each step
        self.step = 0
        self.steps = 0
        self.schedule = ""
        self.policy_version = 0
        self.last_metrics: dict[str, float] = {}
        self.load = RegistryLoad()
        self._watchdog: asyncio.Task[None] | None = None

    async def start(self) -> None:
        raise_fd_limit()
        self._watchdog = asyncio.create_task(self._watch(), name="coordinator heartbeat watchdog")

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)

    # --- the RPCs ------------------------------------------------------------------------------

    async def Register(
        self, request: coordinator_pb2.RegisterRequest, context: grpc.aio.ServicerContext | None
    ) -> coordinator_pb2.RegisterResponse:
        """Verified outside the mailbox (a handshake may take seconds; heartbeats must not wait
        behind it), then joined as a message."""
        info = request.info
        self.check(info)
        known = self.members.get(info.replica_id)
        moved = known is not None and known.state == "up" and known.info.grpc_address != info.grpc_address
        if moved and known is not None and known.beats and await self._answers_as(known.info):
            raise ServiceError(
                f"replica id {info.replica_id!r} is registered at {known.info.grpc_address}, which still "
                f"answers as it; {info.grpc_address} cannot take it over (give each replica its own id, "
                f"or stop the old one first)",
                grpc.StatusCode.ALREADY_EXISTS,
            )
        if self.verify and not await self._answers_as(info):  # work and weights go only where verified
            raise InvalidArgument(
                f"{info.grpc_address} does not answer the READY handshake as {info.role} {info.replica_id}: "
                "register the address this replica serves at (server.advertise_host, server.port)"
            )
        await self.call(self._join, info)
        return coordinator_pb2.RegisterResponse(run_id=self.run_id, heartbeat_interval_s=self.interval_s)

    @message
    async def Heartbeat(
        self, request: coordinator_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext | None
    ) -> coordinator_pb2.HeartbeatResponse:
        member = self.members.get(request.replica_id)
        if member is None or member.state != "up":
            return coordinator_pb2.HeartbeatResponse(known=False)  # lost or left: register again
        self._count_beat(member, time.monotonic())
        member.info.policy_version = request.policy_version
        member.in_flight = request.in_flight
        return coordinator_pb2.HeartbeatResponse(known=True, heartbeat_interval_s=self.interval_s)

    def _count_beat(self, member: Member, now: float) -> None:
        gap = now - member.last_seen
        self.load.heartbeats += 1
        if gap > 1.5 * self.interval_s * (1 + JITTER):
            self.load.late_heartbeats += 1
            self.load.missed_heartbeats += max(0, round(gap / self.interval_s) - 1)
        member.last_seen = now

    @message
    async def Leave(
        self, request: coordinator_pb2.LeaveRequest, context: grpc.aio.ServicerContext | None
    ) -> coordinator_pb2.LeaveResponse:
        member = self.members.get(request.replica_id)
        if member is not None and member.state == "up":
            member.state = "left"
            log.info("%s left (%s)", request.replica_id, request.reason or "no reason given")
            self._emit("left", member.info)
        return coordinator_pb2.LeaveResponse()

    @message
    async def RunStatus(
        self, request: coordinator_pb2.RunStatusRequest, context: grpc.aio.ServicerContext | None
    ) -> coordinator_pb2.RunStatusResponse:
        now = time.monotonic()
        return coordinator_pb2.RunStatusResponse(
            run_id=self.run_id,
            step=self.step,
            steps=self.steps,
            schedule=self.schedule,
            policy_version=self.policy_version,
            replicas=[m.info for m in self.members.values() if m.state == "up"],
            last_metrics=common_pb2.Metrics(values=self.last_metrics),
            members=[
                coordinator_pb2.ReplicaStatus(
                    info=m.info,
                    state=m.state,
                    last_seen_s=now - m.last_seen,
                    joins=m.joins,
                    in_flight=m.in_flight,
                )
                for m in sorted(self.members.values(), key=lambda m: (m.info.role, m.info.replica_id))
            ],
        )

    # --- for the launcher and the run loop (same process) --------------------------------------

    def join(self, info: common_pb2.ServiceInfo, beats: bool = True) -> None:
        """Register ``info`` (after the Register RPC's checks; the ``inprocess`` launcher calls it
        directly, with ``beats=False``: its actors send no heartbeats)."""
        self.check(info)
        known = self.members.get(info.replica_id)
        member = Member(info, last_seen=time.monotonic(), joins=known.joins + 1 if known else 1, beats=beats)
        self.members[info.replica_id] = member
        self.load.registrations += 1
        log.info(
            "%s %s registered at %s (join %d)", info.role, info.replica_id, info.grpc_address, member.joins
        )
        self._emit("joined", info)

    async def _join(self, info: common_pb2.ServiceInfo) -> None:
        self.join(info)

    def check(self, info: common_pb2.ServiceInfo) -> None:
        """Refuse a registration this coordinator cannot use (version, role, id, address, settings
        other than the run recipe's)."""
        if info.protocol_version != PROTOCOL_VERSION:
            raise InvalidArgument(
                f"{info.replica_id or '(unnamed)'} speaks {info.protocol_version or '(none)'!r}, this "
                f"coordinator {PROTOCOL_VERSION!r}: run the same flowgrpo version everywhere"
            )
        if info.role not in ROLES or not info.replica_id or not info.grpc_address:
            raise InvalidArgument(
                f"a registration needs a role in {ROLES}, a replica_id and a grpc_address; got "
                f"role={info.role!r} replica_id={info.replica_id!r} grpc_address={info.grpc_address!r}"
            )
        known = self.members.get(info.replica_id)
        if known is not None and known.info.role != info.role:
            raise InvalidArgument(
                f"replica id {info.replica_id!r} is already a {known.info.role}; give each replica its own id"
            )
        if info.role in self.expected and (why := refusal(info, self.expected[info.role])) is not None:
            self._refuse(info, why)
            raise InvalidArgument(why)
        self.refused.pop(info.replica_id, None)

    def _refuse(self, info: common_pb2.ServiceInfo, why: str) -> None:
        """Keep ``why`` for :meth:`refusals`; said in the log once per reason (a refused replica
        tries again every few seconds)."""
        if self.refused.get(info.replica_id) != (info.role, why):
            log.warning("refused a registration: %s", why)
        self.refused.pop(info.replica_id, None)  # the newest last: the oldest goes first past the bound
        self.refused[info.replica_id] = (info.role, why)
        while len(self.refused) > MAX_REFUSALS:
            del self.refused[next(iter(self.refused))]

    def refusals(self, role: str) -> list[str]:
        """Why ``role`` replicas were refused for their settings: each one's last reason, forgotten
        once it registers with the run's."""
        return [why for of_role, why in self.refused.values() if of_role == role]

    async def _answers_as(self, info: common_pb2.ServiceInfo) -> bool:
        """Whether ``info.grpc_address`` answers the READY handshake as that replica (with this
        run's credential: an endpoint without it cannot answer)."""
        try:
            got = await wait_ready(
                info.grpc_address, role=info.role, timeout_s=VERIFY_S, client_role="coordinator"
            )
        except (NotReadyError, HandshakeError, grpc.aio.AioRpcError, ValueError):
            return False
        return got.replica_id == info.replica_id

    def up(self, role: str) -> list[common_pb2.ServiceInfo]:
        return [m.info for m in self.members.values() if m.state == "up" and m.info.role == role]

    def report(self, step: int, policy_version: int, metrics: dict[str, float]) -> None:
        self.step, self.policy_version, self.last_metrics = step, policy_version, dict(metrics)

    def _emit(self, kind: str, info: common_pb2.ServiceInfo) -> None:
        self.events.put_nowait(MemberEvent(kind, info))
        self.changed.set()

    def lost_after(self) -> float:
        """Silence after which a member is lost: ``lost_after_s``, or as many periods of the
        longer period in force."""
        return self.lost_after_s * self.interval_s / self.heartbeat_interval_s

    def _pace(self) -> None:
        """The period to hand out: the configured one, longer when the members would beat more
        than ``max_heartbeats_per_s`` times a second."""
        beating = sum(1 for m in self.members.values() if m.beats and m.state == "up")
        self.interval_s = max(self.heartbeat_interval_s, beating / self.max_heartbeats_per_s)

    async def _watch(self) -> None:
        """Declare lost the replicas whose heartbeats stopped; keep the period in force."""
        while True:
            await asyncio.sleep(min(self.heartbeat_interval_s, self.lost_after_s / 4))
            self._pace()
            now, lost_after = time.monotonic(), self.lost_after()
            for member in self.members.values():
                if member.beats and member.state == "up" and now - member.last_seen > lost_after:
                    member.state = "lost"
                    self.load.lost += 1
                    log.warning(
                        "%s %s sent no heartbeat for %.0f s (launch.lost_after_s=%g at a %.1f s period): "
                        "declared lost", member.info.role, member.info.replica_id, now - member.last_seen,
                        self.lost_after_s, self.interval_s,
                    )  # fmt: skip
                    self._emit("lost", member.info)


def raise_fd_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; return the new limit.

    The coordinator holds about two descriptors per replica (its channel to the replica, the
    replica's own channel for heartbeats) and the bus its own; the usual soft limit of 1,024 ran
    out near 500 replicas (docs/scaling.md), the hard limit (often 2^20) is what the process may have.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft >= hard:
        return soft
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as error:
        log.warning("cannot raise the open-file limit from %d to %d (%s): at most ~%d replicas",
                    soft, target, error, soft // 2)  # fmt: skip
        return soft
    return target


def server_concurrency(configured: int, members: int) -> int:
    """The RPCs the coordinator's server takes at once for a run of ``members`` replicas.

    A service's ``server.concurrency`` (64) refuses work past what it can do; the coordinator's
    RPCs are heartbeats, registrations and leaves, one or two per member at a time. While its
    event loop is busy (a step dispatching to a thousand replicas), every member's beat arrives
    at once, and refusing them is what overloaded it at 1,024 replicas: refused replicas
    registered again (docs/scaling.md). So it takes 4 per member (a run that scales beyond what
    it started with may set ``server.concurrency`` higher).
    """
    return max(configured, 4 * members + 64)
