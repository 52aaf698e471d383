"""A training run attacked while it trains, by a stranger on the network who knows every address
(from a leaked RunStatus, say) but holds no credential: every attack fails, and the run trains
exactly as an undisturbed one does (metrics bitwise equal, deterministic mode)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import grpc.aio
import pytest
import zmq

from flowgrpo import PROTOCOL_VERSION
from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.runtime import open_channel
from flowgrpo.services.coordinator.outputs import read_metrics
from flowgrpo.v1 import (
    common_pb2,
    common_pb2_grpc,
    coordinator_pb2,
    coordinator_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

CLI = [sys.executable, "-m", "flowgrpo.services.cli"]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "tiny_jpeg.yaml"
TOKEN = "operator-token-" + "q" * 28
STEPS = ["schedule.steps=5", "schedule.save_every=0", "schedule.eval_every=0"]
EXACT = (
    "critic/rewards/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/ratio_mean",
    "critic/advantages/max",
)


def run_command(run_dir: Path, tiny: Path, launcher: str) -> list[str]:
    return [*CLI, "train", str(RECIPE), f"run_dir={run_dir}", f"model.checkpoint={tiny}",
            f"launch.launcher={launcher}", *STEPS]  # fmt: skip


async def stranger(address: str, method: str, request: object, stub: type) -> grpc.StatusCode:
    """One call with no credential at all (a raw client)."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await getattr(stub(channel), method)(request, timeout=10)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def leaked_status(coordinator: str) -> coordinator_pb2.RunStatusResponse:
    """What the attacker knows: every replica's addresses (the operator's view, leaked)."""
    async with open_channel(coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        response: coordinator_pb2.RunStatusResponse = await stub.RunStatus(
            coordinator_pb2.RunStatusRequest(), timeout=10
        )
        return response


def attack(coordinator: str, status: coordinator_pb2.RunStatusResponse) -> dict[str, str]:
    results: dict[str, str] = {}
    by_role = {m.info.role: m.info for m in status.members}
    rollout, trainer = by_role["rollout"], by_role["trainer"]
    hijack = common_pb2.ServiceInfo(
        role="rollout",
        replica_id=rollout.replica_id,
        protocol_version=PROTOCOL_VERSION,
        grpc_address="127.0.0.1:9",
    )
    calls = {
        "register as rollout-0": (coordinator, "Register", coordinator_pb2.RegisterRequest(info=hijack),
                                  coordinator_pb2_grpc.CoordinatorStub),
        "run status": (coordinator, "RunStatus", coordinator_pb2.RunStatusRequest(),
                       coordinator_pb2_grpc.CoordinatorStub),
        "drain the rollout": (rollout.grpc_address, "Drain", common_pb2.DrainRequest(),
                              common_pb2_grpc.LifecycleStub),
        "drain the trainer": (trainer.grpc_address, "Drain", common_pb2.DrainRequest(),
                              common_pb2_grpc.LifecycleStub),
        "release every tag": (rollout.grpc_address, "Release", rollout_pb2.ReleaseRequest(tags=["step1"]),
                              rollout_pb2_grpc.RolloutStub),
        "save a checkpoint elsewhere": (trainer.grpc_address, "SaveCheckpoint",
                                        trainer_pb2.SaveCheckpointRequest(step=99999999, path="/tmp/planted"),
                                        trainer_pb2_grpc.TrainerStub),
        "read the weight refs": (trainer.grpc_address, "State", trainer_pb2.TrainerStateRequest(),
                                 trainer_pb2_grpc.TrainerStub),
    }  # fmt: skip
    for name, (address, method, request, stub) in calls.items():
        results[name] = asyncio.run(stranger(address, method, request, stub)).name
    # the data bus: a raw peer (no CURVE keys) asking the stores for anything
    for name, endpoint in (("fetch from the trainer's bus", trainer.bus_endpoint),
                           ("fetch from the rollout's bus", rollout.bus_endpoint)):  # fmt: skip
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send_multipart([b"\x01", b"\x81\xa4keys\x90"])
        results[name] = "answered" if sock.poll(2000) else "no answer"
        sock.close()
    return results


@pytest.mark.timeout(600)
def test_a_run_under_attack_trains_as_an_undisturbed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = make_tiny_bagel(tmp_path / "tiny", seed=0)
    reference = subprocess.run(run_command(tmp_path / "reference", tiny, "inprocess"),
                               capture_output=True, text=True, timeout=300)  # fmt: skip
    assert reference.returncode == 0, reference.stderr[-3000:]
    monkeypatch.setenv("FLOWGRPO_TOKEN", TOKEN)  # the operator's own token: this test reads RunStatus
    attacked = tmp_path / "attacked"
    proc = subprocess.Popen(run_command(attacked, tiny, "local"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not read_metrics(attacked):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 1"
            time.sleep(0.2)
        ready = attacked / "services" / "coordinator.ready.json"
        coordinator = json.loads(ready.read_text())["grpc_address"]
        leaked = asyncio.run(leaked_status(coordinator))  # read with the operator's token
        monkeypatch.delenv("FLOWGRPO_TOKEN")  # from here on: a stranger
        results = attack(coordinator, leaked)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 0, stderr[-3000:]
    grpc_attacks = {k: v for k, v in results.items() if "bus" not in k}
    assert set(grpc_attacks.values()) == {"UNAUTHENTICATED"}, results
    assert results["fetch from the trainer's bus"] == results["fetch from the rollout's bus"] == "no answer"
    assert not Path("/tmp/planted").exists()
    ours, theirs = read_metrics(attacked), read_metrics(tmp_path / "reference")
    assert len(ours) == len(theirs) == 5
    for a, b in zip(ours, theirs, strict=True):
        for key in EXACT:
            assert a[key] == b[key], (a["step"], key)
