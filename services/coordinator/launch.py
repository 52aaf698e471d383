"""Launchers: how the services of a run come to exist. The coordinator's code is the same for all.

- ``local``: every replica its own process (``python -m flowgrpo.cli serve ROLE --config F``, the
  trainer under torchrun when ``trainer_nproc`` > 1) on loopback with free ports; each writes a
  ready file, then answers the READY handshake. Logs go to ``<run_dir>/logs/<replica>.log``.
- ``inprocess``: the four roles as actors in this process, called through their mailboxes (no
  sockets between them; the bus short-cuts to the local stores). The reference the distributed
  run must match.
- ``remote``: services already running (``flowgrpo serve``, compose, Kubernetes) at the given
  addresses; only handshakes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from flowgrpo.columns import COLUMNS, StageSpec, check_pipeline
from flowgrpo.config import dump_yaml
from flowgrpo.runtime import open_channel, wait_ready
from flowgrpo.runtime.config import ServerConfig
from flowgrpo.services.coordinator.config import RunConfig
from flowgrpo.services.coordinator.handles import STUBS, Replica
from flowgrpo.services.reward.config import RewardServiceConfig
from flowgrpo.services.rollout.config import RolloutServiceConfig
from flowgrpo.services.trainer.config import TrainerServiceConfig
from flowgrpo.v1 import common_pb2

# What the coordinator itself puts in (prompt ids) and produces (advantages), around the services.
COORDINATOR_INPUTS = ("prompt_ids",)
COORDINATOR_STAGE = StageSpec("coordinator", consumes=("images",), produces=("advantages",))


@dataclass
class Services:
    rollouts: list[Replica]
    rewards: list[Replica]
    trainer: Replica
    infos: list[common_pb2.ServiceInfo] = field(default_factory=list)
    _stop: list[Any] = field(default_factory=list)  # what shutdown() undoes, last first

    async def shutdown(self) -> None:
        for stop in reversed(self._stop):
            await stop()
        self._stop.clear()


def service_configs(cfg: RunConfig) -> dict[str, Any]:
    """Each replica's service config (replica id -> config), from the run config."""
    run_dir = Path(cfg.run_dir).resolve()
    trainer = cfg.trainer
    if not trainer.checkpoint_dir:
        trainer = replace(trainer, checkpoint_dir=str(run_dir / "checkpoints"))
    common: dict[str, Any] = {"run_dir": str(run_dir), "log_format": "text"}

    def server(replica: str) -> ServerConfig:
        return ServerConfig(port=0, ready_file=str(run_dir / "services" / f"{replica}.ready.json"))

    out: dict[str, Any] = {}
    for i in range(cfg.launch.rollout_replicas):
        rid = f"rollout-{i}"
        engine = cfg.rollout
        if cfg.launch.rollout_devices:
            engine = replace(engine, device=cfg.launch.rollout_devices[i])
        out[rid] = RolloutServiceConfig(server=server(rid), replica_id=rid, rollout=engine, **common)
    for i in range(cfg.launch.reward_replicas):
        rid = f"reward-{i}"
        out[rid] = RewardServiceConfig(
            server=server(rid), replica_id=rid, reward=cfg.reward, stream=cfg.reward_stream, **common
        )
    out["trainer"] = TrainerServiceConfig(
        server=server("trainer"), replica_id="trainer", trainer=trainer, **common
    )
    return out


async def launch(cfg: RunConfig) -> Services:
    if cfg.launch.launcher == "inprocess":
        services = await _launch_inprocess(cfg)
    elif cfg.launch.launcher == "local":
        services = await _launch_local(cfg)
    else:
        services = await _connect(cfg, cfg.launch.rollout_addresses, cfg.launch.reward_addresses,
                                  cfg.launch.trainer_address)  # fmt: skip
    try:
        check_services(services)
    except BaseException:
        await services.shutdown()
        raise
    return services


def check_services(services: Services) -> None:
    """The startup check: the columns each stage consumes are produced upstream, every replica
    speaks this protocol (the handshake checked that) — refuse to start otherwise."""
    stages = {info.role: info.stages for info in services.infos}
    order = [
        *stages.get("rollout", []),
        COORDINATOR_STAGE,
        *stages.get("reward", []),
        *stages.get("trainer", []),
    ]
    specs = [
        s if isinstance(s, StageSpec) else StageSpec(s.stage, tuple(s.consumes), tuple(s.produces))
        for s in order
    ]
    check_pipeline(specs, COLUMNS, inputs=COORDINATOR_INPUTS)


# --- in process ---------------------------------------------------------------------------------


