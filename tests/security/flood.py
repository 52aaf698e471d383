"""Raw clients for the admission tests: a flood of unauthenticated streams, idle HTTP/2
connections (slowloris), an oversized unauthenticated call, a long unauthenticated stream, and the
legitimate caller whose latency is measured while they run.

The attacks run in processes of their own (``python -m tests.security.flood flood|oversized
ADDRESS SECONDS``, each prints one JSON object), so that their event loops do not slow the
legitimate caller's. Loopback addresses only: these are tests of our own servers.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

import grpc
import grpc.aio

from flowgrpo import PROTOCOL_VERSION
from flowgrpo.v1 import common_pb2, reward_pb2

SCORE = "/flowgrpo.v1.Reward/Score"
HANDSHAKE = "/flowgrpo.v1.Lifecycle/Handshake"
INFO = "/flowgrpo.v1.Reward/Info"
# the client side of an HTTP/2 connection: the preface, then an empty SETTINGS frame
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"


def _loopback(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    assert host in ("127.0.0.1", "localhost"), f"{address}: the flood is for loopback servers only"
    return host, int(port)


def _channel(address: str) -> grpc.aio.Channel:
    # a connection of its own (no subchannel shared with another channel of this process)
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def _code(error: BaseException | None) -> str:
    if error is None:
        return "OK"
    if isinstance(error, grpc.aio.AioRpcError):
        return str(error.code().name)
    return type(error).__name__


@dataclass
class AttackReport:
    streams: dict[str, int] = field(default_factory=dict)  # status of each refused stream
    streams_internal_details: list[str] = field(default_factory=list)
    slowloris_opened: int = 0
    slowloris_closed_by_server: int = 0  # before the attack ended
    big_call: str = ""
    long_stream: str = ""


async def trickle(i: int) -> AsyncIterator[reward_pb2.ScoreRequest]:
    """A stream that never half-closes: a message every 100 ms (the caller ends it)."""
    for k in range(1_000_000):
        yield reward_pb2.ScoreRequest(sample_id=f"flood{i}/{k}")
        await asyncio.sleep(0.1)


def own_write_failed(error: grpc.aio.AioRpcError) -> bool:
    """Whether the client's INTERNAL is its own failed send (grpc-python's core names the
    operation that failed), not a status the server sent."""
    return "SendMessageOperation" in (error.debug_error_string() or "")


async def flood_streams(address: str, streams: int, seconds: float, report: AttackReport) -> None:
    """``streams`` unauthenticated Score streams in flight at all times for ``seconds``, on 10
    connections; half trickle messages and never half-close, half send 3 messages and close."""
    codes: collections.Counter[str] = collections.Counter()
    channels = [_channel(address) for _ in range(10)]
    end = time.monotonic() + seconds

    async def one(worker: int) -> None:
        n = 0
        while time.monotonic() < end:
            n += 1
            if worker % 2:
                requests: object = trickle(worker)
            else:
                requests = iter([reward_pb2.ScoreRequest(sample_id=f"f{worker}/{n}/{k}") for k in range(3)])
            call = channels[worker % len(channels)].stream_stream(
                SCORE, request_serializer=reward_pb2.ScoreRequest.SerializeToString
            )(requests, timeout=5)
            error: BaseException | None = None
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as caught:
                error = caught
            finally:
                call.cancel()
            code = _code(error)
            if isinstance(error, grpc.aio.AioRpcError) and code == "INTERNAL" and own_write_failed(error):
                # the client's own write failed on a stream the server had already refused, and
                # grpc-python reports that in place of the server's status (docs/security.md)
                code = "INTERNAL (own write)"
            codes[f"{'trickle' if worker % 2 else 'three'} {code}"] += 1
            if code.startswith("INTERNAL") and len(report.streams_internal_details) < 3:
                assert isinstance(error, grpc.aio.AioRpcError)
                report.streams_internal_details.append(f"{error.details()}: {error.debug_error_string()}")

    try:
        await asyncio.gather(*(one(w) for w in range(streams)))
    finally:
        for channel in channels:
            await channel.close()
    report.streams = dict(codes)


async def slowloris(address: str, connections: int, seconds: float, report: AttackReport) -> None:
    """``connections`` HTTP/2 connections that send the preface and an empty SETTINGS frame, then
    nothing more (half of them acknowledge the server's SETTINGS first), held for ``seconds``;
    counts those the server closed meanwhile."""
    host, port = _loopback(address)
    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []
    for _ in range(connections):
        s = socket.socket()
        s.setblocking(False)
        await loop.sock_connect(s, (host, port))
        await loop.sock_sendall(s, PREFACE)
        socks.append(s)
    report.slowloris_opened = len(socks)

    async def watch(s: socket.socket, ack: bool) -> None:
        with contextlib.suppress(OSError):
            while data := await loop.sock_recv(s, 65536):  # SETTINGS, pings, GOAWAY: never answered
                if ack:
                    await loop.sock_sendall(s, SETTINGS_ACK)
                    ack = False
                del data

    watchers = [asyncio.ensure_future(watch(s, i % 2 == 0)) for i, s in enumerate(socks)]
    await asyncio.sleep(seconds)
    report.slowloris_closed_by_server = sum(w.done() for w in watchers)
    for w in watchers:
        w.cancel()
    for s in socks:
        s.close()


async def big_call(address: str, mib: int) -> str:
    """One unauthenticated unary call carrying ``mib`` MiB."""
    async with _channel(address) as channel:
        call = channel.unary_unary(HANDSHAKE)  # raw bytes: no serializer
        try:
            await call(b"\x0a" + b"\x00" * (mib << 20), timeout=30)
        except grpc.aio.AioRpcError as error:
            return _code(error)
    return "OK"


async def long_stream(address: str, messages: int) -> str:
    """One unauthenticated stream of ``messages`` messages sent as fast as the client can."""
    async with _channel(address) as channel:
        score = channel.stream_stream(SCORE, request_serializer=reward_pb2.ScoreRequest.SerializeToString)
        requests = (reward_pb2.ScoreRequest(sample_id=f"long/{k}") for k in range(messages))
        try:
            async for _ in score(requests, timeout=30):
                pass
        except grpc.aio.AioRpcError as error:
            return _code(error)
    return "OK"


async def attack(address: str, seconds: float, streams: int, connections: int) -> AttackReport:
    """The flood of streams and the slowloris together, for ``seconds``."""
    report = AttackReport()
    await asyncio.gather(
        flood_streams(address, streams, seconds, report),
        slowloris(address, connections, seconds, report),
    )
    return report


async def oversized(address: str, delay_s: float) -> AttackReport:
    """After ``delay_s``: the 200 MiB call, then the 5,000-message stream."""
    report = AttackReport()
    await asyncio.sleep(delay_s)
    report.big_call = await big_call(address, 200)
    report.long_stream = await long_stream(address, 5000)
    return report


@dataclass
class Legitimate:
    latencies_s: list[float] = field(default_factory=list)
    codes: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def p99(self) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("inf")


async def legitimate(address: str, token: str, seconds: float, workers: int = 4) -> Legitimate:
    """``workers`` callers with the token, each on a connection of its own, alternating the READY
    Handshake and Reward.Info; the latency of every call and its status.

    (Unary calls: a one-request Score stream hangs to its deadline about once in 60 calls with
    no attack at all, on main too: a reward-stream matter of its own, kept out of these figures.)"""
    metadata = (("authorization", f"Bearer {token}"),)
    result = Legitimate()
    codes: collections.Counter[str] = collections.Counter()
    end = time.monotonic() + seconds

    async def one(worker: int) -> None:
        async with _channel(address) as channel:
            handshake = channel.unary_unary(
                HANDSHAKE,
                request_serializer=common_pb2.HandshakeRequest.SerializeToString,
                response_deserializer=common_pb2.HandshakeResponse.FromString,
            )
            info = channel.unary_unary(
                INFO,
                request_serializer=reward_pb2.RewardInfoRequest.SerializeToString,
                response_deserializer=reward_pb2.RewardInfoResponse.FromString,
            )
            n = 0
            while time.monotonic() < end:
                n += 1
                start = time.monotonic()
                error: BaseException | None = None
                try:
                    if n % 2:
                        request = common_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION)
                        await handshake(request, timeout=10, metadata=metadata)
                    else:
                        await info(reward_pb2.RewardInfoRequest(), timeout=10, metadata=metadata)
                except grpc.aio.AioRpcError as caught:
                    error = caught
                result.latencies_s.append(time.monotonic() - start)
                codes[_code(error)] += 1
                if error is not None:
                    result.failures.append(f"{'Handshake' if n % 2 else 'Info'} {error}"[:300])
                await asyncio.sleep(0.02)

    await asyncio.gather(*(one(w) for w in range(workers)))
    result.codes = dict(codes)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=["flood", "oversized"])
    parser.add_argument("address")
    parser.add_argument("seconds", type=float, help="flood: how long; oversized: the delay before")
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--connections", type=int, default=200)
    args = parser.parse_args()
    _loopback(args.address)
    if args.what == "flood":
        report = asyncio.run(attack(args.address, args.seconds, args.streams, args.connections))
    else:
        report = asyncio.run(oversized(args.address, args.seconds))
    print(json.dumps(asdict(report)))


if __name__ == "__main__":
    main()
