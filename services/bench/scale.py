"""What the coordinator costs as the replica count grows (``flowgrpo bench scale``).

For each N in ``--replicas``: the coordinator (this process: its registry server, run loop,
replica pool and prompt store, as ``flowgrpo train`` runs them with ``launch.launcher=remote``),
a real trainer process (the tiny BAGEL on the CPU), N simulated rollout replicas and N /
``--rollouts-per-reward`` simulated reward replicas. The replicas are the real services with the
load-test engine and scorer (``rollout.engine=synthetic``, scorer ``synthetic``), served
``--per-host`` to a process (``scale_host``), registering and beating over loopback like any
deployed replica. Every step draws one group of ``--group-size`` samples per rollout replica.

Measured per step (the first step, which opens every connection, is reported apart):
- the coordinator's CPU time (this process: the run loop, the registry, the bus store's thread)
  and its wall-clock overhead: the draw's wall time minus the simulated work on its critical
  path (one request's denoising delay plus the scoring queued on the busiest reward replica);
- the registry's load: heartbeats handled per second, late and missed beats, registrations;
- dispatch fairness: samples per rollout replica (min, max, stddev against the ideal share);
- the coordinator's memory (RSS), open file descriptors and threads;
- publication: the wall time of the weight load on every rollout (``publication/time_to_all_s``)
  and the bytes the trainer's bus store served for it (``publication/trainer_bytes_sent``).

``--kill-fraction F`` SIGKILLs F of the rollout replicas during step 2 (half of them while its
samples are being generated, half while the new weights are being loaded; they live in host
processes of their own) and checks that the step completes with no group lost, that the
coordinator declares every one of them lost, and that every surviving replica reports the last
policy version in its heartbeats.

    flowgrpo bench scale --replicas 1 8 64 256 1024 --out docs/scaling
    flowgrpo bench scale --replicas 256 --kill-fraction 0.1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import math
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from flowgrpo.bus import BusClient, serve_store
from flowgrpo.bus.config import SECRET_ENV
from flowgrpo.config import dump_yaml
from flowgrpo.configs.run import RunConfig, load_run_config
from flowgrpo.data import load_split
from flowgrpo.runtime import Service, ServiceServer
from flowgrpo.runtime.config import ServerConfig
from flowgrpo.runtime.security import TOKEN_ENV
from flowgrpo.services.bench.stats import write_json
from flowgrpo.services.coordinator.launch import launch, role_config, run_settings
from flowgrpo.services.coordinator.outputs import RunOutputs
from flowgrpo.services.coordinator.processes import terminate_groups
from flowgrpo.services.coordinator.registry import (
    CoordinatorService,
    RegistryLoad,
    raise_fd_limit,
    server_concurrency,
)
from flowgrpo.services.coordinator.run import Coordinator
from flowgrpo.services.coordinator.train import prepare_data, prepare_model, secrets_in_environment
from flowgrpo.v1 import common_pb2, coordinator_pb2_grpc

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "tiny_jpeg.yaml"
HOST_MODULE = "flowgrpo.services.bench.scale_host"
KILL_STEP = 2


@dataclass
class ScaleOptions:
    replicas: list[int] = field(default_factory=lambda: [1, 8, 64, 256, 1024])
    steps: int = 4  # the first opens connections; the others are the steady state
    per_host: int = 128  # simulated rollout replicas per host process
    rewards_per_host: int = 8  # each fetches from every rollout: its sockets, not its CPU, bound it
    rollouts_per_reward: int = 8
    group_size: int = 2
    step_delay_s: float = 0.05  # the load-test engine's delay per denoising step
    reward_delay_s: float = 0.002  # the load-test scorer's delay per image
    heartbeat_interval_s: float = 2.0
    lost_after_s: float = 10.0
    max_heartbeats_per_s: float = 50.0
    kill_fraction: float = 0.0
    start_timeout_s: float = 600.0
    fixes: bool = True  # False: the coordinator as before the fixes (fixed server concurrency and period)
    publication: str = "relay"  # publication.mode: "star" (every rollout from the trainer) or "relay"


@dataclass
class Snapshot:
    """The coordinator process at one step boundary."""

    wall: float
    cpu: float
    rss_mib: float
    fds: int
    threads: int
    load: RegistryLoad
    served: dict[str, int]


@dataclass
class Point:
    """One N: the steady-state steps' medians (and the first step apart)."""

    rollouts: int
    rewards: int
    start_s: float  # from the first host process started to every replica registered
    step_wall_s: float
    coordinator_cpu_s: float
    overhead_s: float
    critical_path_s: float
    first_step_cpu_s: float
    heartbeats_per_s: float
    heartbeats_expected_per_s: float  # every member (and the trainer) once per period
    heartbeat_interval_s: float  # the period in force at the end (it grows with the members)
    late_heartbeats: int
    missed_heartbeats: int
    registrations: int
    samples_min: float
    samples_max: float
    samples_stddev: float
    samples_ideal: float
    rss_mib: float
    fds: int
    threads: int
    train_s: float
    publication_time_to_all_s: float
    publication_trainer_bytes_sent: float
    dropped_groups: int
    retries: int
    kill: dict[str, Any] = field(default_factory=dict)


