"""The control plane tried as an attacker on the network would: real service processes, raw
grpcio clients that hold no credential (or the wrong one), and the registry asked to hand a live
replica's identity to another address. Each attack must fail while the service keeps serving."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flowgrpo import PROTOCOL_VERSION
from flowgrpo.runtime import ServerConfig, Service, ServiceServer
from flowgrpo.services.coordinator.registry import CoordinatorService
from flowgrpo.v1 import common_pb2, common_pb2_grpc, coordinator_pb2, coordinator_pb2_grpc, reward_pb2
from tests.services.launch import spawn_service, stop_service

CLI = [sys.executable, "-m", "flowgrpo.services.cli"]
TOKEN = "the-runs-token-" + "x" * 24
UNAUTH = grpc.StatusCode.UNAUTHENTICATED


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_reward(*overrides: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`flowgrpo serve reward` that must refuse to start (it would otherwise run until stopped)."""
    cmd = [*CLI, "serve", "reward", "log_format=text", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def without_credentials() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if not k.startswith(("FLOWGRPO_TOKEN", "FLOWGRPO_BUS_SECRET"))
    }


def test_a_service_reachable_from_the_network_refuses_to_start_without_a_credential(tmp_path: Path) -> None:
    done = serve_reward("server.host=0.0.0.0", f"server.port={free_port()}", env=without_credentials())
    assert done.returncode == 2
    [line] = [x for x in done.stderr.splitlines() if x.startswith("flowgrpo serve reward:")]
    assert "server.host=0.0.0.0 is reachable from the network but no credential is set" in line
    assert "FLOWGRPO_TOKEN" in line and "server.insecure=true" in line
    assert "Traceback" not in done.stderr


def test_insecure_is_explicit_and_loud_and_a_clear_text_token_is_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ready = tmp_path / "ready.json"
    for overrides, token, warning in (
        (["server.insecure=true"], "", "INSECURE: reward"),
        ([], TOKEN, "with a token but no TLS: the token travels in clear"),
    ):
        monkeypatch.setenv("FLOWGRPO_TOKEN", token)  # the handshake of spawn_service sends it
        args = ["server.host=0.0.0.0", f"server.port={free_port()}", "bus.insecure=true", *overrides]
        proc, _ = spawn_service("reward", args, ready, env={**without_credentials(), "FLOWGRPO_TOKEN": token})
        proc.terminate()  # drains; then its log is read
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0 and warning in stderr, stderr[-2000:]


@pytest.fixture(scope="module")
def reward_with_token(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = {**without_credentials(), "FLOWGRPO_TOKEN": TOKEN}
    ready = tmp_path_factory.mktemp("reward") / "ready.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLOWGRPO_TOKEN", TOKEN)  # this process's handshake and drain carry it
        proc, address = spawn_service("reward", [], ready, env=env)
        try:
            yield address
        finally:
            stop_service(proc)


async def raw_calls(address: str, token: str | None) -> dict[str, grpc.StatusCode]:
    """Each kind of call a raw client can make, with ``token`` (None: no metadata at all)."""
    metadata = None if token is None else (("authorization", f"Bearer {token}"),)
    codes = {}
    async with grpc.aio.insecure_channel(address) as channel:
        lifecycle = common_pb2_grpc.LifecycleStub(channel)
        calls = {
            "Handshake": lambda: lifecycle.Handshake(
                common_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION), timeout=10, metadata=metadata
            ),
        }
        if token != TOKEN:  # (the legitimate caller does not drain the service under test)
            calls["Drain"] = lambda: lifecycle.Drain(common_pb2.DrainRequest(), timeout=10, metadata=metadata)
        for name, call in calls.items():
            try:
                await call()
                codes[name] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as error:
                codes[name] = error.code()
        score = channel.stream_stream(
            "/flowgrpo.v1.Reward/Score",
            request_serializer=reward_pb2.ScoreRequest.SerializeToString,
            response_deserializer=reward_pb2.ScoreResult.FromString,
        )
        for i in range(50 if token != TOKEN else 0):  # streamed: refused every time, never INTERNAL
            requests = [reward_pb2.ScoreRequest(sample_id=f"s{i}/{k}") for k in range(3)]
            try:
                async for _ in score(iter(requests), timeout=10, metadata=metadata):
                    pass
                codes[f"Score#{i}"] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as error:
                codes[f"Score#{i}"] = error.code()
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        codes["Health"] = (
            grpc.StatusCode.OK if answer.status == answer.SERVING else grpc.StatusCode.UNAVAILABLE
        )
    return codes


@pytest.mark.parametrize("token", [None, "", "a-wrong-token"], ids=["no metadata", "empty", "wrong"])
def test_every_call_without_the_token_is_unauthenticated_streams_included(
    reward_with_token: str, token: str | None
) -> None:
    codes = asyncio.run(raw_calls(reward_with_token, token))
    assert codes.pop("Health") == grpc.StatusCode.OK  # probes need no credential
    assert set(codes.values()) == {UNAUTH}, {k: v for k, v in codes.items() if v != UNAUTH}
    # the service was not drained and still answers its callers
    ready = asyncio.run(raw_calls(reward_with_token, TOKEN))
    assert ready["Handshake"] == grpc.StatusCode.OK


