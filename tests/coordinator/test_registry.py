"""The coordinator's registry over real gRPC, with a real ``flowgrpo serve reward`` process:
it registers, beats, is declared lost when frozen (SIGSTOP), registers again when it thaws
(SIGCONT), and leaves when it drains (SIGTERM); RunStatus reports each state. Bad registrations
(another version, another recipe's settings) are refused with what was wrong."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from flowgrpo.config import dump_yaml
from flowgrpo.config_digest import digest
from flowgrpo.configs.reward import RewardServiceConfig
from flowgrpo.rewards.config import RewardConfig, ScorerSpec
from flowgrpo.runtime import Service, ServiceServer, open_channel
from flowgrpo.runtime.config import ServerConfig
from flowgrpo.services.coordinator.registry import CoordinatorService
from flowgrpo.services.coordinator.status import live_status
from flowgrpo.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

CLI = [sys.executable, "-m", "flowgrpo.services.cli"]  # the flowgrpo command of this interpreter

ROOT = Path(__file__).resolve().parents[2]
BEAT_S, LOST_S = 0.2, 1.5


def serve_registry(registry: CoordinatorService) -> ServiceServer:
    add = coordinator_pb2_grpc.add_CoordinatorServicer_to_server
    return ServiceServer(registry, ServerConfig(), [Service("flowgrpo.v1.Coordinator", registry, add)])


async def until(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.05)


def spawn_reward(tmp_path: Path, coordinator: str) -> subprocess.Popen[bytes]:
    config = RewardServiceConfig(
        replica_id="reward-a",
        coordinator=coordinator,
        log_format="text",
        reward=RewardConfig(scorers=[ScorerSpec(name="jpeg_compressibility")]),
    )
    dump_yaml(config, tmp_path / "reward.yaml")
    log = (tmp_path / "reward.log").open("wb")
    return subprocess.Popen(
        [*CLI, "serve", "reward", "--config", str(tmp_path / "reward.yaml")],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip


def probe(address: str, service: str = "") -> subprocess.CompletedProcess[str]:
    cmd = [*CLI, "probe", address, "--timeout", "10"]
    return subprocess.run([*cmd, "--service", service] if service else cmd, capture_output=True, text=True)


def test_probe_of_nothing_fails_and_says_so() -> None:
    done = subprocess.run([*CLI, "probe", "127.0.0.1:1", "--timeout", "1"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1 and "127.0.0.1:1: no answer within 1 s" in done.stderr


def test_a_replica_registers_is_lost_when_frozen_rejoins_and_leaves(tmp_path: Path) -> None:
    async def body() -> None:
        registry = CoordinatorService("run-1", heartbeat_interval_s=BEAT_S, lost_after_s=LOST_S)
        server = serve_registry(registry)
        address = await server.start()
        proc = spawn_reward(tmp_path, address)
        events: list[str] = []

        def state() -> str:
            while not registry.events.empty():
                event = registry.events.get_nowait()
                events.append(event.kind)
            member = registry.members.get("reward-a")
            return member.state if member else "absent"

        try:
            await until("registered", lambda: state() == "up")
            # `flowgrpo probe` (container health checks) against the coordinator and the replica
            reward_address = registry.members["reward-a"].info.grpc_address
            for target, service, code, shown in [
                (address, "", 0, "SERVING"),
                (reward_address, "flowgrpo.v1.Reward", 0, "SERVING"),
                (address, "flowgrpo.v1.Nope", 1, "SERVICE_UNKNOWN"),
            ]:
                done = await asyncio.to_thread(probe, target, service)
                assert done.returncode == code and shown in done.stdout, (target, service, done.stderr)
            member = registry.members["reward-a"]
            assert member.info.role == "reward" and member.info.grpc_address and member.joins == 1
            beat = member.last_seen
            await until("a heartbeat", lambda: registry.members["reward-a"].last_seen > beat)

            os.kill(proc.pid, signal.SIGSTOP)  # alive but silent: no heartbeat
            stopped = time.monotonic()
            await until("declared lost", lambda: state() == "lost", timeout_s=10)
            assert time.monotonic() - stopped >= LOST_S * 0.8
            text = await asyncio.to_thread(live_status, address)
            assert "reward-a" in text and " lost " in text

            os.kill(proc.pid, signal.SIGCONT)  # its next heartbeat is refused: it registers again
            await until("registered again", lambda: state() == "up", timeout_s=10)
            assert registry.members["reward-a"].joins == 2

            proc.send_signal(signal.SIGTERM)  # the drain says goodbye first
            await until("left", lambda: state() == "left", timeout_s=30)
            assert await asyncio.to_thread(proc.wait, 30) == 0
            assert events == ["joined", "lost", "joined", "left"]
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()
            await server.stop(0)

    asyncio.run(body())


@pytest.mark.parametrize(
    ("info", "message"),
    [
        (common_pb2.ServiceInfo(role="rollout", replica_id="r", grpc_address="h:1", protocol_version="v0"),
         "speaks 'v0'"),
        (common_pb2.ServiceInfo(role="judge", replica_id="j", grpc_address="h:1"), "a role in"),
        (common_pb2.ServiceInfo(role="reward", replica_id="", grpc_address="h:1"), "a replica_id"),
        (common_pb2.ServiceInfo(role="reward", replica_id="rollout-0", grpc_address="h:2"),
         "already a rollout"),
    ],
)  # fmt: skip
def test_a_bad_registration_is_refused_with_what_was_wrong(
    info: common_pb2.ServiceInfo, message: str
) -> None:
    from flowgrpo import PROTOCOL_VERSION

    if not info.protocol_version:
        info.protocol_version = PROTOCOL_VERSION

    async def body() -> None:
        registry = CoordinatorService("run-1")
        server = serve_registry(registry)
        address = await server.start()
        registry.join(common_pb2.ServiceInfo(role="rollout", replica_id="rollout-0", grpc_address="h:1",
                                             protocol_version=PROTOCOL_VERSION))  # fmt: skip
        channel = open_channel(address)
        try:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Register(coordinator_pb2.RegisterRequest(info=info), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in (caught.value.details() or "")
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(body())


def _trainer(replica_id: str, settings: dict[str, str] | None) -> common_pb2.ServiceInfo:
    from flowgrpo import PROTOCOL_VERSION

    info = common_pb2.ServiceInfo(role="trainer", replica_id=replica_id, grpc_address="h:1",
                                  protocol_version=PROTOCOL_VERSION, software_version="0.9")  # fmt: skip
    if settings is not None:  # None: older software, which sends no settings
        info.settings.update(settings)
        info.settings_digest = digest(settings)
    return info


def test_a_registrant_of_another_recipe_gets_no_slot_and_the_reason_is_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Refused with INVALID_ARGUMENT naming the first differing setting (the replica says it in its
    log and tries again), said once in the coordinator's log however often it tries, kept for the
    run's own messages until the replica registers with the run's settings."""
    want = {"trainer.algorithm.name": '"flow_grpo"', "trainer.loss.clip_eps": "0.01"}
    other = {**want, "trainer.loss.clip_eps": "0.0001"}
    said = (
        "trainer trainer-0 at h:1 was started with trainer.loss.clip_eps=0.0001, the run's recipe has "
        "0.01: start it with the run's recipe (the only differing setting)"
    )

    async def register(stub: coordinator_pb2_grpc.CoordinatorStub, info: common_pb2.ServiceInfo) -> str:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Register(coordinator_pb2.RegisterRequest(info=info), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        where, _, why = (caught.value.details() or "").partition(": ")
        assert where == "coordinator coordinator"  # the server names who refused
        return why

    async def body() -> None:
        registry = CoordinatorService("run-1", verify=False, settings={"trainer": want})
        server = serve_registry(registry)
        channel = open_channel(await server.start())
        try:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            with caplog.at_level(logging.WARNING, logger="flowgrpo.services.coordinator.registry"):
                assert [await register(stub, _trainer("trainer-0", other)) for _ in range(3)] == [said] * 3
            assert [r.getMessage() for r in caplog.records] == [f"refused a registration: {said}"]
            no_digest = await register(stub, _trainer("trainer-old", None))
            assert no_digest.startswith("trainer trainer-old at h:1 sent no settings digest")
            assert not registry.members and registry.events.empty()  # no slot, no event for the run
            assert registry.refusals("trainer") == [said, no_digest] and registry.refusals("rollout") == []

            # started again with the run's recipe: it is taken, and its refusal forgotten
            await stub.Register(coordinator_pb2.RegisterRequest(info=_trainer("trainer-0", want)), timeout=10)
            assert registry.members["trainer-0"].state == "up"
            assert registry.refusals("trainer") == [no_digest]
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(body())
