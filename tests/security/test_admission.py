"""Admission before work: a real reward service (its own process, loopback, with a token) under a
flood of 500 unauthenticated streams on 10 connections and 200 idle HTTP/2 connections
(slowloris), plus a 200 MiB unauthenticated call and a 5,000-message unauthenticated stream, all
from raw clients in processes of their own, while a legitimate caller with the token measures
every call it makes, to it and, in the same seconds, to an identical service nobody attacks."""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flowgrpo import PROTOCOL_VERSION
from flowgrpo.runtime import ServerConfig, Service, ServiceServer
from flowgrpo.services.coordinator.registry import CoordinatorService
from flowgrpo.v1 import common_pb2, common_pb2_grpc, coordinator_pb2_grpc, reward_pb2_grpc
from tests.security.flood import SCORE, Legitimate, legitimate, trickle
from tests.services.launch import spawn_service, stop_service

TOKEN = "the-runs-token-" + "a" * 24
ATTACK_S = 12.0
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def rewards(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Two reward services alike: the one attacked, and a control that only the legitimate caller
    calls, which feels the machine's load (the attackers' CPU included) and not the attack."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWGRPO_TOKEN", "FLOWGRPO_BUS_SECRET"))}
    env["FLOWGRPO_TOKEN"] = TOKEN
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLOWGRPO_TOKEN", TOKEN)  # this process's handshake and drain carry it
        # idle and half-open connections closed within the attack (defaults: 300 s and 10 s)
        limits = ["server.host=127.0.0.1", "server.idle_connection_s=4", "server.handshake_timeout_s=3"]
        with ThreadPoolExecutor(2) as pool:
            spawns = [pool.submit(spawn_service, "reward", limits, tmp_path / f"{name}.json", env=env)
                      for name in ("attacked", "control")]  # fmt: skip
        started = [spawn.result() for spawn in spawns if spawn.exception() is None]
        try:
            assert len(started) == 2, [spawn.exception() for spawn in spawns]
            yield started[0][1], started[1][1]
        finally:
            for proc, _ in started:
                stop_service(proc)


def attacker(*args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tests.security.flood", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def report(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-3000:]
    result: dict[str, object] = json.loads(out)
    return result


@pytest.mark.timeout(150)
def test_legitimate_calls_are_answered_under_a_flood_and_a_slowloris(rewards: tuple[str, str]) -> None:
    reward, control = rewards
    attackers = [attacker("flood", reward, str(ATTACK_S)), attacker("oversized", reward, "3")]
    try:

        async def measure() -> list[Legitimate]:
            await asyncio.sleep(3.0)  # the flood and the idle connections are up
            # 2 callers each: the 4 of one service before the control came, so no more load than then
            calls = (legitimate(a, TOKEN, ATTACK_S - 5.0, workers=2) for a in (reward, control))
            return await asyncio.gather(*calls)

        legit, calm = asyncio.run(measure())
        flood, oversized = (report(a) for a in attackers)
    finally:
        for proc in attackers:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    p99, mean = legit.p99(), statistics.fmean(legit.latencies_s or [math.inf])
    calm_mean = statistics.fmean(calm.latencies_s or [math.inf])
    figures = (f"legit {legit.codes} mean {mean:.3f}s p99 {p99:.3f}s max {max(legit.latencies_s):.3f}s "
               f"{legit.failures[:3]}; control {calm.codes} mean {calm_mean:.3f}s p99 {calm.p99():.3f}s "
               f"{calm.failures[:3]}; flood {flood}; oversized {oversized}")  # fmt: skip
    print(figures)
    for measured in (legit, calm):
        assert set(measured.codes) == {"OK"} and sum(measured.codes.values()) >= 20, figures
    # relative to the control, called by the same client in the same seconds: the machine's load
    # (the attackers' CPU included) slows both alike, and only one gets the attack's calls. Measured
    # on the loaded 2-core machine (load 6 to 12, where an absolute bound was load's to decide), in
    # 30 runs: the attacked mean 0.5 to 2.4 times the control's; its p99 0.1 to 0.45 s, the
    # control's 0.08 to 0.32 s. A refusal that blocks the event loop 3 ms made the mean 6.4 to 7
    # times the control's and the p99 up to 1.36 s (1 ms: a mean 3 to 4.2 times). The tail has
    # 0.5 s more: the p99 of ~350 calls is the 4th slowest, and stalls of 0.1 to 0.7 s hit either.
    assert mean < 4 * calm_mean, figures
    assert p99 < 4 * calm.p99() + 0.5, figures
    streams: dict[str, int] = flood["streams"]  # type: ignore[assignment]
    # every stream is answered UNAUTHENTICATED; one whose caller was still writing when the answer
    # came may read INTERNAL with the client's own failed send in its details: grpc-python's client
    # overwrites the status it got with its own failed write (docs/security.md, "Admission"). The
    # trickling streams always write; those of 3 messages did so in 69 of 3,908 streams on CI
    assert streams.get("three UNAUTHENTICATED", 0) >= 250, figures
    own_write = "INTERNAL (own write)"
    assert streams.get("three UNAUTHENTICATED", 0) > 10 * streams.get(f"three {own_write}", 0), figures
    kinds = {f"{stream} {code}" for stream in ("three", "trickle") for code in ("UNAUTHENTICATED", own_write)}
    assert set(streams) <= kinds, figures
    assert (oversized["big_call"], oversized["long_stream"]) == ("UNAUTHENTICATED",) * 2, figures
    assert flood["slowloris_opened"] == 200 and flood["slowloris_closed_by_server"] == 200, figures


def test_refused_streams_take_no_slot_of_server_concurrency() -> None:
    """With ``server.concurrency=1``, 20 refused streams that never half-close (held up to 2 s
    each, drained or waiting) leave the one slot to the caller with the token; health needs no
    token."""

    async def body() -> None:
        registry = CoordinatorService("run-admission", heartbeat_interval_s=0.5, lost_after_s=5)
        add = coordinator_pb2_grpc.add_CoordinatorServicer_to_server
        # the Reward service's stubs: what is refused never reaches them
        stubs = reward_pb2_grpc.RewardServicer()  # type: ignore[abstract]
        reward = Service("flowgrpo.v1.Reward", stubs,
                         reward_pb2_grpc.add_RewardServicer_to_server)  # fmt: skip
        server = ServiceServer(registry, ServerConfig(port=0, concurrency=1, token=TOKEN),
                               [Service("flowgrpo.v1.Coordinator", registry, add), reward])  # fmt: skip
        address = await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                score = channel.stream_stream(SCORE, request_serializer=lambda m: m.SerializeToString())
                refused = [score(trickle(i), timeout=10) for i in range(20)]
                await asyncio.sleep(0.3)  # the refused streams are being drained
                lifecycle = common_pb2_grpc.LifecycleStub(channel)
                request = common_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION)
                for _ in range(5):
                    await lifecycle.Handshake(
                        request, timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),)
                    )
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                codes = []
                for call in refused:
                    try:
                        async for _ in call:
                            pass
                    except grpc.aio.AioRpcError as error:
                        codes.append(error.code())
                assert set(codes) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL}
                assert grpc.StatusCode.UNAUTHENTICATED in codes and len(codes) == 20
        finally:
            server.drain(0)
            await server.wait_stopped()

    asyncio.run(body())
