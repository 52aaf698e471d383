"""``flowgrpo status RUN_DIR``: where a run stands: from its folder, the run state, the last
step's key metrics and each service process of the ``local`` launcher (alive or not); while the
run is going, also what its coordinator answers (``RunStatus``: the step, every registered
replica, its state and last heartbeat). ``flowgrpo status --address HOST:PORT`` asks a
coordinator alone (a deployment, where the run folder is on another machine)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import grpc.aio

from flowgrpo.bus.shm import pid_alive
from flowgrpo.runtime import open_channel
from flowgrpo.services.coordinator.outputs import read_metrics
from flowgrpo.v1 import coordinator_pb2, coordinator_pb2_grpc

KEYS = ("critic/rewards/mean", "actor/pg_loss", "actor/pg_clipfrac", "trainer/lag/max", "timing_s/step",
        "coordinator/dropped_groups", "coordinator/retries")  # fmt: skip


def status(run_dir: str | Path) -> str:
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.yaml): give the run_dir of a run")
    lines = [f"run {run_dir}"]
    state_file = run_dir / "run_state.json"
    if state_file.is_file():
        state = json.loads(state_file.read_text())
        lines.append(f"  checkpointed at step {state['step']} (policy v{state['policy_version']}): "
                     f"{state['trainer_checkpoint']}")  # fmt: skip
    train, val = read_metrics(run_dir), read_metrics(run_dir, kind="val")
    if train:
        last = train[-1]
        shown = "  ".join(f"{k} {last[k]:.4g}" for k in KEYS if last.get(k) is not None)
        lines.append(f"  last step {last['step']}: {shown}")
    if val:
        scores = "  ".join(f"{k} {v:.5g}" for k, v in val[-1].items() if k.startswith("val-core"))
        lines.append(f"  last validation (step {val[-1]['step']}): {scores}")
    coordinator = None
    for ready in sorted((run_dir / "services").glob("*.ready.json")):
        info = json.loads(ready.read_text())
        alive = pid_alive(int(info["pid"]))
        if info["role"] == "coordinator" and alive:
            coordinator = info["grpc_address"]
        lines.append(f"  {info['replica_id']:<12} {info['grpc_address']:<22} pid {info['pid']:<8} "
                     f"{'running' if alive else 'not running'}")  # fmt: skip
    if coordinator is not None:
        lines.append(live_status(coordinator))
    return "\n".join(lines)


def live_status(address: str, timeout_s: float = 5.0) -> str:
    """What the coordinator at ``address`` answers to RunStatus, as lines."""
    try:
        response = asyncio.run(_run_status(address, timeout_s))
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.UNAUTHENTICATED:
            return (f"coordinator at {address}: the live view needs the run's token: set FLOWGRPO_TOKEN "
                    "(a local run makes its own unless FLOWGRPO_TOKEN is set when it starts)")  # fmt: skip
        return f"coordinator at {address}: no answer ({error.code().name}: {error.details()})"
    lines = [f"coordinator at {address}: run {response.run_id}, {response.schedule}, step "
             f"{response.step}/{response.steps}, policy v{response.policy_version}"]  # fmt: skip
    for m in response.members:
        seen = "in process" if m.info.grpc_address == "inprocess" else f"seen {m.last_seen_s:.1f} s ago"
        where = f"{m.info.replica_id:<12} {m.info.role:<8} {m.state:<5} {m.info.grpc_address:<22}"
        lines.append(f"  {where} v{m.info.policy_version:<4} in flight {m.in_flight} joins {m.joins}  {seen}")
    return "\n".join(lines)


async def _run_status(address: str, timeout_s: float) -> coordinator_pb2.RunStatusResponse:
    channel = open_channel(address)
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        response: coordinator_pb2.RunStatusResponse = await stub.RunStatus(
            coordinator_pb2.RunStatusRequest(), timeout=timeout_s
        )
        return response
    finally:
        await channel.close()
