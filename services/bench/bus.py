"""Data-bus throughput and latency against memcpy, measured in one run (``flowgrpo bench bus``).

A producer store runs in a child process per transport and holds one float32 tensor per size;
this process fetches each tensor once as a warm-up, then ``--repeats`` (>= 3) times, and reports
the median with its range (services/bench/stats.py), as GB/s and as a ratio to numpy memcpy
(``np.copyto`` into a preallocated array) of the same size, timed here, now, the same way.

Rows:
- ``ipc``, ``tcp``: socket frames received straight into a new array (shared memory off);
- ``shm``: same host, the consumer copies the mapped segment into its own preallocated array;
- ``shm-view``: same host, in place: the fetch maps the segment copy-on-write (a private,
  writable array without a copy) and every page is touched once.

- ``ipc+curve``, ``tcp+curve``: the same transfers from a producer with a bus secret: CURVE
  handshake once, then every frame encrypted and authenticated (XSalsa20-Poly1305).

Small messages: PING and a 1-key 64-byte FETCH round trip, p50/p99 in microseconds, beside
the round trip of a bare pyzmq DEALER/ROUTER echo in the producer process: the floor that
thread wake-ups put under any ZMQ message on this machine; with and without CURVE.

The cost of authentication is printed as the ratio of each ``+curve`` row to its plain row.
The secret is made for the run and reaches the producers through their environment.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

from flowgrpo.bus import BusClient, BusConfig, TensorRef, serve_store
from flowgrpo.bus.config import SECRET_ENV, SECRET_FILE_ENV
from flowgrpo.services.bench.stats import MIN_REPEATS, Figure, ratio, repeats_arg, timed, write_json

MiB = 1 << 20
GOALS = {"shm": 0.5, "tcp": 0.2}  # ratio to memcpy at 64 MiB on the reference 2-core machine
LATENCY_GOAL_US = 200.0
_PAGE = 4096


@dataclass
class Row:
    size_mib: int
    path: str
    seconds: Figure  # one fetch of the tensor, made usable the way the path says
    gb_s: Figure  # size / seconds
    ratio: Figure  # memcpy's seconds / these seconds (memcpy of the same size, timed just before)


@dataclass
class Latency:
    transport: str
    message: str
    round_trip_us: Figure  # its median is the p50
    p99_us: float


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.producer:
        return _produce(args.producer, args.sizes_mib)
    for name in (SECRET_ENV, SECRET_FILE_ENV):  # each producer and client gets its own
        os.environ.pop(name, None)
    secret = secrets.token_urlsafe(32)
    with (
        _Producer("ipc", args.sizes_mib) as ipc,
        _Producer("tcp", args.sizes_mib) as tcp,
        _Producer("ipc", args.sizes_mib, secret) as ipc_curve,
        _Producer("tcp", args.sizes_mib, secret) as tcp_curve,
    ):
        producers = {"ipc": ipc, "tcp": tcp, "ipc+curve": ipc_curve, "tcp+curve": tcp_curve}
        rows = _throughput(producers, secret, args.sizes_mib, args.repeats)
        latencies = _latencies(producers, secret, args.latency_n)
    _print(rows, latencies)
    write_json(args.json, _report(rows, latencies))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowgrpo bench bus", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256], help="tensor sizes")
    p.add_argument("--repeats", type=repeats_arg, default=5,
                   help=f"timed fetches per size and path, after a warm-up (>= {MIN_REPEATS})")  # fmt: skip
    p.add_argument("--latency-n", type=repeats_arg, default=2000, help="timed round trips per latency figure")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--producer", choices=["ipc", "tcp"], help=argparse.SUPPRESS)  # the child process
    return p


# --- the producer process ---------------------------------------------------------------------


def _produce(transport: str, sizes_mib: Sequence[int]) -> int:
    """Serve one tensor per size plus a 64-byte one and a bare pyzmq echo socket (the latency
    floor of this machine); print their addresses; serve until stdin closes."""
    rng = np.random.default_rng(0)
    # A secret in the environment (set by _Producer) makes this store CURVE-only.
    with serve_store(BusConfig(transport="ipc" if transport == "ipc" else "tcp")) as server:
        refs = {
            str(mib): server.store.put(f"t{mib}", "weights", rng.random(mib * MiB // 4, np.float32))
            for mib in sizes_mib
        }
        refs["small"] = server.store.put("small", "weights", rng.random(16, np.float32))
        echo = _start_echo(server.endpoint.replace(".sock", ".echo.sock") if transport == "ipc" else None)
        print(json.dumps({"refs": {k: r.to_dict() for k, r in refs.items()}, "echo": echo}), flush=True)
        sys.stdin.read()
        if echo.startswith("ipc://"):  # the echo socket is never closed (its thread blocks in recv)
            Path(echo.removeprefix("ipc://")).unlink(missing_ok=True)  # before the store's folder goes
    return 0


def _start_echo(ipc_endpoint: str | None) -> str:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(ipc_endpoint or "tcp://127.0.0.1:*")

    def echo() -> None:
        while True:
            sock.send_multipart(sock.recv_multipart())

    threading.Thread(target=echo, daemon=True).start()
    return ipc_endpoint or sock.getsockopt_string(zmq.LAST_ENDPOINT)


class _Producer:
    """A producer child process and the refs it printed; ended by closing its stdin. With a
    ``secret`` (passed in its environment, never on its command line) it serves CURVE only."""

    def __init__(self, transport: str, sizes_mib: Sequence[int], secret: str | None = None) -> None:
        cmd = [sys.executable, "-m", "flowgrpo.services.bench.bus", "--producer", transport, "--sizes-mib"]
        env = dict(os.environ, **({SECRET_ENV: secret} if secret else {}))
        self.proc = subprocess.Popen(
            [*cmd, *map(str, sizes_mib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {transport} producer exited with {self.proc.wait()} before serving")
        served = json.loads(line)
        self.refs = {name: TensorRef.from_dict(data) for name, data in served["refs"].items()}
        self.echo: str = served["echo"]

    def __enter__(self) -> _Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- measuring --------------------------------------------------------------------------------


def _memcpy_s(nbytes: int, repeats: int) -> Figure:
    src = np.random.default_rng(1).random(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return timed(lambda: np.copyto(dst, src), repeats=repeats)


def _throughput(
    producers: dict[str, _Producer], secret: str, sizes_mib: Sequence[int], repeats: int
) -> list[Row]:
    """Per size: memcpy, then every path, each timed after a warm-up fetch (the connection, the
    probe, the first touch of buffers)."""
    clients = _Clients(secret)
    rows = []
    for mib in sizes_mib:
        nbytes = mib * MiB
        reps = repeats if mib < 256 else max(MIN_REPEATS, repeats // 2)
        base = _memcpy_s(nbytes, reps)
        rows.append(_row(mib, "memcpy", base, base))
        for path, fn in _paths(str(mib), producers, clients).items():
            rows.append(_row(mib, path, timed(fn, repeats=reps), base))
    clients.close()
    return rows


def _row(mib: int, path: str, seconds: Figure, memcpy: Figure) -> Row:
    return Row(mib, path, seconds, seconds.per(mib * MiB / 1e9, "GB/s"), ratio(memcpy, seconds, "x memcpy"))


class _Clients:
    """The clients the rows use: sockets only, same host (shared memory), sockets with CURVE."""

    def __init__(self, secret: str) -> None:
        self.socket_only = BusClient(BusConfig(shm=False))
        self.same_host = BusClient(BusConfig(shm=True))
        self.curve = BusClient(BusConfig(shm=False, secret=secret))

    def close(self) -> None:
        for client in (self.socket_only, self.same_host, self.curve):
            client.close()


def _paths(key: str, producers: dict[str, _Producer], clients: _Clients) -> dict[str, Callable[[], object]]:
    """What each row times: one fetch of tensor ``key``, made usable the way the row says."""
    refs = {name: producer.refs[key] for name, producer in producers.items()}
    dst = np.empty(refs["ipc"].nbytes // 4, np.float32)
    return {
        "ipc": lambda: clients.socket_only.fetch([refs["ipc"]]),
        "tcp": lambda: clients.socket_only.fetch([refs["tcp"]]),
        "shm": lambda: np.copyto(dst, _fetch_shm(clients.same_host, refs["ipc"])),
        "shm-view": lambda: _touch(_fetch_shm(clients.same_host, refs["ipc"])),
        "ipc+curve": lambda: clients.curve.fetch([refs["ipc+curve"]]),
        "tcp+curve": lambda: clients.curve.fetch([refs["tcp+curve"]]),
    }


def _fetch_shm(client: BusClient, ref: TensorRef) -> npt.NDArray[Any]:
    [got] = client.fetch([ref])
    if got.via != "shm":
        raise RuntimeError(
            f"expected the shared-memory path, got {got.via}: is /dev/shm shared and large enough?"
        )
    return got.array


def _touch(array: npt.NDArray[Any]) -> int:
    return int(array.reshape(-1).view(np.uint8)[::_PAGE].sum())


def _latencies(producers: dict[str, _Producer], secret: str, n: int) -> list[Latency]:
    plain, curve = BusClient(BusConfig(shm=False)), BusClient(BusConfig(shm=False, secret=secret))
    out = []
    for transport, producer in producers.items():
        ref = producer.refs["small"]
        client = curve if transport.endswith("+curve") else plain
        if client is plain:
            bare: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
            bare.connect(producer.echo)
            echo = _round_trips(functools.partial(_echo_round_trip, bare), n)
            bare.close(linger=0)
            out.append(Latency(transport, "pyzmq echo (floor)", *echo))
        ping = _round_trips(functools.partial(client.ping, ref.endpoint), n)
        fetch = _round_trips(functools.partial(client.fetch, [ref]), n)
        out += [Latency(transport, "PING", *ping), Latency(transport, "FETCH 1 key 64 B", *fetch)]
    plain.close()
    curve.close()
    return out


def _echo_round_trip(sock: zmq.Socket[bytes]) -> None:
    sock.send_multipart([b"P", b"{}"])
    sock.recv_multipart()


def _round_trips(fn: Callable[[], object], n: int) -> tuple[Figure, float]:
    """``n`` timed round trips after 100 warm-up ones (fewer when n is smaller): their figure in
    microseconds (the median is the p50) and their p99."""
    for _ in range(min(100, n)):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return Figure.of(times, "us", keep=False), float(np.percentile(times, 99))


# --- reporting --------------------------------------------------------------------------------


def _print(rows: list[Row], latencies: list[Latency]) -> None:
    n = rows[0].seconds.n if rows else 0
    print(f"bus throughput, float32 tensors, median (min-max) of {n} fetches after a warm-up "
          f"(256 MiB: fewer) ({os.cpu_count()} CPUs)")  # fmt: skip
    print(f"{'size':>8}  {'path':<9} {'GB/s':>19}  {'x memcpy':>17}")
    for row in rows:
        print(
            f"{row.size_mib:>5} MiB  {row.path:<9} {row.gb_s.brief('.2f'):>19}  {row.ratio.brief('.2f'):>17}"
        )
    n = latencies[0].round_trip_us.n if latencies else 0
    print(f"\nsmall-message round trip (us), {n} after 100 warm-up ones: p50 (min-max), p99")
    print(f"{'transport':<10} {'message':<20} {'p50 (min-max)':>24} {'p99':>8}")
    for lat in latencies:
        cell = lat.round_trip_us.brief(".1f")
        print(f"{lat.transport:<10} {lat.message:<20} {cell:>24} {lat.p99_us:>8.1f}")
    for line in [*_auth_lines(rows, latencies), *_goal_lines(rows, latencies)]:
        print(line)


def _auth_ratios(rows: list[Row], latencies: list[Latency]) -> dict[str, dict[str, Figure]]:
    """Each +curve figure over its plain one: throughput per size (plain seconds / curve
    seconds), round-trip p50 per message (curve / plain)."""
    seconds = {(r.size_mib, r.path): r.seconds for r in rows}
    trips = {(lat.transport, lat.message): lat.round_trip_us for lat in latencies}
    out: dict[str, dict[str, Figure]] = {}
    for transport in ("ipc", "tcp"):
        curve = f"{transport}+curve"
        ratios = {
            f"{mib} MiB": ratio(seconds[mib, transport], seconds[mib, curve])
            for mib, p in seconds
            if p == curve
        }
        for (t, message), value in trips.items():
            if t == curve and (transport, message) in trips:
                ratios[f"{message} p50"] = ratio(value, trips[transport, message])
        out[transport] = ratios
    return out


def _auth_lines(rows: list[Row], latencies: list[Latency]) -> list[str]:
    lines = ["\nauthentication cost (CURVE on / off; throughput < 1 and latency > 1 cost):"]
    for transport, ratios in _auth_ratios(rows, latencies).items():
        figures = ", ".join(f"{name} {value.brief('.2f')}x" for name, value in ratios.items())
        lines.append(f"  {transport}: {figures}")
    return lines


def _goal_lines(rows: list[Row], latencies: list[Latency]) -> list[str]:
    lines = ["\ngoals (64 MiB ratio to memcpy; PING p50):"]
    for path, goal in GOALS.items():
        found = [r for r in rows if r.size_mib == 64 and r.path == path]
        if found:
            verdict = "met" if found[0].ratio.median >= goal else "MISSED"
            lines.append(f"  {path:<4} >= {goal:.1f}x: {found[0].ratio.brief('.2f')}x {verdict}")
    for lat in latencies:
        if lat.message == "PING":
            p50 = lat.round_trip_us.median
            verdict = "met" if p50 < LATENCY_GOAL_US else "MISSED"
            lines.append(f"  {lat.transport} PING p50 < {LATENCY_GOAL_US:.0f} us: {p50:.0f} us {verdict}")
    return lines


def _report(rows: list[Row], latencies: list[Latency]) -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "throughput": rows,
        "latency": latencies,
        "curve_over_plain": _auth_ratios(rows, latencies),
        "goals": {"ratio_at_64_mib": GOALS, "ping_p50_us": LATENCY_GOAL_US},
    }


if __name__ == "__main__":
    sys.exit(main())
