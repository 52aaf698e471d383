"""Hostile peers against a real bus store in its own process: strangers are dropped at the
handshake, peers that hold the secret cannot make the store buffer without bound, RELEASE of
everything is refused, 1,000 random messages crash nothing; the run's own client still fetches.

The store's memory is its VmRSS from /proc. A peer with the secret that sends frames of a message
it never ends needs its own CURVE implementation (libzmq only sends whole messages):
:class:`CurvePeer` speaks ZMTP 3.0 + CurveZMQ (RFC 23, 26) on a raw TCP socket, with the
libsodium that pyzmq ships.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import logging
import os
import random
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.utils.z85

from flowgrpo.bus import BusClient, BusConfig, BusServer, InvalidRequest, TensorRef, TensorStore, auth, wire
from flowgrpo.bus.auth import InsecureBusError
from flowgrpo.bus.errors import Unauthenticated

MiB = 1 << 20
SECRET = "the-secret-of-this-test-run-0123456789"
GROWTH_LIMIT_MIB = 50
STORE = r"""
import json, logging, os, sys
import numpy as np
from flowgrpo.bus import BusConfig, serve_store
logging.basicConfig(level=logging.INFO)
server = serve_store(BusConfig(**json.loads(sys.argv[1])))
ref = server.store.put("secret/weights", "weights", np.arange(4096, dtype=np.float32))
print(json.dumps({"endpoint": server.endpoint, "ref": ref.to_dict(), "pid": os.getpid()}), flush=True)
sys.stdin.read()
server.close()
"""


class Store:
    """A store served by a child process holding one tensor; its log goes to ``log``."""

    def __init__(self, log: Path, **config: Any) -> None:
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", STORE, json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the store exited with {self.proc.wait()}: {log.read_text()}"
        hello = json.loads(line)
        self.endpoint: str = hello["endpoint"]
        self.ref = TensorRef.from_dict(hello["ref"])
        self.host, port = self.endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.port = int(port)

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def start_store(tmp_path: Path) -> Iterator[Callable[..., Store]]:
    """Call with BusConfig fields; every store started is ended (by its own handle) after."""
    started: list[Store] = []

    def start(**config: Any) -> Store:
        started.append(Store(tmp_path / f"store-{len(started)}.log", **config))
        return started[-1]

    yield start
    for store in started:
        store.close()


def _fetches(store: Store, secret: str | None = SECRET) -> bool:
    """The run's own client still gets the right tensor."""
    with BusClient(BusConfig(secret=secret)) as client:
        [got] = client.fetch([store.ref], timeout_s=20)
    return bool(np.array_equal(got.array, np.arange(4096, dtype=np.float32)))


# --- raw peers -------------------------------------------------------------------------------------

NULL_GREETING = b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32
CURVE_GREETING = b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\0" * 32


def _frame(body: bytes, flags: int = 0) -> bytes:
    """A ZMTP 3.0 frame: flags (0x01 more, 0x04 command), then a 1- or 8-byte size."""
    if len(body) <= 255:
        return bytes([flags]) + bytes([len(body)]) + body
    return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body


def _prop(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    flags = _recv_exact(sock, 1)[0]
    size = struct.unpack(">Q", _recv_exact(sock, 8))[0] if flags & 0x02 else _recv_exact(sock, 1)[0]
    return flags, _recv_exact(sock, size)


def _until_closed(sock: socket.socket) -> bytes:
    """What the peer sends until it closes ``sock`` (a 5 s timeout fails the test)."""
    got = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 16):
            got += chunk
    return got


