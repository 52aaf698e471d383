"""Graceful drain of a real service process on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flowgrpo.runtime import open_channel, wait_ready
from flowgrpo.v1 import coordinator_pb2_grpc

from .probe import heartbeat, kill_if_running, read_ready_file, spawn, until


def test_sigterm_finishes_the_call_in_flight_refuses_new_ones_and_exits_0(tmp_path: Path) -> None:
    ready_file, events = tmp_path / "ready.json", tmp_path / "events"
    proc = spawn("serve", "--ready-file", str(ready_file), "--events-file", str(events), "--grace", "10")
    try:
        ready = read_ready_file(ready_file, proc)
        assert ready["pid"] == proc.pid and ready["role"] == "coordinator"
        asyncio.run(_call_through_sigterm(ready["grpc_address"], proc.pid, events))
        _, stderr = proc.communicate(timeout=15)
        assert proc.returncode == 0, stderr
    finally:
        kill_if_running(proc)
    assert not ready_file.exists()  # removed once the server stopped
    assert events.read_text().splitlines() == ["begin 1"]  # the refused call never ran


async def _call_through_sigterm(address: str, pid: int, events: Path) -> None:
    async with open_channel(address) as channel:
        await wait_ready(address, role="coordinator", timeout_s=10, channel=channel)
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        in_flight = asyncio.ensure_future(stub.Heartbeat(heartbeat("sleep 1.5", 1), timeout=20))
        await until(lambda: events.exists() and "begin 1" in events.read_text(), "begin 1")
        os.kill(pid, signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(channel)
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

        async def draining() -> bool:
            response = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
            return bool(response.status == not_serving)

        await until(draining, "health NOT_SERVING after SIGTERM")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Heartbeat(heartbeat("ok", 2), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining: send it to another replica" in refused.value.details()
        assert not in_flight.done()  # the drain began while the call ran
        assert (await in_flight).known


@pytest.mark.parametrize("how", ["grace passes", "second SIGTERM"])
def test_a_message_outliving_the_drain_is_cancelled_and_the_process_still_exits(
    tmp_path: Path, how: str
) -> None:
    ready_file, events = tmp_path / "ready.json", tmp_path / "events"
    grace = "0.5" if how == "grace passes" else "60"
    proc = spawn("serve", "--ready-file", str(ready_file), "--events-file", str(events), "--grace", grace)
    try:
        address = read_ready_file(ready_file, proc)["grpc_address"]
        code, details = asyncio.run(
            _outlive_the_drain(address, proc.pid, events, signals=1 if grace == "0.5" else 2)
        )
        _, stderr = proc.communicate(timeout=10)  # the worker thread still sleeps: it must not hold the exit
        assert proc.returncode == 0, stderr
    finally:
        kill_if_running(proc)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert details.endswith(
        f"draining: cancelled before it finished (drain grace {grace}s); send it to another replica"
    )
    assert "cancelling 1 message(s)" in stderr


async def _outlive_the_drain(
    address: str, pid: int, events: Path, signals: int
) -> tuple[grpc.StatusCode, str]:
    async with open_channel(address) as channel:
        await wait_ready(address, role="coordinator", timeout_s=10, channel=channel)
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        stuck = asyncio.ensure_future(stub.Heartbeat(heartbeat("sleep 60", 1), timeout=30))
        await until(lambda: events.exists() and "begin 1" in events.read_text(), "begin 1")
        for _ in range(signals):
            os.kill(pid, signal.SIGTERM)
            await asyncio.sleep(0.3)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stuck
        return failed.value.code(), failed.value.details()


def test_an_orphan_cancels_its_message_in_flight_without_waiting_out_the_drain_grace(
    tmp_path: Path,
) -> None:
    """The launcher's pipe closes (the coordinator was SIGKILLed) while a message runs: no one will
    read its reply, so the replica exits in about a second, not after its 60 s drain grace."""
    ready_file, events = tmp_path / "ready.json", tmp_path / "events"
    read_end, write_end = os.pipe()
    proc = spawn("serve", "--ready-file", str(ready_file), "--events-file", str(events),
                 "--grace", "60", "--parent-fd", str(read_end), pass_fds=(read_end,))  # fmt: skip
    os.close(read_end)
    try:
        address = read_ready_file(ready_file, proc)["grpc_address"]
        code, took = asyncio.run(_orphan_mid_message(address, write_end, events))
        _, stderr = proc.communicate(timeout=10)
        assert proc.returncode == 0, stderr
    finally:
        kill_if_running(proc)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert took < 10, f"the orphan's message ran on for {took:.1f} s"
    assert "the coordinator that launched this replica is gone (its pipe closed)" in stderr
    assert "cancelling 1 message(s)" in stderr


async def _orphan_mid_message(address: str, write_end: int, events: Path) -> tuple[grpc.StatusCode, float]:
    async with open_channel(address) as channel:
        await wait_ready(address, role="coordinator", timeout_s=10, channel=channel)
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        stuck = asyncio.ensure_future(stub.Heartbeat(heartbeat("sleep 60", 1), timeout=30))
        await until(lambda: events.exists() and "begin 1" in events.read_text(), "begin 1")
        os.close(write_end)
        orphaned = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stuck
        return failed.value.code(), time.monotonic() - orphaned