# --- the registry -----------------------------------------------------------------------------


class Registry:
    def __init__(self) -> None:
        self.service = CoordinatorService("run-under-attack", heartbeat_interval_s=0.5, lost_after_s=5)
        add = coordinator_pb2_grpc.add_CoordinatorServicer_to_server
        self.server = ServiceServer(
            self.service, ServerConfig(port=0), [Service("flowgrpo.v1.Coordinator", self.service, add)]
        )


def replica_info(replica_id: str, address: str) -> common_pb2.ServiceInfo:
    return common_pb2.ServiceInfo(role="reward", replica_id=replica_id, grpc_address=address,
                                  protocol_version=PROTOCOL_VERSION)  # fmt: skip


async def register(address: str, info: common_pb2.ServiceInfo, token: str | None = TOKEN) -> grpc.StatusCode:
    metadata = None if token is None else (("authorization", f"Bearer {token}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            await stub.Register(coordinator_pb2.RegisterRequest(info=info), timeout=20, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


@pytest.mark.timeout(180)
def test_a_live_replicas_identity_cannot_be_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An impostor (with or without the credential) registering under the id of a live replica
    from another address gets nothing: the work and the weights still go to the real one."""
    monkeypatch.setenv("FLOWGRPO_TOKEN", TOKEN)

    async def attack() -> None:
        registry = Registry()
        coordinator = await registry.server.start()
        env = {**os.environ, "FLOWGRPO_TOKEN": TOKEN}
        proc, real = await asyncio.to_thread(spawn_service, "reward",
                                             [f"coordinator={coordinator}", "replica_id=reward-0"],
                                             tmp_path / "ready.json", env=env)  # fmt: skip
        try:
            for _ in range(200):
                if "reward-0" in registry.service.members:
                    break
                await asyncio.sleep(0.05)
            assert registry.service.members["reward-0"].info.grpc_address == real
            elsewhere = f"127.0.0.1:{free_port()}"  # nothing listens there
            assert await register(coordinator, replica_info("reward-0", elsewhere), token=None) == UNAUTH
            assert (
                await register(coordinator, replica_info("reward-0", elsewhere))
                == grpc.StatusCode.ALREADY_EXISTS
            )
            # a new id at an address that does not answer as that replica: never admitted
            assert (
                await register(coordinator, replica_info("reward-9", elsewhere))
                == grpc.StatusCode.INVALID_ARGUMENT
            )
            # nor the real replica's address under another id (it answers as reward-0)
            assert (
                await register(coordinator, replica_info("reward-7", real))
                == grpc.StatusCode.INVALID_ARGUMENT
            )
            members = registry.service.members
            assert set(members) == {"reward-0"} and members["reward-0"].info.grpc_address == real
            assert members["reward-0"].joins == 1
            # once the real one is gone (drained: it left), a new real replica takes its id
            await asyncio.to_thread(stop_service, proc)
            proc, again = await asyncio.to_thread(spawn_service, "reward",
                                                  [f"coordinator={coordinator}", "replica_id=reward-0"],
                                                  tmp_path / "ready.json", env=env)  # fmt: skip
            for _ in range(200):
                if members["reward-0"].joins == 2:
                    break
                await asyncio.sleep(0.05)
            assert members["reward-0"].joins == 2 and members["reward-0"].info.grpc_address == again
            await asyncio.to_thread(stop_service, proc)
        finally:
            if proc.poll() is None:
                proc.kill()
            registry.server.drain(0)
            await registry.server.wait_stopped()

    asyncio.run(attack())


# --- secrets at rest --------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_no_secret_reaches_the_run_folder(tmp_path: Path) -> None:
    """A local run with its token and bus secret in the environment (and, against advice, a token
    on the command line too): neither appears in any file of the run folder (config.yaml, the
    services' configs, logs, traces, TensorBoard, the report), and the folder is the user's only."""
    from flowgrpo.models.bagel.checkpoint import make_tiny_bagel

    tiny = make_tiny_bagel(tmp_path / "tiny", seed=0)
    bus_secret, typed = "bus-secret-" + "y" * 30, "typed-token-" + "z" * 30
    env = {**without_credentials(), "FLOWGRPO_TOKEN": TOKEN, "FLOWGRPO_BUS_SECRET": bus_secret}
    run = tmp_path / "run"
    recipe = Path(__file__).resolve().parents[2] / "examples" / "tiny_jpeg.yaml"
    cmd = [*CLI, "train", str(recipe), f"run_dir={run}", f"model.checkpoint={tiny}", "schedule.steps=2",
           "schedule.eval_every=0", f"server.token={typed}"]  # fmt: skip
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=280, env={**env, "FLOWGRPO_TOKEN": typed}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = subprocess.run([*CLI, "report", str(run)], capture_output=True, text=True, timeout=120, env=env)
    assert report.returncode == 0, report.stderr[-2000:]
    files = [p for p in run.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in files) and any(p.suffix == ".log" for p in files)
    for path in files:
        data = path.read_bytes()
        for secret in (TOKEN, bus_secret, typed):
            assert secret.encode() not in data, f"{secret[:12]}... in {path}"
    assert (run.stat().st_mode & 0o077) == 0  # checkpoints (the weights) are the user's only
