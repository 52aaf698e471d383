"""The actor: a service replica that owns its state and handles its messages one at a time.

Handlers never share the actor's state with each other: each RPC that touches it goes through
the mailbox (``@message`` or :meth:`Actor.call`) and runs alone, in arrival order. Blocking
compute (a forward pass, a scorer) runs in the actor's one worker thread (:meth:`Actor.compute`),
so the event loop keeps answering health probes and handshakes while a long message runs.

A service subclasses :class:`Actor` and the generated servicer::

    class RewardService(Actor, reward_pb2_grpc.RewardServicer):
        role = "reward"

        def __init__(self, config: RewardConfig) -> None:
            super().__init__()
            self.scorers: list[Scorer] = []          # state, listed at the top

        async def start(self) -> None:
            self.scorers = await self.compute(load_scorers, self.config)

        @message
        async def Info(self, request, context):
            return reward_pb2.RewardInfoResponse(scorers=[s.name for s in self.scorers])
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, ClassVar, Concatenate, ParamSpec, TypeVar

from flowgrpo import PROTOCOL_VERSION, __version__
from flowgrpo.config_digest import Settings, digest
from flowgrpo.runtime.mailbox import NOT_STARTED, Mailbox, WorkerThread
from flowgrpo.runtime.startup import starting_refusal
from flowgrpo.v1 import common_pb2

P = ParamSpec("P")
T = TypeVar("T")
A = TypeVar("A", bound="Actor")


class Actor:
    """Base of every service replica. Subclasses set ``role``, list their state in ``__init__``
    after ``super().__init__()``, and override the :meth:`start` / :meth:`stop` hooks.

    :class:`~flowgrpo.runtime.server.ServiceServer` drives the life cycle: :meth:`launch` once the
    port is bound, :meth:`begin_drain` on SIGTERM or Drain, :meth:`shutdown` at the end.
    """

    role: ClassVar[str] = "actor"

    def __init__(self, replica_id: str = "") -> None:
        self.replica_id = replica_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.grpc_address = ""  # set by the server once its port is bound, before start()
        self.bus_endpoint = ""  # this replica's data-bus store; empty when it produces no data
        self.stages: list[common_pb2.StageSpec] = []  # the columns it consumes and produces
        self.policy_version = -1  # rollout / trainer: the weights they hold
        self.labels: dict[str, str] = {}
        # what it took from its own recipe that must agree with the run's (config_digest.role_settings)
        self.settings: Settings = {}
        self.startup: list[common_pb2.StartupPhase] = []  # how start() went, phase by phase
        self.startup_s = 0.0  # from the process's start (or launch()) to ready; the handshake says it
        self._phase: tuple[str, float] | None = None  # the start-up phase running, since (monotonic)
        self._mailbox = Mailbox(f"{self.role} {self.replica_id}")
        self._worker: WorkerThread | None = None

    async def start(self) -> None:
        """Hook: acquire what messages need (models, stores, registration). No message runs
        before it returns; :meth:`compute` is already usable."""

    async def stop(self) -> None:
        """Hook: release what :meth:`start` acquired. No message runs any more."""

    def info(self) -> common_pb2.ServiceInfo:
        """What the READY handshake answers; extend it by overriding and adding fields."""
        return common_pb2.ServiceInfo(
            role=self.role,
            replica_id=self.replica_id,
            software_version=__version__,
            protocol_version=PROTOCOL_VERSION,
            grpc_address=self.grpc_address,
            bus_endpoint=self.bus_endpoint,
            stages=self.stages,
            policy_version=self.policy_version,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            labels=self.labels,
            startup=self.startup,
            startup_s=self.startup_s,
            settings=self.settings,
            settings_digest=digest(self.settings),
        )

    @contextlib.contextmanager
    def startup_phase(self, name: str, detail: str = "") -> Iterator[common_pb2.StartupPhase]:
        """Time one phase of :meth:`start` (``with self.startup_phase("model", "on cuda:0"):``):
        while it runs a handshake is told its name and seconds so far, once done it is listed in
        :meth:`info`. The phase is yielded, so its ``detail`` can be set from what was loaded."""
        phase = common_pb2.StartupPhase(name=name, detail=detail)
        self._phase = (name, time.monotonic())
        try:
            yield phase
        finally:
            phase.seconds = time.monotonic() - self._phase[1]
            self._phase = None
            self.startup.append(phase)

    @property
    def refusal(self) -> str | None:
        """Why messages are refused now (starting, with the phase; draining), or None when they
        are accepted."""
        refusal = self._mailbox.refusal
        if refusal != NOT_STARTED:
            return refusal
        name, since = self._phase if self._phase is not None else ("", 0.0)
        return starting_refusal(self.replica_id, name, time.monotonic() - since if name else None)

    @property
    def in_flight(self) -> int:
        return self._mailbox.in_flight

    async def call(self, fn: Callable[P, Coroutine[Any, Any, T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn(*args, **kwargs)`` as a message: after every message that arrived before it,
        alone. Raises :class:`~flowgrpo.runtime.errors.Unavailable` while starting or draining."""
        return await self._mailbox.post(functools.partial(fn, *args, **kwargs))

    async def compute(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run the blocking ``fn(*args, **kwargs)`` in the actor's worker thread and await it."""
        if self._worker is None:
            raise RuntimeError(
                f"{self.role} {self.replica_id}: compute() before launch() or after shutdown()"
            )
        return await self._worker.run(functools.partial(fn, *args, **kwargs))

    async def launch(self) -> None:
        """Start the worker thread, run :meth:`start`, then accept messages."""
        self._worker = WorkerThread(f"{self.replica_id}-compute")
        began = time.monotonic()
        try:
            await self.start()
        except BaseException:
            self._close_worker()
            raise
        self.startup_s = time.monotonic() - began  # a server makes it the process's age (imports too)
        self._mailbox.open()

    def begin_drain(self) -> int:
        """Refuse new messages; return how many are still in flight."""
        return self._mailbox.close()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait for the in-flight messages; False when ``timeout_s`` passed first."""
        return await self._mailbox.wait_idle(timeout_s)

    async def cancel_messages(self, reason: str) -> None:
        """Cancel the messages still in flight; their callers get UNAVAILABLE with ``reason``."""
        await self._mailbox.cancel(reason)

    async def shutdown(self) -> None:
        """Cancel what still runs, then run :meth:`stop`."""
        await self._mailbox.cancel(f"{self.role} {self.replica_id} stopped; send it to another replica")
        try:
            await self.stop()
        finally:
            self._close_worker()

    def _close_worker(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None


def message(
    method: Callable[Concatenate[A, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[A, P], Coroutine[Any, Any, T]]:
    """Mark an async method of an :class:`Actor` (typically an RPC handler) as a message: each
    call runs through the actor's mailbox, one at a time, in arrival order.

    Not for streaming handlers: a stream would hold the actor for its whole life. A stream
    handler posts each item instead (``yield await self.call(self._score, request)``).
    """
    if inspect.isasyncgenfunction(method):
        raise TypeError(
            f"@message on the stream handler {method.__qualname__}: post each item with self.call"
        )

    @functools.wraps(method)
    async def post(self: A, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self.call(method, self, *args, **kwargs)

    return post
