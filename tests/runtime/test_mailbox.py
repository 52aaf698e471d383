"""The mailbox's promises: a started message runs to completion, a message whose caller gave up
before its turn is skipped, and a message cannot wait on its own mailbox."""

from __future__ import annotations

import asyncio

import pytest

from flowgrpo.runtime.errors import Unavailable
from flowgrpo.runtime.mailbox import Mailbox


def test_a_message_runs_to_completion_even_when_its_caller_gives_up() -> None:
    ran: list[str] = []

    async def slow() -> None:
        await asyncio.sleep(0.2)
        ran.append("slow")

    async def skipped() -> None:
        ran.append("skipped")

    async def body() -> None:
        mailbox = Mailbox("test")
        mailbox.open()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(mailbox.post(slow), 0.05)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(mailbox.post(skipped), 0.05)  # still queued behind slow
        assert await mailbox.wait_idle(2.0)
        await mailbox.cancel("test over")

    asyncio.run(body())
    assert ran == ["slow"]


def test_posting_to_its_own_mailbox_from_a_message_is_an_error() -> None:
    async def body() -> None:
        mailbox = Mailbox("test")
        mailbox.open()

        async def inner() -> None:
            pass

        async def outer() -> None:
            await mailbox.post(inner)

        with pytest.raises(RuntimeError, match="would wait forever"):
            await mailbox.post(outer)
        await mailbox.cancel("test over")

    asyncio.run(body())


def test_closed_mailbox_refuses_with_the_reason() -> None:
    async def body() -> None:
        mailbox = Mailbox("test")

        async def noop() -> None:
            pass

        with pytest.raises(Unavailable, match="starting"):
            await mailbox.post(noop)
        mailbox.open()
        await mailbox.post(noop)
        assert mailbox.close() == 0
        with pytest.raises(Unavailable, match="draining: send it to another replica"):
            await mailbox.post(noop)
        await mailbox.cancel("test over")

    asyncio.run(body())
