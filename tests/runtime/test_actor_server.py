"""An actor behind a ServiceServer, in process: health, handshake, deadlines, one message at a time,
typed errors, streams, and the Drain RPC."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flowgrpo import PROTOCOL_VERSION
from flowgrpo.config_digest import digest
from flowgrpo.runtime import ServerConfig, ServiceServer, open_channel, wait_ready
from flowgrpo.runtime.startup import describe_startup, starting_phase
from flowgrpo.v1 import (
    common_pb2,
    common_pb2_grpc,
    coordinator_pb2,
    coordinator_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
)

from .probe import ProbeActor, heartbeat, running, services, until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def health(channel: grpc.aio.Channel, service: str = "") -> int:
    """A probe as a container runtime sends it: no deadline, no token."""
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    return int(response.status)


def handshake_request(protocol: str = PROTOCOL_VERSION) -> common_pb2.HandshakeRequest:
    return common_pb2.HandshakeRequest(client_role="test", protocol_version=protocol)


async def rpc_error(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    """The error a call fails with; fails the test when the call succeeds."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def test_not_ready_while_starting_then_serving() -> None:
    async def body() -> None:
        actor = ProbeActor(start_delay_s=1.0)
        actor.settings = {"probe.mode": '"fast"', "probe.eps": "1e-05"}  # what it took from its recipe
        server = ServiceServer(actor, ServerConfig(), services(actor))
        starting = asyncio.create_task(server.start())
        await until(lambda: bool(server.address), "the server to bind")
        async with grpc.aio.insecure_channel(server.address) as channel:
            assert await health(channel) == NOT_SERVING
            assert await health(channel, "flowgrpo.v1.Coordinator") == NOT_SERVING
            lifecycle = common_pb2_grpc.LifecycleStub(channel)
            refused = await rpc_error(lifecycle.Handshake(handshake_request(), timeout=2))
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            assert "not ready" in refused.details() and "starting" in refused.details()
            said: list[str] = []  # what the replica says while it starts: the phase that runs
            info = await wait_ready(server.address, role="coordinator", timeout_s=5, on_not_ready=said.append)
            await starting
            assert await health(channel) == SERVING
            assert await health(channel, "flowgrpo.v1.Coordinator") == SERVING
            assert await health(channel, "flowgrpo.v1.Reward") == SERVING
        assert (info.role, info.replica_id, info.grpc_address) == ("coordinator", "probe-0", server.address)
        assert (
            info.protocol_version == PROTOCOL_VERSION
            and info.policy_version == -1
            and info.pid == os.getpid()
        )
        assert dict(info.settings) == actor.settings and info.settings_digest == digest(actor.settings)
        assert starting_phase(refused.details()) == ("probe-0", "model for 0 s")
        assert said and all(starting_phase(s) is not None for s in said)
        assert [(p.name, p.detail) for p in info.startup] == [("imports", ""), ("model", "probe weights")]
        imports, model = info.startup
        assert 1.0 <= model.seconds < 5 and 0 < imports.seconds <= info.startup_s  # this process's age
        assert info.startup_s >= imports.seconds + model.seconds - 0.02  # 10 ms ticks on both readings
        assert describe_startup(info).startswith(f"probe-0 ready in {info.startup_s:.1f} s: imports ")
        await server.stop()

    asyncio.run(body())


def test_protocol_mismatch_is_refused_naming_both_versions() -> None:
    async def body() -> None:
        async with running(ProbeActor()) as server, open_channel(server.address) as channel:
            lifecycle = common_pb2_grpc.LifecycleStub(channel)
            refused = await rpc_error(lifecycle.Handshake(handshake_request("flowgrpo.v0")))
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "protocol mismatch" in refused.details()
        assert "'flowgrpo.v0'" in refused.details() and f"'{PROTOCOL_VERSION}'" in refused.details()

    asyncio.run(body())


