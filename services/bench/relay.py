"""Weight publication, star against relay, at N replicas each behind a link of its own capped at
``--rate-mbit`` (``flowgrpo bench relay``).

Every replica, and the trainer, is a process in a network namespace of its own, joined to one
bridge by a veth pair with a ``tc`` token bucket (tbf) on both ends: each host's link carries at
most the rate each way, as a NIC would. The namespaces are the benchmark's own (a user namespace:
no root needed; ``unshare``, ``ip`` and ``tc`` must exist). No shared memory between replicas
(separate hosts share none): every byte crosses the links, over the real bus with CURVE.

The replicas are simulated: torch-free processes that answer the Rollout service's
``LoadWeights`` with the rollout's own relay code (``flowgrpo.services.rollout.relay``: the
request's checks, the fetch from the nearest holder, the kept copy), without a model to apply
the bytes to. The coordinator's side is the real one: ``ReplicaPool.load_weights`` with the
relay plan, over gRPC. The trainer's store holds each version under ``weights/v<N>`` as the
Publisher does; the bytes it sent are its store's own counter.

Payloads are the LoRA r64 update (0.3 GB) and the full gen path (13 GB bf16) divided by
``--scale`` (default 2000) to fit 2 cores; figures at the real sizes are the formula's
(star N S / B, relay depth k S / B), printed as such, never as measured.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
import numpy as np
import zmq

from flowgrpo.bus import BusClient, BusConfig, BusServer, TensorBytes, TensorRef, TensorStore
from flowgrpo.bus.config import SECRET_ENV, SECRET_FILE_ENV
from flowgrpo.bus.relay import Keeper, Source, version_tag
from flowgrpo.configs.publication import PublicationConfig
from flowgrpo.fields import FieldError
from flowgrpo.services.bench.stats import MIN_REPEATS, Figure, ratio, repeats_arg, write_json
from flowgrpo.services.coordinator.relay import Member, plan_relay
from flowgrpo.services.rollout import relay
from flowgrpo.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

INSIDE_ENV = "FLOWGRPO_BENCH_RELAY_NS"  # set in the benchmark's own user and network namespace
REAL_BYTES = {"lora": int(0.3e9), "full": int(13e9)}  # LoRA r64, full gen path bf16
TENSORS_PER_VERSION = 8
SUBNET = "10.77"
BRIDGE_IP = f"{SUBNET}.255.254"
NODE_TIMEOUT_S = 120.0
MAX_REPLICAS = 4000  # addresses of one /16 (SUBNET.x.y); memory runs out long before
T = TypeVar("T")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not 1 <= args.replicas <= MAX_REPLICAS or not all(1 <= k <= 64 for k in args.fanouts):
        parser.error(f"--replicas must be 1..{MAX_REPLICAS} and every --fanouts 1..64")
    if args.rate_mbit <= 0 or args.scale <= 0 or args.real_gbit <= 0:
        parser.error("--rate-mbit, --scale and --real-gbit must be > 0")
    if args.node:
        return asyncio.run(_node(args))
    if os.environ.get(INSIDE_ENV) != "1":
        return _reexec_in_namespaces(argv if argv is not None else sys.argv[1:])
    report = _orchestrate(args)
    _print(report)
    write_json(args.json, report)
    if args.markdown:
        Path(args.markdown).write_text(_markdown(report, args))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowgrpo bench relay", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=64, help="simulated rollout replicas (N)")
    p.add_argument("--fanouts", type=int, nargs="+", default=[2, 4], help="relay fan-outs k to measure")
    # 2 cores simulate 65 hosts: the links' sum in the widest wave (N / 2 x the rate, CURVE both
    # ends) must stay within what the cores encrypt and copy, or the CPU, not the links, is measured
    p.add_argument("--rate-mbit", type=float, default=50.0, help="each link's cap, each way (tc tbf)")
    p.add_argument("--scale", type=float, default=2000.0, help="payloads are the real sizes / scale")
    p.add_argument("--payloads", nargs="+", choices=sorted(REAL_BYTES), default=["lora", "full"])
    p.add_argument("--repeats", type=repeats_arg, default=MIN_REPEATS, help="publications per figure")
    p.add_argument("--real-gbit", type=float, default=25.0, help="the link the formula extrapolates to")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as a Markdown page")
    p.add_argument("--node", help=argparse.SUPPRESS)  # a replica ("rN") or the trainer ("trainer")
    p.add_argument("--ip", help=argparse.SUPPRESS)
    p.add_argument("--versions", default="", help=argparse.SUPPRESS)  # trainer: "bytes,bytes,..."
    return p


# --- the namespaces ---------------------------------------------------------------------------------


def _reexec_in_namespaces(argv: Sequence[str]) -> int:
    missing = [t for t in ("unshare", "ip", "tc", "nsenter") if _tool(t) is None]
    if missing:
        raise SystemExit(f"flowgrpo bench relay needs {', '.join(missing)} (util-linux, iproute2)")
    env = {**os.environ, INSIDE_ENV: "1"}
    cmd = [str(_tool("unshare")), "-rn", sys.executable, "-m", "flowgrpo.services.bench.relay", *argv]
    return subprocess.call(cmd, env=env)


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


def _sh(*cmd: str) -> None:
    subprocess.run([str(_tool(cmd[0])), *cmd[1:]], check=True, capture_output=True)


def _ip_of(index: int) -> str:
    return f"{SUBNET}.{index // 250}.{index % 250 + 1}"


def _tbf(device: str, rate_mbit: float) -> list[str]:
    burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 / 250))  # one tick of a 250 Hz kernel at least
    # a queue of up to 1 s at the rate, as switch buffers hold: a shorter one tail-drops whole flows
    # into seconds of TCP back-off, and this kernel has no fair-queueing qdisc to put inside tbf
    return ["tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{rate_mbit}mbit",
            "burst", str(burst), "latency", "1s"]  # fmt: skip


def _wait_for_own_namespace(pid: int) -> None:
    """``unshare -n`` makes the namespace after it started: a link moved in before lands in ours."""
    deadline = time.monotonic() + NODE_TIMEOUT_S
    while os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net"):
        if time.monotonic() > deadline:
            raise SystemExit(f"benchmark node {pid} made no network namespace in {NODE_TIMEOUT_S:.0f} s")
        time.sleep(0.01)


def _make_bridge() -> None:
    _sh("ip", "link", "set", "lo", "up")
    _sh("ip", "link", "add", "br0", "type", "bridge")
    _sh("ip", "addr", "add", f"{BRIDGE_IP}/16", "dev", "br0")
    _sh("ip", "link", "set", "br0", "up")


def _wire(index: int, pid: int, rate_mbit: float) -> None:
    """The node's link: a veth pair, one end in its namespace, both ends capped."""
    host_end, node_end = f"vh{index}", f"vn{index}"
    _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
    _sh("ip", "link", "set", node_end, "netns", str(pid))
    _sh("ip", "link", "set", host_end, "master", "br0")
    _sh("ip", "link", "set", host_end, "up")
    _sh(*_tbf(host_end, rate_mbit))  # towards the node: its download
    inside = ["nsenter", "-t", str(pid), "-n"]
    _sh(*inside, str(_tool("ip")), "link", "set", "lo", "up")
    _sh(*inside, str(_tool("ip")), "addr", "add", f"{_ip_of(index)}/16", "dev", node_end)
    _sh(*inside, str(_tool("ip")), "link", "set", node_end, "up")
    _sh(*inside, *[str(_tool("tc")), *_tbf(node_end, rate_mbit)[1:]])  # from the node: its upload