async def _launch_inprocess(cfg: RunConfig) -> Services:
    from flowgrpo.services.reward.service import RewardService
    from flowgrpo.services.rollout.service import RolloutService
    from flowgrpo.services.trainer.service import TrainerService

    classes = {"rollout": RolloutService, "reward": RewardService, "trainer": TrainerService}
    services = Services([], [], None)  # type: ignore[arg-type]
    try:
        for rid, config in service_configs(cfg).items():
            role = rid.split("-")[0]
            actor = classes[role](config)
            await actor.launch()
            services._stop.append(actor.shutdown)
            replica = Replica(role, rid, "inprocess", actor, in_process=True)
            services.infos.append(actor.info())
            _place(services, replica)
    except BaseException:
        await services.shutdown()
        raise
    return services


def _place(services: Services, replica: Replica) -> None:
    if replica.role == "rollout":
        services.rollouts.append(replica)
    elif replica.role == "reward":
        services.rewards.append(replica)
    else:
        services.trainer = replica


# --- local processes ----------------------------------------------------------------------------


async def _launch_local(cfg: RunConfig) -> Services:
    run_dir = Path(cfg.run_dir).resolve()
    (run_dir / "services").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    configs = service_configs(cfg)
    timeout = cfg.launch.start_timeout_s
    try:
        for rid, config in configs.items():
            procs[rid] = _spawn(rid, config, run_dir, cfg.launch.trainer_nproc if rid == "trainer" else 1)
        waits = [_ready_address(rid, procs[rid], config, run_dir, timeout) for rid, config in configs.items()]
        by_id = dict(zip(procs, await asyncio.gather(*waits), strict=True))
    except BaseException:
        _terminate(procs.values(), grace_s=10)
        raise
    rollouts = [a for r, a in by_id.items() if r.startswith("rollout")]
    rewards = [a for r, a in by_id.items() if r.startswith("reward")]
    services = await _connect(cfg, rollouts, rewards, by_id["trainer"])

    async def stop_processes() -> None:
        await asyncio.to_thread(_terminate, procs.values(), 60.0)

    services._stop.insert(0, stop_processes)
    return services


def _spawn(rid: str, config: Any, run_dir: Path, nproc: int) -> subprocess.Popen[bytes]:
    path = run_dir / "services" / f"{rid}.yaml"
    dump_yaml(config, path)
    Path(config.server.ready_file).unlink(missing_ok=True)
    role = rid.split("-", maxsplit=1)[0]
    serve = ["-m", "flowgrpo.cli", "serve", role, "--config", str(path)]
    if nproc > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        cmd = [sys.executable, *launcher, *serve]
    else:
        cmd = [sys.executable, *serve]
    log = open(run_dir / "logs" / f"{rid}.log", "ab")  # noqa: SIM115 (the child holds it)
    # its own process group: stopping the run stops torchrun's workers too
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ)
    )


async def _ready_address(
    rid: str, proc: subprocess.Popen[bytes], config: Any, run_dir: Path, timeout_s: float
) -> str:
    ready = Path(config.server.ready_file)
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None:
            tail = _tail(run_dir / "logs" / f"{rid}.log")
            raise RuntimeError(
                f"{rid} exited with status {proc.returncode} while starting; its log ends:\n{tail}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{rid} wrote no ready file ({ready}) within launch.start_timeout_s={timeout_s:.0f} s; "
                f"see {run_dir / 'logs' / (rid + '.log')}"
            )
        await asyncio.sleep(0.1)
    address: str = json.loads(ready.read_text())["grpc_address"]
    return address


def _terminate(procs: Sequence[subprocess.Popen[bytes]] | Any, grace_s: float) -> None:
    """SIGTERM (a graceful drain), then SIGKILL of the whole process group after ``grace_s``."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _tail(path: Path, lines: int = 30) -> str:
    text = path.read_text(errors="replace") if path.is_file() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


# --- already running ----------------------------------------------------------------------------


async def _connect(cfg: RunConfig, rollouts: Sequence[str], rewards: Sequence[str], trainer: str) -> Services:
    services = Services([], [], None)  # type: ignore[arg-type]
    timeout = cfg.launch.start_timeout_s
    targets = [("rollout", a) for a in rollouts] + [("reward", a) for a in rewards] + [("trainer", trainer)]
    infos = await asyncio.gather(
        *(wait_ready(a, role=r, timeout_s=timeout, client_role="coordinator") for r, a in targets)
    )
    for (role, address), info in zip(targets, infos, strict=True):
        channel = open_channel(address)
        services._stop.append(channel.close)
        services.infos.append(info)
        _place(services, Replica(role, info.replica_id, address, STUBS[role](channel)))
    return services
