"""The registry under load, over real gRPC: a coordinator that is slow to answer must not make its
replicas register again (each registration costs it a call back to the replica), and its server
must take every member's heartbeat at once rather than refuse them."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from flowgrpo import PROTOCOL_VERSION
from flowgrpo.runtime import Actor, Service, ServiceError, ServiceServer, open_channel
from flowgrpo.runtime.config import ServerConfig
from flowgrpo.runtime.membership import Membership
from flowgrpo.services.coordinator.registry import CoordinatorService, server_concurrency
from flowgrpo.v1 import coordinator_pb2, coordinator_pb2_grpc
from flowgrpo.v1.common_pb2 import ServiceInfo
from flowgrpo.v1.coordinator_pb2 import HeartbeatRequest


class Replica(Actor):
    role = "reward"


class RefusingRegistry(CoordinatorService):
    """A registry whose first ``refusals`` heartbeats are refused as an overloaded server refuses."""

    def __init__(self, refusals: int) -> None:
        super().__init__("run-1", heartbeat_interval_s=0.1, lost_after_s=30.0, verify=False)
        self.refusals = refusals

    async def Heartbeat(
        self, request: coordinator_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext | None
    ) -> coordinator_pb2.HeartbeatResponse:
        if self.refusals > 0:
            self.refusals -= 1
            raise ServiceError("Concurrent RPC limit exceeded!", grpc.StatusCode.RESOURCE_EXHAUSTED)
        response: coordinator_pb2.HeartbeatResponse = await super().Heartbeat(request, context)
        return response


def serve(registry: CoordinatorService, concurrency: int = 64) -> ServiceServer:
    add = coordinator_pb2_grpc.add_CoordinatorServicer_to_server
    config = ServerConfig(concurrency=concurrency)
    return ServiceServer(registry, config, [Service("flowgrpo.v1.Coordinator", registry, add)])


async def until(what: str, check: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


def test_refused_heartbeats_are_tried_again_without_registering_again() -> None:
    async def body() -> None:
        registry = RefusingRegistry(refusals=3)
        server = serve(registry)
        address = await server.start()
        replica = Replica("reward-a")
        replica.grpc_address = "127.0.0.1:1"  # verify=False: never called back
        await replica.launch()
        membership = Membership(replica, address)
        membership.start()
        try:
            await until("3 refused beats, then 3 answered", lambda: registry.load.heartbeats >= 3)
            assert registry.load.registrations == 1  # the refusals did not make it register again
            assert registry.members["reward-a"].state == "up"
        finally:
            await membership.leave("test over")
            await replica.shutdown()
            await server.stop()

    asyncio.run(body())


@pytest.mark.parametrize("members", [300])
def test_the_coordinator_server_takes_every_members_beat_while_its_loop_is_busy(members: int) -> None:
    """Every member's beat arrives at once while the registry is busy (a long message ahead of
    them): the server sized by ``server_concurrency`` answers them all; the services' default
    (64) refused most of them, as it did at 1,024 replicas."""

    async def beats(concurrency: int) -> tuple[int, int]:
        registry = CoordinatorService("run-1", heartbeat_interval_s=1.0, verify=False)
        server = serve(registry, concurrency)
        address = await server.start()
        channel = open_channel(address)
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            busy = asyncio.ensure_future(registry.call(asyncio.sleep, 1.0))  # the loop's long step
            await asyncio.sleep(0.05)
            calls = [stub.Heartbeat(coordinator_pb2.HeartbeatRequest(replica_id=f"r{i}"), timeout=30)
                     for i in range(members)]  # fmt: skip
            results = await asyncio.gather(*calls, return_exceptions=True)
            await busy
        finally:
            await channel.close()
            await server.stop()
        refused = sum(isinstance(r, grpc.aio.AioRpcError) for r in results)
        return members - refused, refused

    answered, refused = asyncio.run(beats(server_concurrency(64, members)))
    assert (answered, refused) == (members, 0)
    _, refused_before = asyncio.run(beats(64))
    assert refused_before > 0  # the default refuses them: this test can fail


def test_the_heartbeat_period_grows_with_the_members_so_the_beats_per_second_stay_bounded() -> None:
    async def body() -> None:
        registry = CoordinatorService("run-1", heartbeat_interval_s=0.1, lost_after_s=1.0, verify=False,
                                      max_heartbeats_per_s=100.0)  # fmt: skip
        await registry.launch()
        try:
            for i in range(3):
                registry.join(ServiceInfo(role="reward", replica_id=f"r{i}", grpc_address="h:1",
                                          protocol_version=PROTOCOL_VERSION))  # fmt: skip
            await asyncio.sleep(0.3)  # a watchdog tick
            assert registry.interval_s == pytest.approx(0.1)  # 3 members x 10/s: below the bound of 100/s
            for i in range(3, 40):
                registry.join(ServiceInfo(role="reward", replica_id=f"r{i}", grpc_address="h:1",
                                          protocol_version=PROTOCOL_VERSION))  # fmt: skip
            await until("the period lengthened", lambda: registry.interval_s > 0.1)
            assert registry.interval_s == pytest.approx(40 / 100.0)  # 40 members, 100 beats/s at most
            assert registry.lost_after() == pytest.approx(1.0 * 0.4 / 0.1)  # as many periods as before
            answer = await registry.Heartbeat(HeartbeatRequest(replica_id="r0"), None)
            assert answer.known and answer.heartbeat_interval_s == pytest.approx(0.4)  # handed out
        finally:
            await registry.shutdown()

    asyncio.run(body())
