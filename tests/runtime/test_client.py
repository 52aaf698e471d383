"""wait_ready: start-up never waits without a deadline, and a failed wait names what it waited for."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from flowgrpo.runtime import HandshakeError, NotReadyError, wait_ready

from .probe import ProbeActor, running


def _unused_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_wait_ready_where_nothing_listens_fails_in_time_naming_address_and_role() -> None:
    address = _unused_address()
    began = time.monotonic()
    with pytest.raises(NotReadyError) as caught:
        asyncio.run(wait_ready(address, role="reward", timeout_s=1.0))
    waited_s = time.monotonic() - began
    assert 1.0 <= waited_s < 2.5
    message = str(caught.value)
    assert f"reward at {address}" in message and "within 1s" in message and "READY handshake" in message


def test_wait_ready_refuses_a_service_of_another_role_at_once() -> None:
    async def body() -> None:
        async with running(ProbeActor()) as server:
            began = time.monotonic()
            with pytest.raises(HandshakeError) as caught:
                await wait_ready(server.address, role="trainer", timeout_s=10)
            assert time.monotonic() - began < 2
            assert (
                str(caught.value)
                == f"{server.address} is a coordinator (probe-0), not the trainer expected there"
            )

    asyncio.run(body())
