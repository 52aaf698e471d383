"""TLS, mutual TLS and the shared token, with certificates generated at run time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flowgrpo import PROTOCOL_VERSION
from flowgrpo.runtime import ClientConfig, HandshakeError, ServerConfig, TLSConfig, open_channel, wait_ready
from flowgrpo.runtime.security import TOKEN_ENV, channel_credentials, server_credentials
from flowgrpo.v1 import common_pb2, common_pb2_grpc, reward_pb2, reward_pb2_grpc

from .certs import Certs, make_certs
from .probe import ProbeActor, running

HANDSHAKE = common_pb2.HandshakeRequest(client_role="test", protocol_version=PROTOCOL_VERSION)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


async def _handshake(address: str, config: ClientConfig) -> grpc.StatusCode:
    """The status of one handshake over a channel made with ``config``."""
    code, _ = await _handshake_details(address, config)
    return code


async def _handshake_details(address: str, config: ClientConfig) -> tuple[grpc.StatusCode, str]:
    async with open_channel(address, config) as channel:
        try:
            await common_pb2_grpc.LifecycleStub(channel).Handshake(HANDSHAKE, timeout=3)
        except grpc.aio.AioRpcError as error:
            return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def test_tls_client_verifies_the_server_with_the_ca(certs: Certs) -> None:
    server_tls = TLSConfig(cert=certs.server.cert, key=certs.server.key)

    async def body() -> None:
        async with running(ProbeActor(), ServerConfig(tls=server_tls)) as server:
            trusting = ClientConfig(tls=TLSConfig(ca=certs.ca))
            info = await wait_ready(server.address, role="coordinator", timeout_s=5, config=trusting)
            assert info.grpc_address == server.address
            code, details = await _handshake_details(
                server.address, ClientConfig(tls=TLSConfig(ca=certs.other_ca))
            )
            assert code == grpc.StatusCode.UNAVAILABLE and "CERTIFICATE_VERIFY_FAILED" in details
            assert (
                await _handshake(server.address, ClientConfig()) == grpc.StatusCode.UNAVAILABLE
            )  # plaintext

    asyncio.run(body())


def test_mutual_tls_refuses_clients_without_a_certificate_of_the_ca(certs: Certs) -> None:
    server_tls = TLSConfig(
        cert=certs.server.cert, key=certs.server.key, ca=certs.ca, require_client_cert=True
    )

    async def body() -> None:
        async with running(ProbeActor(), ServerConfig(tls=server_tls)) as server:
            with_cert = TLSConfig(ca=certs.ca, cert=certs.client.cert, key=certs.client.key)
            impostor = TLSConfig(ca=certs.ca, cert=certs.other_client.cert, key=certs.other_client.key)
            assert await _handshake(server.address, ClientConfig(tls=with_cert)) == grpc.StatusCode.OK
            assert await _handshake(server.address, ClientConfig(tls=TLSConfig(ca=certs.ca))) == (
                grpc.StatusCode.UNAVAILABLE
            )
            assert await _handshake(server.address, ClientConfig(tls=impostor)) == grpc.StatusCode.UNAVAILABLE

    asyncio.run(body())


def test_token_is_required_except_for_health(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)

    async def body() -> None:
        async with running(ProbeActor(), ServerConfig(token="s3cret")) as server:
            address = server.address
            assert await _handshake(address, ClientConfig(token="s3cret")) == grpc.StatusCode.OK
            assert await _handshake(address, ClientConfig(token="guess")) == grpc.StatusCode.UNAUTHENTICATED
            assert await _handshake(address, ClientConfig()) == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(HandshakeError, match="UNAUTHENTICATED: missing or wrong token"):
                await wait_ready(
                    address, role="coordinator", timeout_s=10, config=ClientConfig(token="guess")
                )
            async with grpc.aio.insecure_channel(address) as bare:  # a container probe: no token
                probe = await health_pb2_grpc.HealthStub(bare).Check(health_pb2.HealthCheckRequest())
            assert probe.status == health_pb2.HealthCheckResponse.SERVING
            monkeypatch.setenv(TOKEN_ENV, "s3cret")
            assert await _handshake(address, ClientConfig()) == grpc.StatusCode.OK

    asyncio.run(body())


def test_the_token_and_the_default_deadline_go_with_streamed_calls_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """grpc.aio files an interceptor under the first call kind it implements: the token once
    reached only unary calls, and the streamed Score of a deployment with a token failed."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)

    async def feed() -> AsyncIterator[reward_pb2.ScoreRequest]:
        yield reward_pb2.ScoreRequest(sample_id="a", prompt="four")

    async def body() -> None:
        async with running(ProbeActor(), ServerConfig(token="s3cret")) as server:
            async with open_channel(server.address, ClientConfig(token="s3cret")) as channel:
                results = [
                    r async for r in reward_pb2_grpc.RewardStub(channel).Score(feed())
                ]  # no timeout given
            assert [(r.sample_id, r.reward) for r in results] == [("a", 4.0)]

    asyncio.run(body())


def test_tls_config_mistakes_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"require_client_cert needs tls\.ca"):
        server_credentials(TLSConfig(cert="c.pem", key="k.pem", require_client_cert=True))
    with pytest.raises(ValueError, match=r"cannot read .*missing\.pem"):
        server_credentials(TLSConfig(cert=str(tmp_path / "missing.pem"), key=str(tmp_path / "missing.pem")))
    with pytest.raises(ValueError, match=r"set tls\.ca"):
        channel_credentials(TLSConfig(cert="c.pem", key="k.pem"))
