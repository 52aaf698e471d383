"""A small actor for the runtime tests: the real Coordinator service, with handlers the test steers.

``Heartbeat`` is the steerable message: ``replica_id`` holds a command ("sleep 0.5", "fail",
"invalid", "ok") and ``in_flight`` a sequence number the actor records when the message begins.
``RunStatus`` reports what the actor saw. It also serves the real Reward service, whose ``Score``
stream scores each image as a message of its own. Run as a module, it serves the actor in a
subprocess (``serve``) or calls one from another process (``call``), both traced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc.aio
from opentelemetry import context as otel_context
from opentelemetry import trace

from flowgrpo.logs import setup_logging
from flowgrpo.runtime import (
    Actor,
    ClientConfig,
    InvalidArgument,
    ServerConfig,
    Service,
    ServiceServer,
    message,
    open_channel,
    serve,
    wait_ready,
)
from flowgrpo.telemetry import carrier, links_from, setup_tracing, shutdown_tracing
from flowgrpo.v1 import coordinator_pb2, coordinator_pb2_grpc, reward_pb2, reward_pb2_grpc

TESTS_DIR = Path(__file__).resolve().parents[1]
tracer = trace.get_tracer(__name__)


class ProbeActor(Actor, coordinator_pb2_grpc.CoordinatorServicer, reward_pb2_grpc.RewardServicer):
    """Records the order and overlap of its messages; sleeps or fails on command."""

    role = "coordinator"

    def __init__(
        self, replica_id: str = "probe-0", start_delay_s: float = 0.0, events_file: str = ""
    ) -> None:
        super().__init__(replica_id)
        self.order: list[int] = []  # sequence numbers, in the order their messages began
        self.running = 0  # messages running now
        self.max_running = 0  # the most that ever ran at once: 1 for an actor
        self.stopped = False
        self._start_delay_s = start_delay_s
        self._events = Path(events_file) if events_file else None

    async def start(self) -> None:
        with self.startup_phase("model", "probe weights"):  # what a service's load looks like
            await asyncio.sleep(self._start_delay_s)

    async def stop(self) -> None:
        self.stopped = True

    @message
    async def Heartbeat(
        self, request: coordinator_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.HeartbeatResponse:
        command, _, argument = request.replica_id.partition(" ")
        self.order.append(request.in_flight)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self._event(f"begin {request.in_flight}")
        try:
            with tracer.start_as_current_span("probe.handle"):
                if command == "sleep":
                    await self.compute(_sleep, float(argument))
                elif command == "fail":
                    raise RuntimeError("probe failure")
                elif command == "fail-base":  # in the worker thread, as DCP raises its own
                    await self.compute(_raise_base)
                elif command == "invalid":
                    raise InvalidArgument("probe refuses this request")
        finally:
            self.running -= 1
        return coordinator_pb2.HeartbeatResponse(known=True)

    @message
    async def RunStatus(
        self, request: coordinator_pb2.RunStatusRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.RunStatusResponse:
        return coordinator_pb2.RunStatusResponse(run_id=",".join(map(str, self.order)), step=self.max_running)

    async def Score(
        self, requests: AsyncIterator[reward_pb2.ScoreRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[reward_pb2.ScoreResult]:
        """One message per image, so a long stream never holds the actor between images."""
        async for request in requests:
            yield await self.call(self._score, request)

    async def _score(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResult:
        if request.prompt == "bad":
            raise InvalidArgument(f"sample {request.sample_id}: no prompt to score against")
        return reward_pb2.ScoreResult(sample_id=request.sample_id, reward=float(len(request.prompt)))

    async def Info(
        self, request: reward_pb2.RewardInfoRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.RewardInfoResponse:
        return reward_pb2.RewardInfoResponse(scorers=["prompt_length"], weights={"prompt_length": 1.0})

    # The generated stubs declare every RPC abstract; these two are not used by the tests.
    async def Register(
        self, request: coordinator_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.RegisterResponse:
        raise InvalidArgument("the probe keeps no registry")

    async def Leave(
        self, request: coordinator_pb2.LeaveRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.LeaveResponse:
        raise InvalidArgument("the probe keeps no registry")

    def _event(self, line: str) -> None:
        if self._events is not None:
            with self._events.open("a") as f:
                f.write(line + "\n")


def _sleep(seconds: float) -> None:
    """Blocking work, as a forward pass would be; traced to show the context reaches the thread."""
    with tracer.start_as_current_span("probe.compute"):
        time.sleep(seconds)


def services(actor: ProbeActor) -> list[Service]:
    return [
        Service("flowgrpo.v1.Coordinator", actor, coordinator_pb2_grpc.add_CoordinatorServicer_to_server),
        Service("flowgrpo.v1.Reward", actor, reward_pb2_grpc.add_RewardServicer_to_server),
    ]


@asynccontextmanager
async def running(actor: ProbeActor, config: ServerConfig | None = None) -> AsyncIterator[ServiceServer]:
    """An in-process server for ``actor``, stopped (without grace) at the end."""
    server = ServiceServer(actor, config or ServerConfig(), services(actor))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def spawn(
    mode: str, *args: str, env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()
) -> subprocess.Popen[str]:
    """Run this module in a subprocess; the caller ends it by its handle."""
    return subprocess.Popen(
        [sys.executable, "-m", "runtime.probe", mode, *args],
        cwd=TESTS_DIR,
        env=env,
        pass_fds=pass_fds,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def kill_if_running(proc: subprocess.Popen[str]) -> None:
    """End a probe this test started, by its handle, and reap it."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def read_ready_file(path: Path, proc: subprocess.Popen[str], timeout_s: float = 20.0) -> dict[str, Any]:
    """The ready file of ``proc`` once written; fails naming the file and the process's stderr."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(
                f"probe exited {proc.returncode} before writing {path}:\n{proc.communicate()[1]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"no ready file {path} after {timeout_s}s")
        time.sleep(0.02)
    record: dict[str, Any] = json.loads(path.read_text())
    return record


async def until(condition: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = 5.0) -> None:
    """Poll ``condition`` (plain or async) until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = condition()
        if held if isinstance(held, bool) else await held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