def _null_peer(host: str, port: int) -> socket.socket:
    """A raw TCP connection past a NULL handshake (a store without a secret accepts it)."""
    sock = socket.create_connection((host, port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a small send, a segment
    sock.sendall(NULL_GREETING)
    _recv_exact(sock, 64)
    sock.sendall(_frame(b"\x05READY" + _prop(b"Socket-Type", b"DEALER"), 0x04))
    return sock


def _sodium() -> ctypes.CDLL:
    folder = Path(zmq.__file__).parent.parent / "pyzmq.libs"
    bundled = sorted(folder.glob("libsodium*.so*")) if folder.is_dir() else []
    name = str(bundled[0]) if bundled else ctypes.util.find_library("sodium")
    if name is None:
        pytest.skip("no libsodium to speak CURVE with (pyzmq's, or the system's)")
    lib = ctypes.CDLL(name)
    assert lib.sodium_init() >= 0
    return lib


class CurvePeer:
    """A CURVE client on a raw TCP socket, from the specs: the handshake (HELLO, WELCOME,
    INITIATE, READY), then MESSAGE commands it encrypts itself, so it can send frames of a
    multipart message and never its last frame, which libzmq never does."""

    def __init__(self, host: str, port: int, keys: auth.Keys, sodium: ctypes.CDLL) -> None:
        self._na = sodium
        server, client, client_secret = (
            zmq.utils.z85.decode(k) for k in (keys.server_public, keys.client_public, keys.client_secret)
        )
        short_public, short_secret = (zmq.utils.z85.decode(k) for k in zmq.curve_keypair())
        self.sock = socket.create_connection((host, port), timeout=5)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(CURVE_GREETING)
        _recv_exact(self.sock, 64)
        hello_box = self._box(b"\0" * 64, b"CurveZMQHELLO---" + _n(1), server, short_secret)
        self._command(b"\x05HELLO\x01\x00" + b"\0" * 72 + short_public + _n(1) + hello_box)
        welcome = self._expect(b"\x07WELCOME")
        plain = self._open(welcome[24:], b"WELCOME-" + welcome[8:24], server, short_secret)
        self._server_short, cookie = plain[:32], plain[32:128]
        vouch_nonce = os.urandom(16)
        vouch = self._box(short_public + server, b"VOUCH---" + vouch_nonce, self._server_short, client_secret)
        body = client + vouch_nonce + vouch + _prop(b"Socket-Type", b"DEALER")
        box = self._box(body, b"CurveZMQINITIATE" + _n(2), self._server_short, short_secret)
        self._command(b"\x08INITIATE" + cookie + _n(2) + box)
        self._expect(b"\x05READY")
        self._short_secret, self._nonce = short_secret, 3

    def send(self, data: bytes, more: bool) -> int:
        """Send one frame (encrypted); returns the bytes it took on the wire."""
        plain = bytes([1 if more else 0]) + data
        nonce = _n(self._nonce)
        box = self._box(plain, b"CurveZMQMESSAGEC" + nonce, self._server_short, self._short_secret)
        self._nonce += 1
        frame = _frame(b"\x07MESSAGE" + nonce + box)
        self.sock.sendall(frame)
        return len(frame)

    def recv(self) -> tuple[bytes, bool]:
        """One frame of a reply: its bytes and whether more follow."""
        _, body = _recv_frame(self.sock)
        assert body[:8] == b"\x07MESSAGE", body[:8]
        nonce = b"CurveZMQMESSAGES" + body[8:16]
        plain = self._open(body[16:], nonce, self._server_short, self._short_secret)
        return plain[1:], bool(plain[0] & 1)

    def _command(self, body: bytes) -> None:
        self.sock.sendall(_frame(body, 0x04))

    def _expect(self, name: bytes) -> bytes:
        _, body = _recv_frame(self.sock)
        assert body.startswith(name), f"expected {name!r}, got {body[:40]!r}"
        return body

    def _box(self, plain: bytes, nonce: bytes, public: bytes, secret: bytes) -> bytes:
        out = ctypes.create_string_buffer(len(plain) + 16)
        size = ctypes.c_ulonglong(len(plain))
        assert self._na.crypto_box_easy(out, plain, size, nonce, public, secret) == 0
        return out.raw

    def _open(self, box: bytes, nonce: bytes, public: bytes, secret: bytes) -> bytes:
        out = ctypes.create_string_buffer(len(box) - 16)
        rc = self._na.crypto_box_open_easy(out, box, ctypes.c_ulonglong(len(box)), nonce, public, secret)
        assert rc == 0, "a box from the store did not open"
        return out.raw

    def close(self) -> None:
        self.sock.close()


def _n(counter: int) -> bytes:
    return struct.pack(">Q", counter)


def _dealer(endpoint: str, keys: auth.Keys | None = None) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        auth.connect_curve(sock, keys)
    sock.connect(endpoint)
    return sock


def _fetch_frames(key: str, rid: int = 1) -> list[bytes]:
    return [wire.FETCH, wire.encode(wire.FetchRequest(rid, "", [wire.KeyRange(key)]))]


# --- authentication at the handshake ----------------------------------------------------------------


def test_strangers_get_nothing_and_the_run_still_fetches(start_store: Callable[..., Store]) -> None:
    store = start_store(secret=SECRET)
    run = auth.derive_keys(SECRET.encode())
    public, secret = zmq.curve_keypair()
    strangers = {
        "no CURVE": _dealer(store.endpoint),
        "another secret": _dealer(store.endpoint, auth.derive_keys(b"another run's secret, 32 bytes!!")),
        # knows the store's public key (it is no secret) but not the run's client key
        "own keys": _dealer(store.endpoint, auth.Keys(run.server_public, b"", public, secret)),
    }
    for sock in strangers.values():
        sock.send_multipart(_fetch_frames(store.ref.key))
    for name, sock in strangers.items():
        assert not sock.poll(1500), f"{name}: the store answered a stranger"
        sock.close()
    with socket.create_connection((store.host, store.port), timeout=5) as raw:  # raw ZMTP, NULL
        ready = _frame(b"\x05READY" + _prop(b"Socket-Type", b"DEALER"), 0x04)
        with contextlib.suppress(ConnectionResetError):
            raw.sendall(
                NULL_GREETING + ready + _frame(wire.FETCH, 0x01) + _frame(_fetch_frames(store.ref.key)[1])
            )
        got = _until_closed(raw)
    assert len(got) <= 64 and got[12:17] in (b"CURVE", b"")  # the store's greeting at most, then closed
    assert _fetches(store)
    assert "refused a b'CURVE' peer" in store.log.read_text()  # the ZAP handler said no


def test_a_wrong_client_key_is_refused_by_zap(start_store: Callable[..., Store]) -> None:
    store = start_store(secret=SECRET)
    run = auth.derive_keys(SECRET.encode())
    public, secret = zmq.curve_keypair()
    impostor = auth.Keys(run.server_public, b"", public, secret)
    with pytest.raises(AssertionError, match=r"got b'\\x05ERROR"):
        CurvePeer(store.host, store.port, impostor, _sodium())
    assert _fetches(store)


def test_the_secret_comes_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "bus-secret"
    path.write_text(SECRET + "\n")  # as `kubectl create secret --from-file` leaves it
    monkeypatch.setenv("FLOWGRPO_BUS_SECRET_FILE", str(path))
    assert BusConfig().resolve_secret() == SECRET.encode()
    with TensorStore(BusConfig()) as store, BusServer(store) as server:
        ref = store.put("k", "weights", np.ones(8, np.float32))
        assert server.authenticated
        with BusClient(BusConfig(), local_stores=False) as client:
            assert client.fetch([ref])[0].array.sum() == 8
        stranger = BusClient(BusConfig(secret="not it, nor the file"), local_stores=False)
        with stranger, pytest.raises(Unauthenticated, match="another"):
            stranger.fetch([ref], timeout_s=10)
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        BusConfig().resolve_secret()
    monkeypatch.setenv("FLOWGRPO_BUS_SECRET", SECRET)
    with pytest.raises(ValueError, match="keep one"):
        BusConfig().resolve_secret()
    monkeypatch.delenv("FLOWGRPO_BUS_SECRET")
    monkeypatch.setenv("FLOWGRPO_BUS_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read the bus secret"):
        BusClient(BusConfig())


def test_beyond_loopback_a_store_needs_a_secret_or_says_insecure(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("FLOWGRPO_BUS_SECRET", "FLOWGRPO_BUS_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    refusal = r"FLOWGRPO_BUS_SECRET.*bus\.secret.*bus\.insecure=true"
    for host in ("0.0.0.0", "::", "10.1.2.3", "my-host"):
        with TensorStore(BusConfig(host=host)) as store, pytest.raises(InsecureBusError, match=refusal):
            BusServer(store)
    assert auth.is_local(BusConfig(host="::1")) and auth.is_local(BusConfig(host="[::1]"))
    local = [BusConfig(host=h) for h in ("127.0.0.1", "127.0.0.2", "localhost")]
    with caplog.at_level(logging.WARNING, logger="flowgrpo.bus.auth"):
        for config in [*local, BusConfig(transport="ipc"), BusConfig(host="0.0.0.0", secret=SECRET)]:
            with TensorStore(config) as store:
                BusServer(store).close()
        assert caplog.text == ""
        with TensorStore(BusConfig(host="0.0.0.0", insecure=True)) as store:
            BusServer(store).close()
    assert "INSECURE" in caplog.text and "bus.insecure=true" in caplog.text


def test_the_ipc_socket_lies_in_a_folder_of_its_user_only() -> None:
    with TensorStore(BusConfig(transport="ipc")) as store, BusServer(store) as server:
        folder = Path(server.endpoint.removeprefix("ipc://")).parent
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert not folder.exists()


# --- memory under unfinished messages ---------------------------------------------------------------


def _attack(
    store: Store, connect: Callable[[], Any], send: Callable[[Any, bytes], int], frame: bytes, seconds: float
) -> tuple[int, float, float]:
    """Send frames of messages that never end, reconnecting when cut, until 300 MiB went out or
    ``seconds`` passed; returns (bytes sent, the store's largest RSS growth in MiB, its growth
    once the attack is over). Only a connection reset or refused (ConnectionError: what a cut
    looks like) is retried: a timeout, a handshake that fails its checks or a store gone from
    /proc fails the test."""
    total_mib = 300
    start_rss, sent, peak = store.rss_mib(), 0, 0.0
    deadline = time.monotonic() + seconds
    while sent < total_mib * MiB and time.monotonic() < deadline:
        try:
            peer = connect()
        except ConnectionError:  # cut during the handshake
            continue
        try:
            while sent < total_mib * MiB and time.monotonic() < deadline:
                for _ in range(16):  # 1 MiB between looks at the store's memory
                    sent += send(peer, frame)
                peak = max(peak, store.rss_mib() - start_rss)
        except ConnectionError:  # cut by the store
            pass
        finally:
            peer.close()
    time.sleep(0.5)
    after = store.rss_mib() - start_rss
    return sent, max(peak, after), after


def _null_send(sock: socket.socket, batch: bytes) -> int:
    sock.sendall(batch)
    return len(batch)


def _null_batch(frame_bytes: int, drip: bool = False) -> bytes:
    """About 64 KiB of frames of ``frame_bytes`` with the more flag (one frame when ``drip``):
    a message that goes on."""
    frame = _frame(b"x" * frame_bytes, 0x01)
    return frame if drip else frame * max(1, (64 << 10) // len(frame))


def test_strangers_cannot_grow_the_store(start_store: Callable[..., Store]) -> None:
    store = start_store(secret=SECRET)
    assert _fetches(store)

    def connect() -> socket.socket:
        sock = socket.create_connection((store.host, store.port), timeout=5)
        sock.sendall(NULL_GREETING + _frame(b"\x05READY" + _prop(b"Socket-Type", b"DEALER"), 0x04))
        return sock

    sent, growth, _ = _attack(store, connect, _null_send, _null_batch(64 << 10), seconds=5)
    assert growth < GROWTH_LIMIT_MIB, f"the store grew by {growth:.0f} MiB after {sent / MiB:.0f} MiB"
    # what the strangers' sends completed (into the store's receive queue, before each cut): at least
    # twice the growth allowed, else the bound above says nothing (about 1 MiB goes in per connection)
    assert sent > 2 * GROWTH_LIMIT_MIB * MiB, f"the attack sent only {sent / MiB:.1f} MiB"
    assert store.alive() and _fetches(store)


@pytest.mark.parametrize(
    ("frame_bytes", "drip", "peak_limit_mib"),
    [(64 << 10, False, GROWTH_LIMIT_MIB), (0, False, 4 * GROWTH_LIMIT_MIB), (40, True, GROWTH_LIMIT_MIB)],
    ids=["64KiB-frames", "empty-frames", "40B-frames-one-per-segment"],
)
def test_local_peers_without_a_secret_cannot_grow_the_store(
    start_store: Callable[..., Store], frame_bytes: int, drip: bool, peak_limit_mib: int
) -> None:
    """Empty NULL frames are the worst case: 2 bytes on the wire, 64 inside libzmq, decoded at
    tens of millions a second, so each 10 ms the guard's thread is not scheduled adds ~30 MiB
    (usually 5-20 MiB at the peak here; 193 MiB seen once on a loaded machine). All is freed at
    the cut."""
    store = start_store()  # loopback, no secret: anyone on this host connects
    connect = functools.partial(_null_peer, store.host, store.port)
    sent, growth, after = _attack(
        store, connect, _null_send, _null_batch(frame_bytes, drip), seconds=5 if drip else 10
    )
    assert growth < peak_limit_mib, f"the store grew by {growth:.0f} MiB after {sent / MiB:.1f} MiB"
    # freed at the cut, but the allocator may keep the pages: RSS after is bounded like the peak
    assert after < peak_limit_mib, f"the store kept {after:.0f} MiB after the attack"
    assert sent > (MiB if drip else 20 * MiB)  # it did try (empty frames: 2 bytes, 64 in libzmq)
    assert "cut the connection" in store.log.read_text()
    assert store.alive() and _fetches(store, secret=None)


@pytest.mark.parametrize("frame_bytes", [64 << 10, 0], ids=["64KiB-frames", "empty-frames-one-per-segment"])
def test_peers_with_the_secret_cannot_grow_the_store(
    start_store: Callable[..., Store], frame_bytes: int
) -> None:
    store = start_store(secret=SECRET)
    keys, sodium = auth.derive_keys(SECRET.encode()), _sodium()
    peer = CurvePeer(store.host, store.port, keys, sodium)  # first, a whole PING: the peer is real
    peer.send(wire.PING, more=True)
    peer.send(wire.encode(wire.PingRequest(5)), more=False)
    assert peer.recv() == (wire.PING, True)
    peer.close()

    def send(curve: CurvePeer, frame: bytes) -> int:
        return curve.send(frame, more=True)

    connect = functools.partial(CurvePeer, store.host, store.port, keys, sodium)
    sent, growth, _ = _attack(store, connect, send, b"x" * frame_bytes, seconds=15 if frame_bytes else 5)
    assert growth < GROWTH_LIMIT_MIB, f"the store grew by {growth:.0f} MiB after {sent / MiB:.1f} MiB"
    assert sent > (100 * MiB if frame_bytes else MiB // 2)  # empty frames: 35 bytes a segment
    assert "cut the connection" in store.log.read_text()
    assert store.alive() and _fetches(store)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["null", "curve"])
def test_a_long_stream_of_requests_is_never_cut(
    start_store: Callable[..., Store], secret: str | None
) -> None:
    """The guard credits exactly what a request took on the wire: 7 MB of requests (6,000 frames)
    through one connection never add up to its 64 KiB budget (a drift of 11 bytes a frame would)."""
    store = start_store(secret=secret, max_request_header_bytes=16 << 10, max_connection_bytes=64 << 10)
    sock = _dealer(store.endpoint, auth.derive_keys(SECRET.encode()) if secret else None)
    rng = random.Random(7)
    for rid in range(3000):
        pad = "x" * rng.choice([0, 1, 190, 221, 222, 223, 255, 300, 8000, 15000])  # 255 frame limits
        sock.send_multipart([wire.PING, msgpack.packb({"v": wire.PROTOCOL, "rid": rid, "pad": pad})])
        assert sock.poll(10_000), f"request {rid} got no answer: the connection was cut"
        token, header = sock.recv_multipart()
        assert token == wire.PING and wire.unpack(header, 1 << 20)["rid"] == rid
    sock.close()
    assert "cut the connection" not in store.log.read_text()


# --- RELEASE ----------------------------------------------------------------------------------------


def test_release_of_everything_is_refused_and_targeted_releases_work() -> None:
    with TensorStore(BusConfig()) as store, BusServer(store):
        refs = [store.put(f"step1/{i}", "weights", np.ones(4, np.float32), tag="step1") for i in range(3)]
        store.put("weights/v3", "weights", np.ones(4, np.float32))
        with BusClient(BusConfig(), local_stores=False) as client:
            for empty in ({"prefix": ""}, {"tag": ""}):
                with pytest.raises(InvalidRequest, match=r"empty \w+ refused: it would drop every key"):
                    client.release(refs[0].endpoint, **empty)
            assert client.stat(refs[0].endpoint).count == 4
            assert client.release(refs[0].endpoint, [refs[0].key]) == 1
            assert client.release(refs[0].endpoint, tag="step1") == 2
            assert client.release(refs[0].endpoint, prefix="weights/v") == 1
        with pytest.raises(InvalidRequest):
            store.release(prefix="")
        store.put("again", "weights", np.ones(4, np.float32))
        assert store.release_all() == 1 and store.info().count == 0


def test_many_keys_are_released_in_requests_within_the_limit() -> None:
    config = BusConfig(max_request_header_bytes=4096, max_connection_bytes=1 << 20)
    with TensorStore(config) as store, BusServer(store):
        keys = [f"step7/prompt-{i:05d}/sample-0/latents" for i in range(600)]  # ~24 KB of keys
        refs = [store.put(key, "weights", np.ones(1, np.float32)) for key in keys]
        with BusClient(config, local_stores=False) as client:
            assert len(client.fetch(refs)) == 600  # fetches, too, are split by header size
            assert client.release(store.endpoint, keys) == 600


# --- fuzz -------------------------------------------------------------------------------------------

_ALPHABET = "abc0123/_-.:"  # no "s": a random prefix can never release "secret/weights"


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randrange(0, 12)))


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 2 else 6)
    huge = rng.choice([2**31, 2**32 + 1, 2**62, 2**63 - 1, 2**64 - 1, -(2**63)])
    return [
        lambda: rng.randrange(-5, 5),
        lambda: huge,
        lambda: _word(rng),
        lambda: os.urandom(rng.randrange(8)),
        lambda: rng.choice([None, True, False, 1.5, float("nan")]),
        lambda: "secret/weights",
        lambda: [_value(rng, depth + 1) for _ in range(rng.randrange(4))],
        lambda: {_word(rng): _value(rng, depth + 1) for _ in range(rng.randrange(4))},
        lambda: [["secret/weights", rng.choice([0, 1, 4095, 16384, huge]), rng.choice([-1, 0, 7, huge])]],
    ][kind]()


VALID: dict[bytes, dict[str, Any]] = {  # well-formed requests, for the fuzz to mutate
    wire.FETCH: {"store_id": "", "shm": False, "items": [["secret/weights", 0, -1]]},
    wire.RELEASE: {"keys": ["a/b"], "tag": None, "prefix": "c/"},
    wire.STAT: {},
    wire.PING: {},
}


def _header(rng: random.Random, token: bytes) -> bytes:
    version = rng.choice([wire.PROTOCOL, wire.PROTOCOL, 1, 3, "2"])
    fields: dict[str, Any] = {"v": version, "rid": rng.randrange(99)}
    if rng.random() < 0.5:
        fields.update(VALID.get(token, {}))
    for name in rng.sample(["store_id", "shm", "items", "keys", "tag", "prefix", "pad"], rng.randrange(4)):
        fields[name] = _value(rng)
    packed: bytes = msgpack.packb(fields, use_bin_type=rng.random() < 0.5)
    cut = rng.random()
    if cut < 0.15:
        return packed[: rng.randrange(len(packed))]  # truncated
    if cut < 0.25:
        return packed + os.urandom(rng.randrange(1, 9))  # trailing junk
    if cut < 0.3:
        return b"\xdb\xff\xff\xff\xf0" + os.urandom(8)  # a str that claims 4 GiB
    if cut < 0.35:
        return msgpack.packb(msgpack.ExtType(rng.randrange(128), os.urandom(4)))
    return packed


def _message(rng: random.Random) -> list[bytes]:
    token = rng.choice([*VALID, wire.ERROR, b"", b"FF", os.urandom(1)])
    shape = rng.randrange(10)
    if shape == 0:
        return [os.urandom(rng.randrange(64)) for _ in range(rng.randrange(1, 7))]  # random frames
    if shape == 1:
        return [token]
    if shape == 2:
        return [token, _header(rng, token), os.urandom(rng.randrange(32))]
    return [token, _header(rng, token)]


def test_fuzz_a_thousand_random_messages(start_store: Callable[..., Store]) -> None:
    store = start_store(secret=SECRET)
    rng = random.Random(20240607)
    sock = _dealer(store.endpoint, auth.derive_keys(SECRET.encode()))  # holds the secret
    answered, started = 0, time.monotonic()
    for i in range(1200):
        sock.send_multipart(_message(rng))
        assert sock.poll(10_000), f"message {i} got no reply: the store stopped answering"
        token, header, *_ = sock.recv_multipart()
        assert token in wire.TOKEN_NAMES and isinstance(wire.unpack(header, 1 << 20), dict)
        answered += 1
    sock.close()
    junk = 0
    for _ in range(60):  # raw transport bytes: greetings cut short, huge declared frame sizes
        with contextlib.closing(socket.create_connection((store.host, store.port), timeout=5)) as raw:
            blob = rng.choice([NULL_GREETING, CURVE_GREETING])[: rng.randrange(65)]
            blob += rng.choice([b"", b"\x06\xff\xff\xff\xff\xff\xff\xff\xff", b"\x04\xc8", os.urandom(200)])
            with contextlib.suppress(OSError):
                raw.sendall(blob)
                junk += len(blob)
    assert answered == 1200 and junk > 0
    log = store.log.read_text()
    assert store.alive() and "Traceback" not in log and "internal error" not in log, log[-2000:]
    # the refusals are logged in a line per 10 s at most, with their count
    assert 1 <= log.count("refused a request") <= (time.monotonic() - started) / 10 + 1, log[-2000:]
    assert _fetches(store)
    with BusClient(BusConfig(secret=SECRET)) as client:
        client.ping(store.endpoint, timeout_s=5)  # answered: it raises on a refusal or a timeout
        assert client.stat(store.endpoint).count == 1
