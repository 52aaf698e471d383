"""The two queues behind an actor: a mailbox that runs its messages one at a time in arrival
order, and a worker thread that runs its blocking compute off the event loop.

A message, once started, runs to completion unless its code says where it may stop: a caller
that gives up (deadline, cancel) abandons the reply and marks the message abandoned, and compute
that calls :func:`raise_if_abandoned` at its safe points (between denoising steps, between
micro-batches before any update) ends there with :class:`Abandoned`, so a replica is free again
within one such step instead of computing an answer nobody waits for. Code that never calls it
runs to the end, so the actor's state is never left half-updated. A drain that runs out of grace
cancels a running message. A message whose caller gave up before its turn is skipped.
Messages run in the caller's context (a copy), so the trace span of the RPC that sent a message
is the parent of the spans the message opens.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from flowgrpo.runtime.errors import Abandoned, Unavailable

T = TypeVar("T")

NOT_STARTED = "not ready: the service is starting; retry, or wait for its READY handshake"
DRAINING = "draining: send it to another replica"

# The mailbox whose message is running in this context: posting to it again would wait forever.
_RUNNING_IN: contextvars.ContextVar[Mailbox | None] = contextvars.ContextVar("mailbox", default=None)
# Set when the caller of the message running in this context gave up (read from any thread).
_ABANDONED: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("abandoned", default=None)


def raise_if_abandoned() -> None:
    """Raise :class:`Abandoned` when the caller of the message this code runs for has given up.
    Call it only where stopping leaves the actor's state as it was (nothing half-applied). Cheap
    (an event lookup) and callable from the worker thread; outside a message it does nothing."""
    abandoned = _ABANDONED.get()
    if abandoned is not None and abandoned.is_set():
        raise Abandoned("the caller gave up (deadline or cancel); stopped at the next safe point")


@dataclass
class _Letter:
    handler: Callable[[], Coroutine[Any, Any, Any]]
    context: contextvars.Context
    reply: asyncio.Future[Any]
    abandoned: threading.Event = field(default_factory=threading.Event)


class Mailbox:
    """A FIFO of messages served by one task. Closed until :meth:`open`; :meth:`close` refuses
    new messages (drain) while those already accepted run on."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._refusal: str | None = NOT_STARTED
        self._letters: asyncio.Queue[_Letter] = asyncio.Queue()
        self._current: _Letter | None = None
        self._in_flight = 0  # accepted and not yet answered: queued + running
        self._idle = asyncio.Event()
        self._idle.set()
        self._server: asyncio.Task[None] | None = None

    @property
    def refusal(self) -> str | None:
        return self._refusal

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def open(self) -> None:
        self._refusal = None
        self._server = asyncio.create_task(self._serve(), name=f"{self.name}-mailbox")

    def close(self) -> int:
        """Refuse new messages; return how many are still in flight."""
        self._refusal = DRAINING
        return self._in_flight

    async def post(self, handler: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Queue ``handler`` as a message and return its reply once its turn has come and gone."""
        if self._refusal is not None:
            raise Unavailable(self._refusal)
        if _RUNNING_IN.get() is self:
            raise RuntimeError(f"{self.name}: a message posted to its own mailbox would wait forever")
        letter = _Letter(handler, contextvars.copy_context(), asyncio.get_running_loop().create_future())
        letter.context.run(_RUNNING_IN.set, self)
        letter.context.run(_ABANDONED.set, letter.abandoned)
        self._in_flight += 1
        self._idle.clear()
        self._letters.put_nowait(letter)
        try:
            reply: T = await letter.reply
        except asyncio.CancelledError:  # the caller gave up: compute stops at its next safe point
            letter.abandoned.set()
            raise
        return reply

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every accepted message has run; False when ``timeout_s`` passed first."""
        if self._idle.is_set():  # wait_for(..., 0) would time out even then
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def cancel(self, reason: str) -> None:
        """Stop serving now: the running message is cancelled, queued ones are dropped, and
        their callers get :class:`Unavailable` with ``reason``."""
        self._refusal = DRAINING
        pending = [self._current] if self._current else []
        if self._server is not None:
            self._server.cancel()
            await asyncio.gather(self._server, return_exceptions=True)
        while not self._letters.empty():
            pending.append(self._letters.get_nowait())
        for letter in pending:
            if not letter.reply.done():
                letter.reply.set_exception(Unavailable(reason))

    async def _serve(self) -> None:
        while True:
            self._current = await self._letters.get()
            try:
                if not self._current.reply.done():  # skipped when its caller gave up waiting
                    await self._deliver(self._current)
            finally:
                self._current = None
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.set()

    @staticmethod
    async def _deliver(letter: _Letter) -> None:
        task = asyncio.create_task(letter.handler(), context=letter.context)
        try:
            await asyncio.wait([task])
        finally:
            task.cancel()  # a no-op once done; ends the message when the mailbox itself is cancelled
        if letter.reply.done():
            return
        if task.cancelled():
            letter.reply.cancel()
        elif (error := task.exception()) is not None:
            letter.reply.set_exception(error)
        else:
            letter.reply.set_result(task.result())


class WorkerThread:
    """One daemon thread that runs blocking functions in submission order, in the caller's context.

    A daemon rather than a ``ThreadPoolExecutor``: the executor's threads are joined at interpreter
    exit, so a computation still running after the drain grace would keep the process alive.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        context = contextvars.copy_context()

        def job() -> None:
            try:
                result = context.run(fn)
            except BaseException as error:
                _reply(loop, future.set_exception, future, error)
            else:
                _reply(loop, future.set_result, future, result)

        self._jobs.put(job)
        return await future

    def close(self) -> None:
        """Let the thread end after the job it runs, if any."""
        self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()


def _reply(
    loop: asyncio.AbstractEventLoop, setter: Callable[[Any], None], future: asyncio.Future[Any], value: Any
) -> None:
    def settle() -> None:
        if not future.done():  # the caller may have given up
            setter(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop closed while the job ran: nobody waits for the reply
        pass
