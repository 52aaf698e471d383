"""Launchers: how the services of a run come to exist. The coordinator's code is the same for all.

- ``local``: every replica its own process (``python -m flowgrpo.services.cli serve ROLE --config F``, the
  trainer under torchrun when ``trainer_nproc`` > 1) on loopback with free ports; each writes a
  ready file, then answers the READY handshake. Logs go to ``<run_dir>/logs/<replica>.log``.
- ``inprocess``: the four roles as actors in this process, called through their mailboxes (no
  sockets between them; the bus short-cuts to the local stores). The reference the distributed
  run must match.
- ``remote``: services already running (``flowgrpo serve``, compose, Kubernetes): at the given
  addresses, or, without addresses, those that register with this coordinator (their
  ``coordinator=HOST:PORT``) until the configured replica counts are there; only handshakes.

Every launcher compares the settings each replica took from its own config (its READY handshake's
``ServiceInfo.settings``, ``flowgrpo.config_digest``) with the run recipe's (:func:`run_settings`)
and refuses one that differs as any other handshake refusal (:class:`HandshakeError`): at the
start the run fails naming the first differing key; a trainer brought back is not taken.

In ``local`` the replicas also register with the coordinator and send heartbeats (a hung replica
is found without waiting for a call's deadline), and a rollout or reward process that dies is
started again (``launch.restarts`` times): it registers and rejoins the run. A trainer that dies is
started again too (:class:`LocalTrainer`, ``launch.trainer_restarts`` times), at once, while the
rollouts work; ``remote`` waits for a trainer to register again (:class:`RemoteTrainer`). What the
run does with the new trainer is ``revive.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc.aio

from flowgrpo.columns import COLUMNS, StageSpec, check_pipeline
from flowgrpo.config_digest import Settings, refusal, role_settings
from flowgrpo.configs.reward import RewardServiceConfig
from flowgrpo.configs.rollout import RolloutServiceConfig
from flowgrpo.configs.run import RunConfig, with_checkpoint
from flowgrpo.configs.trainer import TrainerServiceConfig
from flowgrpo.runtime import open_channel, wait_ready
from flowgrpo.runtime.client import health
from flowgrpo.runtime.config import ServerConfig
from flowgrpo.runtime.errors import HandshakeError, NotReadyError
from flowgrpo.services.coordinator.handles import STUBS, Replica
from flowgrpo.services.coordinator.pool import RunError
from flowgrpo.services.coordinator.processes import (
    Lifeline,
    ServiceStartError,
    exit_status,
    kill_groups,
    ready_address,
    spawn,
    stop_groups,
    unless_one_exits,
)
from flowgrpo.services.coordinator.progress import StartupReport
from flowgrpo.services.coordinator.registry import ROLES, CoordinatorService
from flowgrpo.services.coordinator.revive import TrainerSource
from flowgrpo.v1 import common_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")


# What the coordinator itself puts in (prompt ids) and produces (advantages), around the services.
COORDINATOR_INPUTS = ("prompt_ids",)
COORDINATOR_STAGE = StageSpec("coordinator", consumes=("images",), produces=("advantages",))


@dataclass
class Services:
    rollouts: list[Replica]
    rewards: list[Replica]
    trainer: Replica
    infos: list[common_pb2.ServiceInfo] = field(default_factory=list)
    trainer_source: TrainerSource | None = None  # how a trainer that died is brought back
    _stop: list[Any] = field(default_factory=list)  # what shutdown() undoes, last first
    _kill: list[Callable[[], None]] = field(default_factory=list)  # a forced stop: at once, no drain

    async def shutdown(self) -> None:
        for stop in reversed(self._stop):
            await stop()
        self._stop.clear()

    def kill(self) -> None:
        """Kill the service processes now (a forced stop); :meth:`shutdown` then finds them gone."""
        for kill in self._kill:
            kill()


def role_config(cfg: RunConfig, role: str, **process: Any) -> Any:
    """The service config of one ``role`` replica from the run config: its section of the recipe
    (``rollout``, ``reward`` + ``reward_stream``, ``trainer``) with ``model.checkpoint`` where the
    section names none. ``process``: the ServiceProcessConfig fields (server, replica_id, run_dir,
    coordinator, ...). What ``flowgrpo serve ROLE --recipe RECIPE`` runs, and each ``local`` replica."""
    if cfg.model.checkpoint:
        cfg = with_checkpoint(cfg, cfg.model.checkpoint)
    if role == "rollout":
        return RolloutServiceConfig(rollout=cfg.rollout, **process)
    if role == "reward":
        return RewardServiceConfig(reward=cfg.reward, stream=cfg.reward_stream, **process)
    if role == "trainer":
        trainer = cfg.trainer
        if not trainer.checkpoint_dir:  # beside the run's other outputs
            trainer = replace(trainer, checkpoint_dir=str(Path(cfg.run_dir).resolve() / "checkpoints"))
        return TrainerServiceConfig(trainer=trainer, **process)
    raise ValueError(f"no service role {role!r}: one of rollout, reward, trainer")


def run_settings(cfg: RunConfig) -> dict[str, Settings]:
    """Per role, the settings a replica must have taken from its own config: those of the config
    :func:`role_config` gives it (``flowgrpo.config_digest.MUST_AGREE``)."""
    return {role: role_settings(role, role_config(cfg, role)) for role in ROLES}


def check_settings(info: common_pb2.ServiceInfo, expected: Mapping[str, Settings]) -> None:
    """Refuse (:class:`HandshakeError`) the replica whose READY handshake answered ``info`` when
    its settings are not ``expected`` of its role (or it sent none)."""
    if info.role in expected and (why := refusal(info, expected[info.role])) is not None:
        raise HandshakeError(why)


def service_configs(cfg: RunConfig, coordinator: str = "") -> dict[str, Any]:
    """Each replica's service config (replica id -> config) for the ``local`` and ``inprocess``
    launchers; ``coordinator``: the address they register with."""
    run_dir = Path(cfg.run_dir).resolve()

    def process(replica: str) -> dict[str, Any]:
        ready = str(run_dir / "services" / f"{replica}.ready.json")
        return {"server": ServerConfig(port=0, ready_file=ready), "replica_id": replica,
                "run_dir": str(run_dir), "log_format": "text", "coordinator": coordinator}  # fmt: skip

    out: dict[str, Any] = {}
    for i in range(cfg.launch.rollout_replicas):
        config = role_config(cfg, "rollout", **process(f"rollout-{i}"))
        if cfg.launch.rollout_devices:
            config = replace(config, rollout=replace(config.rollout, device=cfg.launch.rollout_devices[i]))
        out[f"rollout-{i}"] = config
    for i in range(cfg.launch.reward_replicas):
        out[f"reward-{i}"] = role_config(cfg, "reward", **process(f"reward-{i}"))
    out["trainer"] = role_config(cfg, "trainer", **process("trainer"))
    return out


async def launch(
    cfg: RunConfig, registry: CoordinatorService, report: StartupReport | None = None
) -> Services:
    """Start (or find) the run's services; ``registry`` is the coordinator's, already serving;
    ``report`` says on the console as each one is ready (and what the slow ones are doing)."""
    report = report or StartupReport(None, 0)
    if cfg.launch.launcher == "inprocess":
        services = await _launch_inprocess(cfg, registry, report)
    elif cfg.launch.launcher == "local":
        services = await _launch_local(cfg, registry.grpc_address, report)
    elif cfg.launch.trainer_address:
        services = await _connect(cfg, cfg.launch.rollout_addresses, cfg.launch.reward_addresses,
                                  cfg.launch.trainer_address, report)  # fmt: skip
        services.trainer_source = RemoteTrainer(cfg, registry)
    else:
        services = await _connect(cfg, *await _registered(cfg, registry), report)
        services.trainer_source = RemoteTrainer(cfg, registry)
    if services.trainer_source is not None:
        services._stop.append(services.trainer_source.close)
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


async def _launch_inprocess(cfg: RunConfig, registry: CoordinatorService, report: StartupReport) -> Services:
    from flowgrpo.services.reward.service import RewardService
    from flowgrpo.services.rollout.service import RolloutService
    from flowgrpo.services.trainer.service import TrainerService

    classes = {"rollout": RolloutService, "reward": RewardService, "trainer": TrainerService}
    services = Services([], [], None)  # type: ignore[arg-type]
    expected = run_settings(cfg)
    try:
        for rid, config in service_configs(cfg).items():
            role = rid.split("-")[0]
            actor = classes[role](config)
            report.expect([rid], "starting")
            await actor.launch()
            services._stop.append(actor.shutdown)
            replica = Replica(role, rid, "inprocess", actor, in_process=True)
            info = actor.info()
            services.infos.append(info)
            info.grpc_address = "inprocess"
            report.ready(info)
            check_settings(info, expected)  # the same config: they agree, but the check runs as elsewhere
            registry.join(info, beats=False)  # listed by RunStatus; actors here send no heartbeats
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


async def _launch_local(cfg: RunConfig, coordinator: str, report: StartupReport) -> Services:
    run_dir = Path(cfg.run_dir).resolve()
    (run_dir / "services").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    # launched, not deployed: a replica that hears nothing from its coordinator for lost_after_s
    # drains and exits (besides the pipe that tells it at once when the coordinator dies)
    configs = {rid: replace(c, orphan_after_s=cfg.launch.lost_after_s)
               for rid, c in service_configs(cfg, coordinator).items()}  # fmt: skip
    timeout = cfg.launch.start_timeout_s
    lifeline = Lifeline()
    try:
        for rid, config in configs.items():
            nproc = cfg.launch.trainer_nproc if rid == "trainer" else 1
            procs[rid] = spawn(rid, config, run_dir, nproc, lifeline)
        report.expect(procs)
        waits = [
            ready_address(rid, procs[rid], config, run_dir, timeout, report)
            for rid, config in configs.items()
        ]
        by_id = dict(zip(procs, await asyncio.gather(*waits), strict=True))
        rollouts = [a for r, a in by_id.items() if r.startswith("rollout")]
        rewards = [a for r, a in by_id.items() if r.startswith("reward")]
        # the ready file comes once the port is bound, before the service loads its model and
        # plug-ins: a process that dies after it is named at once, not by the handshake's timeout
        connect = _connect(cfg, rollouts, rewards, by_id["trainer"], report)
        services = await unless_one_exits(connect, procs, run_dir)
    except BaseException:
        await stop_groups(procs.values(), grace_s=10)
        lifeline.close()
        raise
    trainer = LocalTrainer(cfg, procs, configs["trainer"], run_dir, lifeline)
    services.trainer_source = trainer
    supervisor = asyncio.create_task(
        _supervise(procs, configs, run_dir, cfg.launch.restarts, lifeline, trainer)
    )

    async def stop_processes() -> None:
        supervisor.cancel()
        await asyncio.gather(supervisor, return_exceptions=True)
        await stop_groups(procs.values(), grace_s=60)
        lifeline.close()

    services._stop.insert(0, stop_processes)
    services._kill.append(lambda: kill_groups(procs.values()))
    return services


async def _supervise(  # noqa: PLR0917 (the launcher's parts)
    procs: dict[str, subprocess.Popen[bytes]],
    configs: dict[str, Any],
    run_dir: Path,
    restarts: int,
    lifeline: Lifeline,
    trainer: LocalTrainer,
) -> None:
    """Start a rollout or reward process that died again (``restarts`` times each); the new one
    registers with the coordinator and rejoins. A trainer that died is started again at once
    (:meth:`LocalTrainer.died`); the run takes it when it next calls the trainer."""
    started = dict.fromkeys(procs, 0)
    while True:
        await asyncio.sleep(0.5)
        trainer.died()
        for rid, proc in list(procs.items()):
            if rid == "trainer" or proc.poll() is None or started[rid] >= restarts:
                continue
            started[rid] += 1
            log.warning("%s exited with status %s; starting it again (%d of launch.restarts=%d); see %s", rid,
                        proc.returncode, started[rid], restarts, run_dir / "logs" / f"{rid}.log")  # fmt: skip
            procs[rid] = spawn(rid, configs[rid], run_dir, 1, lifeline)


class LocalTrainer:
    """The ``local`` launcher's trainer process, started again when it dies, at most
    ``launch.trainer_restarts`` times in a run. It is started again as soon as the supervisor sees
    it gone (its start overlaps the rollouts' work); the run loop takes the new one through
    :meth:`revive` when it next calls the trainer (``revive.py``)."""

    def __init__(
        self,
        cfg: RunConfig,
        procs: dict[str, subprocess.Popen[bytes]],
        config: Any,
        run_dir: Path,
        lifeline: Lifeline,
    ) -> None:
        self.cfg, self.procs, self.config, self.run_dir, self.lifeline = cfg, procs, config, run_dir, lifeline
        self.limit = cfg.launch.trainer_restarts
        self.restarts = 0
        self.serving = procs["trainer"]  # the process behind the run's trainer replica
        self._reviving = False  # revive() starts and stops processes itself meanwhile
        self._channels: list[grpc.aio.Channel] = []

    def died(self) -> None:
        """The process that served the run died: start the next one now (if any is left)."""
        proc = self.procs["trainer"]
        if self._reviving:
            return
        if proc is self.serving and proc.poll() is not None and self.restarts < self.limit:
            self._start(f"the trainer exited ({exit_status(proc.returncode)})")

    def _start(self, why: str) -> None:
        self.restarts += 1  # said on the console once it serves the run (revive.py); here: the log
        log.info("%s; starting it again (%d of launch.trainer_restarts=%d); see %s", why, self.restarts,
                 self.limit, self.run_dir / "logs" / "trainer.log")  # fmt: skip
        nproc = self.cfg.launch.trainer_nproc
        self.procs["trainer"] = spawn("trainer", self.config, self.run_dir, nproc, self.lifeline)

    async def gone(self, replica: Replica) -> bool:
        if self.serving.poll() is not None or self.procs["trainer"] is not self.serving:
            return True
        return not await _serving(replica.address)

    def ended(self) -> str:
        try:  # a call fails when the socket closes, a moment before the process is gone
            code: int | None = self.serving.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            code = None
        return exit_status(code) if code is not None else "it stopped answering; its process is replaced"

    async def revive(self, failed: Replica) -> Replica:
        self._reviving = True
        try:
            return await self._revive()
        finally:
            self._reviving = False

    async def _revive(self) -> Replica:
        last = ""
        while True:
            if self.procs["trainer"] is self.serving:  # nothing newer started: stop it, start one
                await stop_groups([self.serving], grace_s=0)
                if self.restarts >= self.limit:
                    raise RunError(f"launch.trainer_restarts={self.limit} restarts used{last}")
                self._start("the trainer is gone")
            proc = self.procs["trainer"]
            try:
                address = await ready_address("trainer", proc, self.config, self.run_dir,
                                               self.cfg.launch.start_timeout_s)  # fmt: skip
                replica, channel = await unless_one_exits(
                    _connect_one("trainer", address, self.cfg.launch.start_timeout_s, run_settings(self.cfg)),
                    {"trainer": proc}, self.run_dir,
                )  # fmt: skip
            except (
                ServiceStartError,
                TimeoutError,
                NotReadyError,
                HandshakeError,
                grpc.aio.AioRpcError,
            ) as error:
                last = f" (the last: {error})"
                log.warning("trainer restart %d of launch.trainer_restarts=%d failed: %s", self.restarts,
                            self.limit, error)  # fmt: skip
                self.serving = proc  # a failed start: stopped and replaced like a dead trainer
                continue
            self.serving = proc
            self._channels.append(channel)
            return replica

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


class RemoteTrainer:
    """A ``remote`` run's trainer comes back by itself (a restarted container, a rescheduled
    pod): the run waits ``launch.trainer_rejoin_timeout_s`` for one to answer the READY handshake,
    at ``launch.trainer_address`` or as it registers, at most ``launch.trainer_restarts`` times."""

    def __init__(self, cfg: RunConfig, registry: CoordinatorService) -> None:
        self.cfg, self.registry = cfg, registry
        self.limit = cfg.launch.trainer_restarts
        self.restarts = 0
        self._channels: list[grpc.aio.Channel] = []

    async def gone(self, replica: Replica) -> bool:
        return not await _serving(replica.address)

    def ended(self) -> str:
        return "it stopped answering"

    async def revive(self, failed: Replica) -> Replica:
        if self.restarts >= self.limit:
            raise RunError(f"launch.trainer_restarts={self.limit} restarts used")
        self.restarts += 1
        wait_s = self.cfg.launch.trainer_rejoin_timeout_s
        deadline = time.monotonic() + wait_s
        log.warning("the trainer at %s is gone; waiting up to %.0f s for one to %s", failed.address, wait_s,
                    f"answer at {self.cfg.launch.trainer_address}" if self.cfg.launch.trainer_address
                    else f"register at {self.registry.grpc_address}")  # fmt: skip
        expected, refused = run_settings(self.cfg), ""
        while (remaining := deadline - time.monotonic()) > 0:
            for address in self._candidates(failed):
                try:
                    replica, channel = await _connect_one("trainer", address, min(remaining, 3.0), expected)
                except HandshakeError as error:  # another role, another recipe's settings
                    if str(error) != refused:
                        log.warning("the trainer at %s cannot serve the run: %s", address, error)
                    refused = str(error)
                    continue
                except (NotReadyError, grpc.aio.AioRpcError, ValueError):
                    continue
                self._channels.append(channel)
                return replica
            self.registry.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.registry.changed.wait(), timeout=min(max(remaining, 0.01), 1.0))
        refusals = dict.fromkeys(why for why in (refused, *self.registry.refusals("trainer")) if why)
        raise RunError(
            f"no trainer answered within launch.trainer_rejoin_timeout_s={wait_s:.0f} s (start one with "
            f"coordinator={self.registry.grpc_address} and the same trainer.checkpoint_dir)"
            + "".join(f"; refused: {why}" for why in refusals)
        )

    def _candidates(self, failed: Replica) -> list[str]:
        """Where a trainer may answer: the configured address, else the registered trainers,
        the newest registration first (the failed one's address last: it may have restarted there)."""
        if self.cfg.launch.trainer_address:
            return [self.cfg.launch.trainer_address]
        members = sorted(
            (m for m in self.registry.members.values() if m.state == "up" and m.info.role == "trainer"),
            key=lambda m: m.last_seen, reverse=True,
        )  # fmt: skip
        addresses = [m.info.grpc_address for m in members]
        return sorted(addresses, key=lambda a: a == failed.address)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


async def _serving(address: str) -> bool:
    """Whether the server at ``address`` answers its health check as SERVING within 5 s."""
    try:
        return await health(address, timeout_s=5.0) == "SERVING"
    except grpc.aio.AioRpcError:
        return False


async def all_or_none(waits: Sequence[Awaitable[T]]) -> list[T]:
    """Every result of ``waits``, run together; the first failure cancels the others and is raised
    at once (a refused replica ends the start now, not when the slowest wait gives up)."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# --- already running ----------------------------------------------------------------------------


async def _registered(cfg: RunConfig, registry: CoordinatorService) -> tuple[list[str], list[str], str]:
    """The addresses of the replicas that registered, once ``launch.rollout_replicas`` rollouts,
    ``launch.reward_replicas`` rewards and a trainer have (more may join later)."""
    want = {"rollout": cfg.launch.rollout_replicas, "reward": cfg.launch.reward_replicas, "trainer": 1}
    deadline = time.monotonic() + cfg.launch.start_timeout_s
    log.info("waiting for %s to register at %s", _counts(want), registry.grpc_address)
    while True:
        have = {role: registry.up(role) for role in want}
        if all(len(have[role]) >= n for role, n in want.items()):
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            got = "; ".join(
                f"{role}: {', '.join(i.replica_id for i in have[role]) or 'none'}" for role in want
            )
            refused = "".join(f"; refused: {why}" for role in want for why in registry.refusals(role))
            raise TimeoutError(
                f"launch.launcher=remote waited launch.start_timeout_s={cfg.launch.start_timeout_s:.0f} s "
                f"for {_counts(want)} to register at {registry.grpc_address}; registered: {got}{refused}. "
                "Start the services with coordinator=<this address> and the run's recipe, or lower "
                "launch.rollout_replicas / reward_replicas"
            )
        registry.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(registry.changed.wait(), timeout=min(remaining, 1.0))
    if len(have["trainer"]) > 1:
        raise RuntimeError(
            f"more than one trainer registered: {', '.join(i.replica_id for i in have['trainer'])}"
        )
    return ([i.grpc_address for i in have["rollout"]], [i.grpc_address for i in have["reward"]],
            have["trainer"][0].grpc_address)  # fmt: skip


def _counts(want: dict[str, int]) -> str:
    return ", ".join(f"{n} {role}{'s' if n > 1 else ''}" for role, n in want.items())


async def _connect_one(
    role: str, address: str, timeout_s: float, expected: Mapping[str, Settings]
) -> tuple[Replica, grpc.aio.Channel]:
    """A replica that answered the READY handshake at ``address`` with the ``expected`` settings
    (:func:`check_settings`), and its channel."""
    channel = open_channel(address)
    try:
        info = await wait_ready(
            address, role=role, timeout_s=timeout_s, channel=channel, client_role="coordinator"
        )
        check_settings(info, expected)
    except BaseException:
        await channel.close()
        raise
    return Replica(role, info.replica_id, address, STUBS[role](channel)), channel


async def _connect(
    cfg: RunConfig, rollouts: Sequence[str], rewards: Sequence[str], trainer: str, report: StartupReport
) -> Services:
    services = Services([], [], None)  # type: ignore[arg-type]
    timeout, expected = cfg.launch.start_timeout_s, run_settings(cfg)
    targets = [("rollout", a) for a in rollouts] + [("reward", a) for a in rewards] + [("trainer", trainer)]

    async def ready(role: str, address: str) -> common_pb2.ServiceInfo:
        info = await report.wait_ready(address, role=role, timeout_s=timeout)
        check_settings(info, expected)
        return info

    infos = await all_or_none([ready(role, address) for role, address in targets])
    for (role, address), info in zip(targets, infos, strict=True):
        channel = open_channel(address)
        services._stop.append(channel.close)
        services.infos.append(info)
        _place(services, Replica(role, info.replica_id, address, STUBS[role](channel)))
    return services