def test_a_call_without_deadline_is_refused_but_health_needs_none() -> None:
    async def body() -> None:
        async with running(ProbeActor()) as server, grpc.aio.insecure_channel(server.address) as raw:
            stub = coordinator_pb2_grpc.CoordinatorStub(raw)
            refused = await rpc_error(stub.Heartbeat(heartbeat("ok")))
            assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "without a deadline" in refused.details() and "Heartbeat" in refused.details()
            assert await health(raw) == SERVING
            assert (await stub.Heartbeat(heartbeat("ok"), timeout=5)).known
            assert server.actor.in_flight == 0

    asyncio.run(body())


async def garbage(
    channel: grpc.aio.Channel, method: str, payload: bytes, **kwargs: object
) -> grpc.aio.AioRpcError:
    """The error of a unary call whose request is ``payload`` as it is, not a serialized message."""
    identity = lambda b: b  # noqa: E731
    return await rpc_error(channel.unary_unary(method, identity, identity)(payload, **kwargs))


def test_a_request_that_does_not_parse_is_refused_in_one_line_and_logged_once_an_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """grpc's own answer was UNKNOWN with a traceback logged for every such request."""

    async def body() -> None:
        async with running(ProbeActor()) as server, grpc.aio.insecure_channel(server.address) as raw:
            for i in range(40):
                refused = await garbage(
                    raw, "/flowgrpo.v1.Coordinator/Heartbeat", b"\xff" * (i + 1), timeout=5
                )
                assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
                details = refused.details()
                assert "/flowgrpo.v1.Coordinator/Heartbeat: the request does not parse" in details
                assert "flowgrpo.v1.HeartbeatRequest" in details and "\n" not in details
            probe = await garbage(raw, "/grpc.health.v1.Health/Check", b"\x0a\x05ab")  # no deadline: a probe
            assert (
                probe.code() == grpc.StatusCode.INVALID_ARGUMENT and "HealthCheckRequest" in probe.details()
            )
            # the deadline rule still comes first, and a sound request is answered as before
            undated = await garbage(raw, "/flowgrpo.v1.Coordinator/Heartbeat", b"\xff")
            assert "without a deadline" in undated.details()
            assert (
                await coordinator_pb2_grpc.CoordinatorStub(raw).Heartbeat(heartbeat("ok"), timeout=5)
            ).known
            assert await health(raw) == SERVING and server.actor.in_flight == 0

    with caplog.at_level(logging.INFO):
        asyncio.run(body())
    refusals = [r for r in caplog.records if "does not parse" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.WARNING  # 42 refused within 10 s
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_a_stranger_s_unparsable_request_is_refused_for_its_token_first() -> None:
    async def body() -> None:
        async with (
            running(ProbeActor(), ServerConfig(token="s3cret")) as server,
            grpc.aio.insecure_channel(server.address) as raw,
        ):
            refused = await garbage(raw, "/flowgrpo.v1.Lifecycle/Handshake", b"\xff\xff", timeout=5)
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED and "parse" not in refused.details()

    asyncio.run(body())


def test_open_channel_gives_calls_a_default_deadline() -> None:
    async def body() -> None:
        async with running(ProbeActor()) as server, open_channel(server.address) as channel:
            response = await coordinator_pb2_grpc.CoordinatorStub(channel).Heartbeat(heartbeat("ok"))
        assert response.known

    asyncio.run(body())


def test_messages_run_one_at_a_time_in_arrival_order_while_health_answers() -> None:
    async def body() -> None:
        actor = ProbeActor()
        async with running(actor) as server, open_channel(server.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            calls = []
            for seq in range(4):  # each sent once the previous one is queued: the arrival order is known
                calls.append(asyncio.ensure_future(stub.Heartbeat(heartbeat("sleep 0.3", seq))))
                await until(lambda: actor.in_flight == len(calls), f"{len(calls)} in flight")
            assert await health(channel) == SERVING  # the loop answers while the thread computes ...
            info = await wait_ready(server.address, role="coordinator", timeout_s=2, channel=channel)
            assert actor.in_flight > 0  # ... and before the queued messages are done
            assert all(response.known for response in await asyncio.gather(*calls))
            status = await stub.RunStatus(coordinator_pb2.RunStatusRequest())
        assert info.replica_id == "probe-0"
        assert status.run_id == "0,1,2,3"
        assert status.step == 1  # never more than one message inside the actor

    asyncio.run(body())


def test_a_failing_message_returns_a_typed_error_and_the_server_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body() -> None:
        async with running(ProbeActor()) as server, open_channel(server.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            internal = await rpc_error(stub.Heartbeat(heartbeat("fail")))
            invalid = await rpc_error(stub.Heartbeat(heartbeat("invalid")))
            assert (await stub.Heartbeat(heartbeat("ok"))).known
        assert internal.code() == grpc.StatusCode.INTERNAL
        assert "coordinator probe-0" in internal.details()
        assert "RuntimeError: probe failure" in internal.details()
        assert invalid.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert invalid.details() == "coordinator probe-0: probe refuses this request"

    with caplog.at_level(logging.ERROR, logger="flowgrpo.runtime.server"):
        asyncio.run(body())
    [record] = [r for r in caplog.records if r.exc_info]
    assert "Heartbeat failed" in record.getMessage() and "probe failure" in caplog.text


def test_a_base_exception_is_answered_at_once_not_left_to_the_deadline() -> None:
    """A library error that derives from BaseException (DCP's CheckpointException does) once
    passed the error boundary, which caught Exception, and left the call unanswered."""

    async def body() -> None:
        async with running(ProbeActor()) as server, open_channel(server.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            started = time.perf_counter()
            failed = await rpc_error(stub.Heartbeat(heartbeat("fail-base"), timeout=30))
            waited = time.perf_counter() - started
            assert (await stub.Heartbeat(heartbeat("ok"))).known  # and it keeps serving
        assert failed.code() == grpc.StatusCode.INTERNAL, failed.details()
        assert "ProbeBaseError: a library's BaseException" in failed.details()
        assert waited < 5, f"{waited:.1f} s"

    asyncio.run(body())


def test_a_stream_runs_each_item_as_a_message_and_fails_typed_mid_stream() -> None:
    async def body() -> None:
        async with running(ProbeActor()) as server, open_channel(server.address) as channel:
            prompts = ["a cat", "a red dog", "bad"]
            requests = [reward_pb2.ScoreRequest(sample_id=f"p0/{i}", prompt=p) for i, p in enumerate(prompts)]
            call = reward_pb2_grpc.RewardStub(channel).Score(iter(requests), timeout=5)
            results = []
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for result in call:
                    results.append((result.sample_id, result.reward))
        assert results == [("p0/0", 5.0), ("p0/1", 9.0)]
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sample p0/2" in caught.value.details()

    asyncio.run(body())


def test_drain_rpc_finishes_the_message_in_flight_then_stops() -> None:
    async def body() -> None:
        actor = ProbeActor()
        server = ServiceServer(actor, ServerConfig(), services(actor))
        await server.start()
        async with open_channel(server.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            in_flight = asyncio.ensure_future(stub.Heartbeat(heartbeat("sleep 0.5", 1)))
            await until(lambda: actor.running == 1, "the message to begin")
            drained = await common_pb2_grpc.LifecycleStub(channel).Drain(common_pb2.DrainRequest(grace_s=5))
            assert drained.in_flight == 1
            assert await health(channel) == NOT_SERVING
            refused = await rpc_error(stub.Heartbeat(heartbeat("ok", 2)))
            not_ready = await rpc_error(common_pb2_grpc.LifecycleStub(channel).Handshake(handshake_request()))
            assert (await in_flight).known
        await asyncio.wait_for(server.wait_stopped(), 5)
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining: send it to another replica" in refused.details()
        assert not_ready.code() == grpc.StatusCode.UNAVAILABLE
        assert actor.order == [1] and actor.stopped

    asyncio.run(body())
