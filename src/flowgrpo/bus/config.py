"""Configuration of the data bus: one plain dataclass shared by stores, servers and clients.

The defaults are the recipe's: a store bounded at 8 GiB that makes ``put`` wait for releases
(the coordinator releases a step's data once the trainer consumed it), 16 MiB frames,
shared memory between processes of one host, and a 60 s deadline on every fetch.

The secret of a run comes from ``bus.secret``, ``bus.secret_file``, ``FLOWGRPO_BUS_SECRET`` or
the file that ``FLOWGRPO_BUS_SECRET_FILE`` names, first found wins (:meth:`BusConfig.resolve_secret`);
what it changes is in ``flowgrpo.bus.auth``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from flowgrpo.fields import check_ranges, knob

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
SECRET_ENV = "FLOWGRPO_BUS_SECRET"
SECRET_FILE_ENV = "FLOWGRPO_BUS_SECRET_FILE"


@dataclass
class BusConfig:
    # Where the store's ROUTER socket listens. "tcp" reaches other hosts; "ipc" (a Unix socket)
    # is a little faster on one host.
    transport: Literal["tcp", "ipc"] = "tcp"
    host: str = "127.0.0.1"  # tcp bind address; "0.0.0.0" listens on every interface
    port: int = knob(0, 0, 65_535)  # tcp port; 0 binds a free port and the endpoint reports the real one
    # Host name put in TensorRefs for consumers to connect to; None: `host`, or this machine's
    # host name when `host` is a wildcard address.
    advertise_host: str | None = None
    ipc_dir: str = ""  # folder of the ipc socket file; "" = the system's temporary folder

    # The bounded store.
    max_bytes: int = knob(8 * GiB, 1, 2**50)  # capacity of one store (shared memory included)
    # "wait": put blocks up to put_timeout_s for releases, then fails naming the oldest keys;
    # "evict_oldest": put drops the oldest tensors (their fetch answers EVICTED).
    when_full: Literal["wait", "evict_oldest"] = "wait"
    put_timeout_s: float = knob(60.0, 0.0, 86_400.0)
    # released/evicted keys remembered to answer RELEASED/EVICTED
    max_tombstones: int = knob(65536, 0, 2**31 - 1)

    # The wire.
    # largest data frame; tensors are split into frames this size
    chunk_bytes: int = knob(16 * MiB, 1, 2**31 - 1)
    max_header_bytes: int = knob(1 * MiB, 1, 2**31 - 1)  # larger msgpack headers are refused
    # kernel SNDBUF/RCVBUF (Unix sockets default: 208 KiB); 0 = OS
    socket_buffer_bytes: int = knob(4 * MiB, 0, 2**31 - 1)

    # Shared memory between processes of one host (same /dev/shm, proven by a probe file).
    shm: bool = True
    shm_min_bytes: int = knob(1 * MiB, 0, 2**50)  # smaller tensors travel in socket frames (faster for them)
    shm_dir: str = "/dev/shm"

    # The run's shared secret: with one, every bus socket speaks CURVE with keys derived from it
    # and a store admits only peers holding it. None or "": secret_file, then FLOWGRPO_BUS_SECRET,
    # then the file FLOWGRPO_BUS_SECRET_FILE names. Kept out of resolved configs written to the
    # run folder: prefer the environment or a file (a mounted Kubernetes secret).
    secret: str | None = None
    secret_file: str = ""  # a file holding the secret (surrounding whitespace ignored)
    # Without a secret a store binds only loopback addresses or ipc; true lets it listen on other
    # interfaces anyway (anyone who reaches the port reads every tensor), with a warning at start.
    insecure: bool = False

    # What a peer can make a store hold before a request is read. A request is [type, header].
    max_request_header_bytes: int = knob(64 * KiB, 1, 2**31 - 1)  # larger request headers are refused
    # Bytes one connection may have sent that the store has not read as whole requests yet
    # (queued requests and an unfinished one); a connection past it is cut. TCP only: an ipc
    # socket file is private to the store's user.
    max_connection_bytes: int = knob(1 * MiB, 1, 2**50)
    # the same over all connections; the largest is cut first
    max_buffered_bytes: int = knob(4 * MiB, 1, 2**50)

    # The client.
    fetch_timeout_s: float = knob(60.0, 0.001, 86_400.0)  # deadline of one fetch call, all keys together
    # bytes asked for by one request (large tensors are split)
    max_request_bytes: int = knob(8 * MiB, 1, 2**50)
    pipeline_depth: int = knob(4, 1, 1024)  # requests in flight per producer
    # Sockets one client keeps open (one per producer; the least recently used are closed past
    # it). A fetch from more producers goes to them in waves of this many: a trainer or a reward
    # replica fed by a thousand rollouts would otherwise hold a thousand sockets, past libzmq's
    # 1,023 per process (EMFILE, "Too many open files"), docs/scaling.md.
    max_peers: int = knob(128, 1, 2**20)
    # Busy-check this long for a reply before sleeping: a thread wake-up costs 50-300 us on
    # virtual machines, so small round trips get faster for at most this much CPU (and GIL)
    # per wait. 0 sleeps at once.
    spin_us: int = knob(300, 0, 1_000_000)

    def __post_init__(self) -> None:
        check_ranges(self, "bus")  # built in code too, not only from a recipe: ranges first
        self.validate()

    def validate(self) -> None:
        """Refuse settings that cannot work, naming the field and the fix."""
        positive = (
            "max_bytes",
            "chunk_bytes",
            "max_header_bytes",
            "max_request_bytes",
            "pipeline_depth",
            "max_request_header_bytes",
            "max_peers",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"bus.{name} must be positive, got {getattr(self, name)}")
        if self.put_timeout_s < 0 or self.fetch_timeout_s <= 0:
            raise ValueError("bus.put_timeout_s must be >= 0 and bus.fetch_timeout_s > 0")
        if self.transport not in ("tcp", "ipc"):
            raise ValueError(f"bus.transport must be 'tcp' or 'ipc', got {self.transport!r}")
        if self.when_full not in ("wait", "evict_oldest"):
            raise ValueError(f"bus.when_full must be 'wait' or 'evict_oldest', got {self.when_full!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"bus.port must be in 0..65535 (0 = a free port), got {self.port}")
        if self.max_connection_bytes < 4 * self.max_request_header_bytes:
            raise ValueError(
                f"bus.max_connection_bytes={self.max_connection_bytes} must hold 4 requests of "
                f"bus.max_request_header_bytes={self.max_request_header_bytes}: raise it"
            )
        if self.max_buffered_bytes < self.max_connection_bytes:
            raise ValueError("bus.max_buffered_bytes must be >= bus.max_connection_bytes")

    def resolve_secret(self) -> bytes | None:
        """The run's secret, or None when none is configured anywhere.

        Raises ValueError when a named file cannot be read or holds nothing (a mounted secret
        that is empty must not silently turn authentication off), or when both environment
        variables are set.
        """
        if self.secret:
            return self.secret.encode()
        if self.secret_file:
            return _read_secret(self.secret_file, "bus.secret_file")
        value, path = os.environ.get(SECRET_ENV, ""), os.environ.get(SECRET_FILE_ENV, "")
        if value and path:
            raise ValueError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set: keep one")
        if value:
            return value.encode()
        return _read_secret(path, SECRET_FILE_ENV) if path else None


def _read_secret(path: str, origin: str) -> bytes:
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the bus secret from {path} ({origin}): {exc.strerror}") from None
    if not secret:
        raise ValueError(f"the bus secret file {path} ({origin}) is empty")
    return secret