def heartbeat(command: str, seq: int = 0) -> coordinator_pb2.HeartbeatRequest:
    return coordinator_pb2.HeartbeatRequest(replica_id=command, in_flight=seq)


def _serve(args: argparse.Namespace) -> None:
    setup_logging(args.name, "probe-0")
    setup_tracing(args.name, replica_id="probe-0", run_dir=args.run_dir)
    actor = ProbeActor(events_file=args.events_file)
    config = ServerConfig(ready_file=args.ready_file, drain_grace_s=args.grace)
    try:
        parent_fd = args.parent_fd if args.parent_fd >= 0 else None
        asyncio.run(serve(actor, config, services(actor), parent_fd=parent_fd))
    finally:
        shutdown_tracing()


async def _call(address: str) -> None:
    """One traced call, then a consumer span linked to two producers (as a train step would be)."""
    channel = open_channel(address, ClientConfig())
    await wait_ready(address, role="coordinator", timeout_s=10, channel=channel)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    with tracer.start_as_current_span("client.step"):
        await stub.Heartbeat(heartbeat("sleep 0.05", 1))
    carriers = []
    for name in ("producer.a", "producer.b"):
        with tracer.start_as_current_span(name, context=otel_context.Context()):
            carriers.append(carrier())
    with tracer.start_as_current_span("consumer", context=otel_context.Context(), links=links_from(carriers)):
        pass
    await channel.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["serve", "call"])
    parser.add_argument("--name", default="probe")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--ready-file", default="")
    parser.add_argument("--events-file", default="")
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("--address", default="")
    parser.add_argument("--parent-fd", type=int, default=-1)  # an inherited pipe's read end
    args = parser.parse_args()
    if args.mode == "serve":
        _serve(args)
    else:
        setup_tracing(args.name, run_dir=args.run_dir)
        try:
            asyncio.run(_call(args.address))
        finally:
            shutdown_tracing()


if __name__ == "__main__":
    main()


class ProbeBaseError(BaseException):
    """Like DCP's CheckpointException: derives from BaseException, not Exception."""


def _raise_base() -> None:
    raise ProbeBaseError("a library's BaseException")