# --- one node (a simulated rollout replica, or the trainer's store) --------------------------------


class RelayNode(rollout_pb2_grpc.RolloutServicer):
    """LoadWeights as the rollout runs it, without a model: checks, fetch, kept copy, report."""

    def __init__(self, name: str, server: BusServer, config: BusConfig) -> None:
        self.name, self.server = name, server
        self.client = BusClient(config, local_stores=False)
        self.keeper = Keeper(server.store, name)
        self.version = 0

    async def LoadWeights(
        self, request: rollout_pb2.LoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.LoadWeightsResponse:
        started = time.perf_counter()
        own = Source(self.server.endpoint, self.server.store.store_id)
        try:
            sources, stall_s = relay.check_sources(request, own)
        except FieldError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        version = request.update.policy_version
        if version <= self.version:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"version {version} is not newer")
        refs = [TensorRef.from_proto(t.ref) for t in request.update.tensors]
        keeper = self.keeper if request.relay else None
        relayed, held = await asyncio.to_thread(
            relay.fetch_and_keep, self.client, keeper, version, refs, sources=sources, stall_s=stall_s
        )
        self.version = version
        elapsed = time.perf_counter() - started
        response = rollout_pb2.LoadWeightsResponse(policy_version=version, load_s=elapsed, fetch_s=elapsed)
        relay.report(response, relayed, held)
        return response

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        raise NotImplementedError("a relay benchmark replica only loads weights")

    async def Release(
        self, request: rollout_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ReleaseResponse:
        raise NotImplementedError("a relay benchmark replica only loads weights")


def _node_bus(ip: str) -> BusConfig:
    # what a rollout runs with, but: no shared memory (the namespaces share /dev/shm, hosts do not)
    # and a fetch deadline long enough for the star's slowest replica
    return BusConfig(host=ip, shm=False, max_bytes=1 << 34, fetch_timeout_s=1800.0)


async def _node(args: argparse.Namespace) -> int:
    sys.stdin.readline()  # the orchestrator's "go": our link is in place
    _wait_for_address(args.ip)
    config = _node_bus(args.ip)
    server = _serve_store(config)
    ready: dict[str, Any] = {"bus": server.endpoint, "store_id": server.store.store_id}
    grpc_server = None
    if args.node == "trainer":
        sizes = [int(s) for s in args.versions.split(",") if s]
        ready["updates"] = [_publish(server.store, v + 1, n) for v, n in enumerate(sizes)]
    else:
        grpc_server = grpc.aio.server()
        rollout_pb2_grpc.add_RolloutServicer_to_server(RelayNode(args.node, server, config), grpc_server)
        port = _retry(lambda: grpc_server.add_insecure_port(f"{args.ip}:0"))  # the benchmark's own network
        await grpc_server.start()
        ready["grpc"] = f"{args.ip}:{port}"
    print(json.dumps(ready), flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the orchestrator closes our stdin
    if grpc_server is not None:
        await grpc_server.stop(0)
    server.close()
    return 0


def _serve_store(config: BusConfig) -> BusServer:
    def serve() -> BusServer:
        store = TensorStore(config)
        try:
            return BusServer(store, owns_store=True)
        except BaseException:
            store.close()
            raise

    return _retry(serve)


def _retry(bind: Callable[[], T]) -> T:
    """A bind, again for a few seconds: a fresh address refused binds for a moment under load."""
    deadline = time.monotonic() + 10.0
    while True:
        try:
            return bind()
        except (zmq.ZMQError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _wait_for_address(ip: str) -> None:
    """The orchestrator moves our link in and addresses it after we started: wait for it."""
    deadline = time.monotonic() + NODE_TIMEOUT_S
    while True:
        try:
            with socket.socket() as probe:
                probe.bind((ip, 0))
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"no address {ip} in this namespace after {NODE_TIMEOUT_S:.0f} s") from None
            time.sleep(0.05)


def _publish(store: TensorStore, version: int, nbytes: int) -> str:
    """A version of ``nbytes`` random bf16 bytes in TENSORS_PER_VERSION tensors, as the Publisher
    puts it; the WeightUpdate, serialised (protobuf) and base64-encoded."""
    tag = version_tag(version)
    update = common_pb2.WeightUpdate(policy_version=version, kind="gen_path")
    rng = np.random.default_rng(version)
    each = max(1, nbytes // 2 // TENSORS_PER_VERSION)
    for i in range(TENSORS_PER_VERSION):
        data = TensorBytes(rng.integers(0, 1 << 16, each, dtype=np.uint16), "bfloat16", (each,))
        ref = store.put(f"{tag}/t{i}.weight", "weights", data, policy_version=version, tag=tag)
        update.tensors.append(common_pb2.NamedTensor(name=f"t{i}.weight", ref=ref.to_proto()))
    return base64.b64encode(update.SerializeToString()).decode()


# --- the orchestrator (the coordinator's side) -----------------------------------------------------


@dataclass
class Run:
    payload: str
    mode: str  # "star" or "relay k=K"
    fanout: int
    seconds: list[float] = field(default_factory=list)
    trainer_bytes: list[int] = field(default_factory=list)
    depth: int = 0
    fallbacks: int = 0
    failed: int = 0


def _orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    for name in (SECRET_ENV, SECRET_FILE_ENV):
        os.environ.pop(name, None)
    os.environ[SECRET_ENV] = secrets.token_urlsafe(32)  # CURVE on every link, as across hosts
    _make_bridge()
    modes = [("star", 0)] + [(f"relay k={k}", k) for k in args.fanouts]
    sizes = {p: max(1024, int(REAL_BYTES[p] / args.scale)) for p in args.payloads}
    versions = [sizes[p] for p in args.payloads for _ in range(args.repeats) for _ in modes]
    nodes = _start_nodes(args, versions)
    try:
        updates = [common_pb2.WeightUpdate.FromString(base64.b64decode(u)) for u in nodes[0][1]["updates"]]
        runs = asyncio.run(_publish_all(args, nodes[1:], updates, modes, sizes))
    finally:
        for proc, _ in nodes:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc, _ in nodes:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return _report(args, sizes, runs)


def _start_nodes(
    args: argparse.Namespace, versions: list[int]
) -> list[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """The trainer (index 0) and the replicas, each in a new network namespace, wired and ready."""
    procs: list[subprocess.Popen[str]] = []
    names = ["trainer"] + [f"r{i}" for i in range(args.replicas)]
    for index, name in enumerate(names):
        cmd = [str(_tool("unshare")), "-n", sys.executable, "-m", "flowgrpo.services.bench.relay",
               "--node", name, "--ip", _ip_of(index), "--versions", ",".join(map(str, versions))]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for index, proc in enumerate(procs):
        _wait_for_own_namespace(proc.pid)
        _wire(index, proc.pid, args.rate_mbit)
        assert proc.stdin is not None
        proc.stdin.write("go\n")  # its link is ready: it may bind now
        proc.stdin.flush()
    ready = []
    for name, proc in zip(names, procs, strict=True):
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"benchmark node {name} exited with {proc.wait()} before it was ready")
        ready.append((proc, json.loads(line)))
    return ready


async def _publish_all(
    args: argparse.Namespace,
    replicas: list[tuple[subprocess.Popen[str], dict[str, Any]]],
    updates: list[common_pb2.WeightUpdate],
    modes: list[tuple[str, int]],
    sizes: dict[str, int],
) -> list[Run]:
    # the coordinator's pool: imported here, so that the 64 node processes start without it
    from flowgrpo.configs.run import LaunchConfig
    from flowgrpo.services.coordinator.handles import Replica
    from flowgrpo.services.coordinator.pool import ReplicaPool

    no_proxy = [("grpc.enable_http_proxy", 0)]  # the replicas are on the benchmark's own network
    channels = [grpc.aio.insecure_channel(info["grpc"], options=no_proxy) for _, info in replicas]
    handles = [Replica("rollout", f"r{i}", info["grpc"], rollout_pb2_grpc.RolloutStub(c))
               for i, ((_, info), c) in enumerate(zip(replicas, channels, strict=True))]  # fmt: skip
    runs = {(p, m): Run(p, m, k) for p in args.payloads for m, k in modes}
    client = BusClient(BusConfig(shm=False), local_stores=False)
    pending = iter(updates)
    try:
        for payload in args.payloads:
            for repeat in range(args.repeats):
                for mode, fanout in modes:
                    update = next(pending)
                    publication = PublicationConfig(
                        mode="star" if fanout == 0 else "relay", relay_fanout=max(1, fanout)
                    )
                    pool = ReplicaPool(LaunchConfig(request_timeout_s=3600), handles, [], handles[0], print,
                                       publication=publication)  # fmt: skip
                    pool.store_stats = client.stat
                    metrics = await pool.load_weights(update)
                    run = runs[(payload, mode)]
                    run.seconds.append(metrics["publication/time_to_all_s"])
                    run.trainer_bytes.append(int(metrics.get("publication/trainer_bytes_sent", -1)))
                    run.depth, run.fallbacks = (
                        int(metrics["publication/depth"]),
                        run.fallbacks + int(metrics["publication/fallbacks"]),
                    )
                    run.failed += int(metrics["publication/failed_replicas"])
                    copies = run.trainer_bytes[-1] / sizes[payload]
                    print(f"  {payload} {mode} #{repeat + 1}: {run.seconds[-1]:.2f} s, the trainer sent "
                          f"{copies:.1f} copies", flush=True)  # fmt: skip
    finally:
        client.close()
        for channel in channels:
            await channel.close()
    return list(runs.values())


# --- the report -----------------------------------------------------------------------------------


def _report(args: argparse.Namespace, sizes: dict[str, int], runs: list[Run]) -> dict[str, Any]:
    rows = []
    real_bytes_per_s = args.real_gbit * 1e9 / 8
    for run in runs:
        seconds = Figure.of(run.seconds)
        star = next(r for r in runs if r.payload == run.payload and r.fanout == 0)
        rows.append({
            "payload": run.payload, "bytes": sizes[run.payload], "replicas": args.replicas, "mode": run.mode,
            "fanout": run.fanout, "depth": run.depth, "time_to_all_s": seconds,
            "trainer_bytes_sent": Figure.of(run.trainer_bytes, "B"),
            "trainer_copies": Figure.of([b / sizes[run.payload] for b in run.trainer_bytes], "copies"),
            "star_over_this": ratio(Figure.of(star.seconds), seconds),
            "formula_time": _formula_s(run, sizes[run.payload], args.replicas, args.rate_mbit * 1e6 / 8),
            "real_formula_time": _formula_s(run, REAL_BYTES[run.payload], args.replicas, real_bytes_per_s),
            "fallbacks": run.fallbacks, "failed_replicas": run.failed,
        })  # fmt: skip
    return {"replicas": args.replicas, "rate_mbit": args.rate_mbit, "scale": args.scale,
            "real_gbit": args.real_gbit, "repeats": args.repeats, "rows": rows}  # fmt: skip


def _formula_s(run: Run, nbytes: int, replicas: int, bytes_per_s: float) -> float:
    """Bandwidth alone: the star's trainer link sends N copies; each relay wave, k per holder."""
    if run.fanout == 0:
        return replicas * nbytes / bytes_per_s
    depth = plan_relay([Member(f"r{i}", f"h{i}") for i in range(replicas)], run.fanout).max_depth
    return depth * run.fanout * nbytes / bytes_per_s


def _copies(figure: Figure) -> str:
    """The median, and the most when a fallback to the trainer made one publication send more."""
    return f"{figure.median:.1f}" + (f" (most {figure.max:.1f})" if figure.max > figure.median else "")


def _print(report: dict[str, Any]) -> None:
    print(f"\nN = {report['replicas']} replicas, each link capped at {report['rate_mbit']:g} Mbit/s "
          f"each way; payloads = real sizes / {report['scale']:g}")  # fmt: skip
    print(f"{'payload':8} {'mode':10} {'depth':>5} {'trainer sent':>14} {'time to all (s)':>22} "
          f"{'formula (s)':>11} {'star/this':>10}")  # fmt: skip
    for row in report["rows"]:
        t: Figure = row["time_to_all_s"]
        print(f"{row['payload']:8} {row['mode']:10} {row['depth']:>5} "
              f"{row['trainer_copies'].median:>7.1f} copies {t.median:>8.2f} [{t.min:.2f}-{t.max:.2f}] "
              f"{row['formula_time']:>11.2f} {row['star_over_this'].median:>9.1f}x")  # fmt: skip


def _markdown(report: dict[str, Any], args: argparse.Namespace) -> str:
    command = (
        f"flowgrpo bench relay --replicas {args.replicas} --fanouts {' '.join(map(str, args.fanouts))} "
        f"--rate-mbit {args.rate_mbit:g} --scale {args.scale:g} --repeats {args.repeats}"
    )
    scale = report["scale"]
    lora_mb, full_mb = REAL_BYTES["lora"] / scale / 1e6, REAL_BYTES["full"] / scale / 1e6
    lines = [
        "# Weight publication: star against relay",
        "",
        f"Produced by `{command}` on the 2-core reference machine; the design is in "
        "[ARCHITECTURE.md](ARCHITECTURE.md#weight-publication-relay).",
        "",
        f"N = {report['replicas']} simulated rollout replicas and the trainer, each a process in a network "
        f"namespace of its own behind a veth link capped at {report['rate_mbit']:g} Mbit/s each way "
        "(tc tbf), every byte over the bus with CURVE, no shared memory. Payloads are the real ones "
        f"divided by {scale:g} (LoRA r64 0.3 GB -> {lora_mb:.2f} MB, full gen path 13 GB -> "
        f"{full_mb:.1f} MB). Time to all: from the first LoadWeights sent to the last answered, median "
        f"[min-max] of {report['repeats']} publications. Trainer sent: its store's own count of the "
        "bytes it served, in copies of the payload (median). Formula: bandwidth alone (star N S / B, relay "
        "depth k S / B). Fallbacks: holders a replica gave up (nothing for `relay_stall_s`, 10 s) "
        "and fetched past, over the publications of the row.",
        "",
        "| payload | mode | depth | trainer sent, copies | time to all, s | formula, s | star / this "
        "| fallbacks |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        t: Figure = row["time_to_all_s"]
        lines.append(f"| {row['payload']} ({row['bytes'] / 1e6:.2f} MB) | {row['mode']} | {row['depth']} | "
                     f"{_copies(row['trainer_copies'])} | {t.median:.2f} [{t.min:.2f}-{t.max:.2f}] | "
                     f"{row['formula_time']:.2f} | {row['star_over_this'].median:.1f}x | "
                     f"{row['fallbacks']} |")  # fmt: skip
    lines += [
        "",
        f"Extrapolated by the formula only (not measured): the real payloads at N = {report['replicas']} "
        f"on {report['real_gbit']:g} Gbit/s links:",
        "",
        "| payload | mode | formula, s |",
        "|---|---|---:|",
    ]
    for row in report["rows"]:
        lines.append(f"| {row['payload']} ({REAL_BYTES[row['payload']] / 1e9:g} GB) | {row['mode']} | "
                     f"{row['real_formula_time']:.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