# --- the coordinator process, measured ------------------------------------------------------------


def snapshot(registry: CoordinatorService, served: dict[str, int]) -> Snapshot:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return Snapshot(
        wall=time.monotonic(),
        cpu=time.process_time(),
        rss_mib=int(status["VmRSS"].split()[0]) / 1024,
        fds=len(os.listdir("/proc/self/fd")),
        threads=int(status["Threads"]),
        load=replace(registry.load),
        served=dict(served),
    )


class MeasuredRegistry(CoordinatorService):
    """The registry, snapshotting the process each time the run loop reports a step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.snapshots: list[Snapshot] = []
        self.served: dict[str, int] = {}  # the pool's samples_served, once the pool exists
        self.on_report: list[Callable[[int], None]] = []

    def report(self, step: int, policy_version: int, metrics: dict[str, float]) -> None:
        super().report(step, policy_version, metrics)
        self.snapshots.append(snapshot(self, self.served))
        for hook in self.on_report:
            hook(step)


# --- the replicas ---------------------------------------------------------------------------------


@dataclass
class Host:
    proc: subprocess.Popen[bytes]
    ready: Path
    role: str
    first: int
    count: int
    victim: str = ""  # "generating", "loading": killed during step KILL_STEP (--kill-fraction)


def spawn_host(  # noqa: PLR0917 (a host's coordinates, each named)
    role: str, config: Path, first: int, count: int, folder: Path, victim: str = ""
) -> Host:
    ready = folder / f"{role}-host-{first}.json"
    log = open(folder / f"{role}-host-{first}.log", "ab")  # noqa: SIM115 (the child holds it)
    cmd = [sys.executable, "-m", HOST_MODULE, "--role", role, "--config", str(config),
           "--count", str(count), "--first", str(first), "--ready", str(ready)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    return Host(proc, ready, role, first, count, victim)


def spawn_hosts(  # noqa: PLR0917
    role: str, config: Path, total: int, per_host: int, folder: Path, victims: int = 0
) -> list[Host]:
    """``total`` replicas of ``role``; the last ``victims`` of them in host processes of their own,
    half to be killed while generating, half while loading weights."""
    hosts, first = [], 0
    groups = ((total - victims, ""), (victims - victims // 2, "generating"), (victims // 2, "loading"))
    for count, victim in groups:
        for start in range(0, count, per_host):
            n = min(per_host, count - start)
            hosts.append(spawn_host(role, config, first, n, folder, victim))
            first += n
    return hosts


def kill_hosts(hosts: Sequence[Host]) -> None:
    for host in hosts:
        os.killpg(host.proc.pid, signal.SIGKILL)


def host_ids(hosts: Sequence[Host]) -> list[str]:
    return [f"{h.role}-{h.first + i}" for h in hosts for i in range(h.count)]


# --- one point --------------------------------------------------------------------------------------


def point_config(n: int, opts: ScaleOptions, run_dir: Path, model: str, prompts: Path) -> RunConfig:
    rewards = max(1, n // opts.rollouts_per_reward)
    overrides = [
        f"run_dir={run_dir}", f"model.checkpoint={model}", f"data.prompts={prompts}",
        f"data.prompts_per_step={n}", f"data.group_size={opts.group_size}", "data.val_prompts=0",
        f"schedule.steps={opts.steps}", "schedule.eval_every=0", "schedule.save_every=0",
        "sampling.resolution=32", "sampling.deterministic=false", "sampling.num_points=4",
        "sampling.eval_num_points=4", "sampling.window_size=1", "sampling.window_range=[0,1]",
        "launch.launcher=remote", f"launch.rollout_replicas={n}", f"launch.reward_replicas={rewards}",
        f"launch.heartbeat_interval_s={opts.heartbeat_interval_s}",
        f"launch.lost_after_s={opts.lost_after_s}",
        f"launch.start_timeout_s={opts.start_timeout_s}", "logger.progress=none",
        "rollout.engine=synthetic", f"rollout.synthetic.step_delay_s={opts.step_delay_s}",
        "reward.scorers=[{name: synthetic, weight: 1.0}]", f"reward.synthetic_delay_s={opts.reward_delay_s}",
        "trainer.loss.micro_batch_size=64", "trainer.loss.mini_batches=1",
        "bus.transport=ipc", f"publication.mode={opts.publication}",
    ]  # fmt: skip
    return load_run_config(RECIPE, overrides)


def write_prompts(folder: Path, count: int) -> Path:
    """``count`` distinct training prompts (a step's groups must be distinct prompts) and a test file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.txt").write_text("".join(f"a picture of thing number {i}\n" for i in range(count)))
    (folder / "test.txt").write_text("a picture of a test\n")
    return folder


def critical_path_s(cfg: RunConfig, opts: ScaleOptions) -> float:
    """The simulated work one draw cannot go below: one request's denoising (every replica gets
    one group) and the scoring queued on the busiest reward replica."""
    steps = cfg.sampling.num_points - 1
    batches = math.ceil(opts.group_size / cfg.rollout.max_batch_samples)
    chunks_per_reward = math.ceil(cfg.launch.rollout_replicas / cfg.launch.reward_replicas)
    return steps * batches * opts.step_delay_s + chunks_per_reward * opts.group_size * opts.reward_delay_s


async def run_point(n: int, opts: ScaleOptions, work: Path, model: str) -> Point:
    run_dir = work / f"n{n}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a run folder with a state would resume, not run
    prompts = write_prompts(run_dir / "prompts", n * opts.steps)
    cfg = prepare_data(point_config(n, opts, run_dir, model, prompts))
    split = load_split(cfg.data.dataset, "train", model_path=cfg.model.checkpoint)
    registry = MeasuredRegistry(run_id=f"scale-{n}", heartbeat_interval_s=opts.heartbeat_interval_s,
                                lost_after_s=opts.lost_after_s,
                                max_heartbeats_per_s=opts.max_heartbeats_per_s if opts.fixes else math.inf,
                                settings=run_settings(cfg))  # fmt: skip
    members = cfg.launch.rollout_replicas + cfg.launch.reward_replicas + 1
    concurrency = (
        server_concurrency(cfg.server.concurrency, members) if opts.fixes else cfg.server.concurrency
    )
    server = ServiceServer(registry, replace(cfg.server, concurrency=concurrency), [
        Service("flowgrpo.v1.Coordinator", registry, coordinator_pb2_grpc.add_CoordinatorServicer_to_server)
    ])  # fmt: skip
    store = serve_store(cfg.bus)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        address = await server.start()
        hosts, trainer = start_replicas(cfg, opts, address, run_dir)
        procs = [trainer, *(h.proc for h in hosts)]
        started = time.monotonic()
        services = await launch(cfg, registry)
        start_s = time.monotonic() - started
        outputs = RunOutputs(cfg.run_dir, None, cfg.logger)
        try:
            coordinator = Coordinator(cfg, split, services.rollouts, services.rewards, services.trainer,
                                      store.store, outputs, registry)  # fmt: skip
            registry.served = coordinator.pool.samples_served
            victims = [h for h in hosts if h.victim]
            bytes_sent = TrainerBytes(services.infos)
            registry.on_report.append(lambda step: bytes_sent.sample())
            if victims:
                arm_kill(coordinator, registry, victims, cfg, opts)
            history = await coordinator.run()
            kill = await check_kill(registry, victims, hosts, history, cfg) if victims else {}
        finally:
            await services.shutdown()
            outputs.close()
        return summarise(n, cfg, opts, registry, history, bytes_sent.per_step(), start_s, kill)
    finally:
        await asyncio.to_thread(terminate_groups, procs, 30.0)
        if server.address:
            await server.stop(0)
        store.close()


def start_replicas(
    cfg: RunConfig, opts: ScaleOptions, address: str, run_dir: Path
) -> tuple[list[Host], subprocess.Popen[bytes]]:
    """The trainer (a ``flowgrpo serve trainer`` process) and the host processes of the replicas,
    all with ``coordinator=address``."""
    folder = run_dir / "services"
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for role in ("rollout", "reward", "trainer"):
        config = role_config(cfg, role, server=ServerConfig(port=0), replica_id=role, run_dir=str(run_dir),
                             coordinator=address, log_format="text", bus=cfg.bus)  # fmt: skip
        paths[role] = folder / f"{role}.yaml"
        dump_yaml(config, paths[role])
    log = open(folder / "trainer.log", "ab")  # noqa: SIM115 (the child holds it)
    cmd = [
        sys.executable,
        "-m",
        "flowgrpo.services.cli",
        "serve",
        "trainer",
        "--config",
        str(paths["trainer"]),
    ]
    trainer = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    victims = round(cfg.launch.rollout_replicas * opts.kill_fraction)
    hosts = spawn_hosts(
        "rollout", paths["rollout"], cfg.launch.rollout_replicas, opts.per_host, folder, victims
    )
    hosts += spawn_hosts("reward", paths["reward"], cfg.launch.reward_replicas, opts.rewards_per_host, folder)
    return hosts, trainer


class TrainerBytes:
    """The bytes the trainer's bus store has served, asked of the store itself (STAT) at each step."""

    def __init__(self, infos: Sequence[common_pb2.ServiceInfo]) -> None:
        self.endpoint = next(i.bus_endpoint for i in infos if i.role == "trainer")
        self.client = BusClient()
        self.samples: list[int] = []

    def sample(self) -> None:
        self.samples.append(self.client.stat(self.endpoint, timeout_s=30.0).served_bytes)

    def per_step(self) -> list[int]:
        self.client.close()
        return [b - a for a, b in zip(self.samples, self.samples[1:], strict=False)]


# --- failure at scale -----------------------------------------------------------------------------


def arm_kill(
    coordinator: Coordinator,
    registry: MeasuredRegistry,
    victims: list[Host],
    cfg: RunConfig,
    opts: ScaleOptions,
) -> None:
    """SIGKILL the first half of ``victims`` while step KILL_STEP's samples are being generated
    (half-way through the simulated denoising), the rest as its weight load starts."""
    generating = [h for h in victims if h.victim == "generating"]
    loading = [h for h in victims if h.victim == "loading"]
    loop = asyncio.get_running_loop()

    def on_report(step: int) -> None:
        if step == KILL_STEP - 1:  # step KILL_STEP is being drawn now
            delay = (cfg.sampling.num_points - 1) * opts.step_delay_s / 2
            loop.call_later(delay, kill_hosts, generating)

    registry.on_report.append(on_report)
    if loading:
        load = coordinator.pool.load_weights

        async def load_while_killing(
            update: common_pb2.WeightUpdate, publisher_gone: Callable[[], Awaitable[bool]] | None = None
        ) -> dict[str, float]:
            task = asyncio.ensure_future(load(update, publisher_gone))
            if update.policy_version == KILL_STEP:
                await asyncio.sleep(0)  # the loads are on their way
                kill_hosts(loading)
            return await task

        coordinator.pool.load_weights = load_while_killing  # type: ignore[method-assign]


async def check_kill(
    registry: MeasuredRegistry, victims: list[Host], hosts: list[Host], history: list[dict[str, float]],
    cfg: RunConfig,
) -> dict[str, Any]:  # fmt: skip
    """After the run: every victim declared lost, every survivor beating with the last version."""
    dead, alive = (
        set(host_ids(victims)),
        set(host_ids([h for h in hosts if h.role == "rollout" and not h.victim])),
    )
    last = int(history[-1]["training/policy_version"])
    deadline = time.monotonic() + registry.lost_after() + 3 * registry.interval_s
    while time.monotonic() < deadline:  # the watchdog's verdict, and one fresh beat from each survivor
        lost = {m for m, s in registry.members.items() if s.state == "lost"}
        current = {
            m for m, s in registry.members.items() if s.state == "up" and s.info.policy_version == last
        }
        if dead <= lost and alive <= current:
            break
        await asyncio.sleep(0.5)
    return {
        "killed": len(dead),
        "declared_lost": len(dead & lost),
        "survivors": len(alive),
        "survivors_on_last_version": len(alive & current),
        "last_version": last,
        "steps_completed": len(history),
        "dropped_groups": int(history[-1]["coordinator/dropped_groups"]),
        "samples_trained": [int(m["trainer/samples"]) for m in history],
        "samples_per_step": cfg.samples_per_step,
    }


# --- the figures ------------------------------------------------------------------------------------


def summarise(  # noqa: PLR0917 (what one point's figures come from)
    n: int, cfg: RunConfig, opts: ScaleOptions, registry: MeasuredRegistry, history: list[dict[str, float]],
    bytes_per_step: list[int], start_s: float, kill: dict[str, Any],
) -> Point:  # fmt: skip
    snaps = registry.snapshots  # [run start, after step 1, after step 2, ...]
    steady = list(range(2, len(snaps))) or [1]  # steps after the first
    cpu = [snaps[k].cpu - snaps[k - 1].cpu for k in steady]
    wall = [snaps[k].wall - snaps[k - 1].wall for k in steady]
    window = snaps[-1].wall - snaps[0].wall  # beats over the whole run: a step may be shorter than a beat
    beats = (snaps[-1].load.heartbeats - snaps[0].load.heartbeats) / window
    path = critical_path_s(cfg, opts)
    draw = [history[k - 1]["timing_s/gen_and_reward"] for k in steady]
    counts = [snaps[-1].served.get(f"rollout-{i}", 0) - snaps[steady[0] - 1].served.get(f"rollout-{i}", 0)
              for i in range(n)]  # fmt: skip
    per_step = [c / len(steady) for c in counts]
    last, first = snaps[-1], snaps[1]
    return Point(
        rollouts=n, rewards=cfg.launch.reward_replicas, start_s=start_s,
        step_wall_s=statistics.median(wall), coordinator_cpu_s=statistics.median(cpu),
        overhead_s=statistics.median(d - path for d in draw), critical_path_s=path,
        first_step_cpu_s=first.cpu - snaps[0].cpu,
        heartbeats_per_s=beats, heartbeats_expected_per_s=(n + cfg.launch.reward_replicas + 1)
        / registry.interval_s, heartbeat_interval_s=registry.interval_s,
        late_heartbeats=last.load.late_heartbeats, missed_heartbeats=last.load.missed_heartbeats,
        registrations=last.load.registrations,
        samples_min=min(per_step), samples_max=max(per_step), samples_stddev=statistics.pstdev(per_step),
        samples_ideal=cfg.samples_per_step / n,
        rss_mib=last.rss_mib, fds=max(s.fds for s in snaps), threads=max(s.threads for s in snaps),
        train_s=statistics.median(history[k - 1]["timing_s/train"] for k in steady),
        publication_time_to_all_s=statistics.median(history[k - 1]["timing_s/load_weights"] for k in steady),
        publication_trainer_bytes_sent=statistics.median(bytes_per_step[k - 1] for k in steady)
        if len(bytes_per_step) >= len(snaps) - 1 else math.nan,
        dropped_groups=int(history[-1]["coordinator/dropped_groups"]),
        retries=int(history[-1]["coordinator/retries"]), kill=kill,
    )  # fmt: skip


COLUMNS = (  # (header, Point field, format)
    ("rollouts", "rollouts", "d"), ("rewards", "rewards", "d"), ("start s", "start_s", ".1f"),
    ("step wall s", "step_wall_s", ".2f"), ("coord. CPU s/step", "coordinator_cpu_s", ".3f"),
    ("overhead s", "overhead_s", ".3f"), ("beat period s", "heartbeat_interval_s", ".1f"),
    ("heartbeats/s (expected)", "", ""),
    ("late beats", "late_heartbeats", "d"), ("missed beats", "missed_heartbeats", "d"),
    ("samples/replica min-max (ideal)", "", ""), ("stddev", "samples_stddev", ".2f"),
    ("RSS MiB", "rss_mib", ".0f"), ("fds", "fds", "d"), ("threads", "threads", "d"),
    ("publication s", "publication_time_to_all_s", ".3f"),
    ("trainer MiB sent", "publication_trainer_bytes_sent", ""),
)  # fmt: skip


def table(points: Sequence[Point]) -> str:
    rows = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for p in points:
        cells = []
        for header, name, spec in COLUMNS:
            if header.startswith("heartbeats/s"):
                cells.append(f"{p.heartbeats_per_s:.0f} ({p.heartbeats_expected_per_s:.0f})")
            elif header.startswith("samples/replica"):
                cells.append(f"{p.samples_min:g}-{p.samples_max:g} ({p.samples_ideal:g})")
            elif name == "publication_trainer_bytes_sent":
                cells.append(f"{p.publication_trainer_bytes_sent / 2**20:.1f}")
            else:
                cells.append(format(getattr(p, name), spec))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(points: Sequence[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [p.rollouts for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    axes[0].plot(n, [p.coordinator_cpu_s for p in points], "o-", label="coordinator CPU s / step")
    axes[0].plot(n, [max(p.overhead_s, 1e-3) for p in points], "s-", label="wall overhead s / step")
    axes[0].plot(n, [p.publication_time_to_all_s for p in points], "^-", label="publication s (star)")
    axes[1].plot(n, [p.heartbeats_per_s for p in points], "o-", label="heartbeats handled / s")
    axes[1].plot(n, [p.missed_heartbeats + 1e-1 for p in points], "x-", label="missed heartbeats (run)")
    axes[2].plot(n, [p.publication_trainer_bytes_sent / 2**20 for p in points], "o-",
                 label="MiB the trainer sends / step")  # fmt: skip
    axes[2].plot(n, [p.rss_mib for p in points], "s-", label="coordinator RSS MiB")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("rollout replicas N")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("flowgrpo bench scale: the coordinator against the replica count (2 CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the command ------------------------------------------------------------------------------------


@contextlib.contextmanager
def run_credentials() -> Iterator[None]:
    """A token and a bus secret for this benchmark's runs (every child inherits them), as
    ``flowgrpo train`` makes for the services it starts; the environment is restored after."""
    with secrets_in_environment([name for name in (TOKEN_ENV, SECRET_ENV) if not os.environ.get(name)]):
        yield


async def sweep(
    opts: ScaleOptions, work: Path, report: Callable[[Point], Awaitable[None] | None]
) -> list[Point]:
    model = prepare_model(load_run_config(RECIPE, [f"run_dir={work}"])).model.checkpoint
    points = []
    for n in opts.replicas:
        point = await run_point(n, opts, work, model)
        points.append(point)
        report(point)
    return points


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowgrpo bench scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    defaults = ScaleOptions()
    parser.add_argument("--replicas", type=int, nargs="+", default=defaults.replicas)
    for name in ("steps", "per_host", "rewards_per_host", "rollouts_per_reward", "group_size"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in (
        "step_delay_s",
        "reward_delay_s",
        "heartbeat_interval_s",
        "lost_after_s",
        "max_heartbeats_per_s",
        "kill_fraction",
    ):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument(
        "--no-fixes",
        dest="fixes",
        action="store_false",
        help="the coordinator as before the fixes: server.concurrency as is, a fixed heartbeat period",
    )
    parser.add_argument("--publication", choices=["relay", "star"], default=defaults.publication,
                        help="publication.mode: the relay tree (the default) or the star")  # fmt: skip
    parser.add_argument("--out", help="write OUT.md (the table), OUT.png (the plot) and OUT.json")
    parser.add_argument("--json", help="the figures as JSON (default with --out: OUT.json)")
    parser.add_argument("--profile", help="profile the coordinator's event loop (cProfile) into this file")
    parser.add_argument("--work-dir", help="run folders (default: a temporary folder, removed)")
    args = parser.parse_args(argv)
    opts = ScaleOptions(**{k: v for k, v in vars(args).items() if k in ScaleOptions.__dataclass_fields__})
    kill_steps = opts.kill_fraction and opts.steps < KILL_STEP + 1
    if opts.steps < 2 or not 0 <= opts.kill_fraction < 1 or kill_steps:
        parser.error(
            f"--steps must be >= 2 (>= {KILL_STEP + 1} with --kill-fraction) and --kill-fraction in [0, 1)"
        )
    print(f"flowgrpo bench scale: file descriptors up to {raise_fd_limit()}", flush=True)
    with run_credentials(), tempfile.TemporaryDirectory(prefix="flowgrpo-scale-") as tmp:
        work = Path(args.work_dir or tmp)
        show = lambda p: print(table([p]).splitlines()[-1], flush=True)  # noqa: E731
        if args.profile:  # the coordinator's event loop (its thread) under cProfile
            profiler = cProfile.Profile()
            points = profiler.runcall(asyncio.run, sweep(opts, work, show))
            pstats.Stats(profiler).sort_stats("tottime").dump_stats(args.profile)
            pstats.Stats(args.profile).sort_stats("tottime").print_stats(25)
        else:
            points = asyncio.run(sweep(opts, work, show))
    print(table(points))
    out = Path(args.out) if args.out else None
    if out is not None:
        out.with_suffix(".md").write_text(table(points) + "\n")
        plot(points, out.with_suffix(".png"))
    report = {"options": asdict(opts), "points": points, "metrics": [metrics(p) for p in points]}
    write_json(args.json or (out.with_suffix(".json") if out else None), report)
    failed = [p for p in points if p.kill and not kill_passed(p.kill)]
    for p in failed:
        print(f"N={p.rollouts}: failure at scale NOT survived: {json.dumps(p.kill)}", file=sys.stderr)
    return 1 if failed else 0


def metrics(point: Point) -> dict[str, float]:
    """A point's publication figures under the metric names the relay's benchmark reports too."""
    return {
        "rollout_replicas": point.rollouts,
        "publication/time_to_all_s": point.publication_time_to_all_s,
        "publication/trainer_bytes_sent": point.publication_trainer_bytes_sent,
    }


def kill_passed(kill: dict[str, Any]) -> bool:
    return (
        kill["declared_lost"] == kill["killed"]
        and kill["survivors_on_last_version"] == kill["survivors"]
        and kill["dropped_groups"] == 0
        and all(s == kill["samples_per_step"] for s in kill["samples_trained"])
    )
