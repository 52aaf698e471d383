"""``flowgrpo status RUN_DIR``: where a run stands: from its folder, the run state, the last
step's key metrics and each service process of the ``local`` launcher (alive or not); while the
run is going, also what its coordinator answers (``RunStatus``: the step, every registered
replica, its state and last heartbeat). The live view needs the run's token when the run has one:
the environment's (``FLOWGRPO_TOKEN``, ``FLOWGRPO_TOKEN_FILE``), else the one a ``local`` or
``inprocess`` run keeps for this user in ``<run_dir>/credentials.json``
(:mod:`flowgrpo.runtime.credentials`). ``flowgrpo status --address HOST:PORT`` asks a coordinator
alone (a deployment, where the run folder is on another machine)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import grpc.aio

from flowgrpo.bus.shm import pid_alive
from flowgrpo.runtime import ClientConfig, open_channel
from flowgrpo.runtime.credentials import CredentialsFileError, read_run_credentials, token_given
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
        try:
            token = _run_token(run_dir)
        except CredentialsFileError as error:
            lines.append(f"coordinator at {coordinator}: not asked: {error}")
        else:
            lines.append(live_status(coordinator, token=token))
    return "\n".join(lines)


def _run_token(run_dir: Path) -> str:
    """The token to ask the run's coordinator with: "" when the environment names one (the
    channel reads it there) or the run keeps none; else the run's own, from its credentials file."""
    if token_given():
        return ""
    credentials = read_run_credentials(run_dir)
    return credentials.token if credentials else ""


def live_status(address: str, timeout_s: float = 5.0, token: str = "") -> str:
    """What the coordinator at ``address`` answers to RunStatus, as lines; ``token``: the run's
    (default: the environment's, if any)."""
    try:
        response = asyncio.run(_run_status(address, timeout_s, token))
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.UNAUTHENTICATED:
            return (f"coordinator at {address}: the live view needs the run's token: set FLOWGRPO_TOKEN "
                    "or FLOWGRPO_TOKEN_FILE (a local run keeps its own in RUN_DIR/credentials.json, "
                    "read by `flowgrpo status RUN_DIR` of the same user on its host)")  # fmt: skip
        return f"coordinator at {address}: no answer ({error.code().name}: {error.details()})"
    lines = [f"coordinator at {address}: run {response.run_id}, {response.schedule}, step "
             f"{response.step}/{response.steps}, policy v{response.policy_version}"]  # fmt: skip
    for m in response.members:
        seen = "in process" if m.info.grpc_address == "inprocess" else f"seen {m.last_seen_s:.1f} s ago"
        where = f"{m.info.replica_id:<12} {m.info.role:<8} {m.state:<5} {m.info.grpc_address:<22}"
        lines.append(f"  {where} v{m.info.policy_version:<4} in flight {m.in_flight} joins {m.joins}  {seen}")
    return "\n".join(lines)


async def _run_status(address: str, timeout_s: float, token: str) -> coordinator_pb2.RunStatusResponse:
    channel = open_channel(address, ClientConfig(token=token))
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        response: coordinator_pb2.RunStatusResponse = await stub.RunStatus(
            coordinator_pb2.RunStatusRequest(), timeout=timeout_s
        )
        return response
    finally:
        await channel.close()
