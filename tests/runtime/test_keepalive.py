"""A call that runs longer than a few client keepalive pings (a TrainStep of a thousand replicas'
samples) is not cut by the server as "too many pings": the server's minimum ping interval is
the one configured (``server.min_ping_interval_s``), not gRPC's default of 5 minutes, which an
option name gRPC does not know left in force (docs/scaling.md)."""

from __future__ import annotations

import asyncio

import grpc

from flowgrpo.runtime import Service, ServiceServer, open_channel
from flowgrpo.runtime.config import ClientConfig, ServerConfig
from flowgrpo.services.coordinator.registry import CoordinatorService
from flowgrpo.v1 import coordinator_pb2, coordinator_pb2_grpc


class SlowRegistry(CoordinatorService):
    async def RunStatus(
        self, request: coordinator_pb2.RunStatusRequest, context: grpc.aio.ServicerContext | None
    ) -> coordinator_pb2.RunStatusResponse:
        await asyncio.sleep(6.0)  # no data on the connection meanwhile: only the client's pings
        return coordinator_pb2.RunStatusResponse(run_id=self.run_id)


def test_a_long_call_survives_the_clients_keepalive_pings() -> None:
    async def body() -> str:
        registry = SlowRegistry("run-1", verify=False)
        add = coordinator_pb2_grpc.add_CoordinatorServicer_to_server
        config = ServerConfig(min_ping_interval_s=0.5)
        server = ServiceServer(registry, config, [Service("flowgrpo.v1.Coordinator", registry, add)])
        address = await server.start()
        channel = open_channel(address, ClientConfig(keepalive_s=1.0))  # 6 pings in the call
        try:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            answer = await stub.RunStatus(coordinator_pb2.RunStatusRequest(), timeout=30)
            return str(answer.run_id)
        finally:
            await channel.close()
            await server.stop()

    assert asyncio.run(body()) == "run-1"
