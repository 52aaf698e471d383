"""Configuration of the data bus: one plain dataclass shared by stores, servers and clients.

The defaults are the recipe's: a store bounded at 8 GiB that makes ``put`` wait for releases
(the coordinator releases a step's data once the trainer consumed it), 16 MiB frames,
shared memory between processes of one host, and a 60 s deadline on every fetch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

MiB = 1 << 20
GiB = 1 << 30
SECRET_ENV = "FLOWGRPO_BUS_SECRET"


@dataclass
class BusConfig:
    # Where the store's ROUTER socket listens. "tcp" reaches other hosts; "ipc" (a Unix socket)
    # is a little faster on one host.
    transport: Literal["tcp", "ipc"] = "tcp"
    host: str = "127.0.0.1"  # tcp bind address; "0.0.0.0" listens on every interface
    port: int = 0  # tcp port; 0 binds a free port and the endpoint reports the real one
    # Host name put in TensorRefs for consumers to connect to; None: `host`, or this machine's
    # host name when `host` is a wildcard address.
    advertise_host: str | None = None
    ipc_dir: str = ""  # folder of the ipc socket file; "" = the system's temporary folder

    # The bounded store.
    max_bytes: int = 8 * GiB  # capacity of one store (shared memory included)
    # "wait": put blocks up to put_timeout_s for releases, then fails naming the oldest keys;
    # "evict_oldest": put drops the oldest tensors (their fetch answers EVICTED).
    when_full: Literal["wait", "evict_oldest"] = "wait"
    put_timeout_s: float = 60.0
    max_tombstones: int = 65536  # released/evicted keys remembered to answer RELEASED/EVICTED

    # The wire.
    chunk_bytes: int = 16 * MiB  # largest data frame; tensors are split into frames this size
    max_header_bytes: int = 1 * MiB  # larger msgpack headers are refused
    socket_buffer_bytes: int = 4 * MiB  # kernel SNDBUF/RCVBUF (Unix sockets default: 208 KiB); 0 = OS

    # Shared memory between processes of one host (same /dev/shm, proven by a probe file).
    shm: bool = True
    shm_min_bytes: int = 1 * MiB  # smaller tensors travel in socket frames (faster for them)
    shm_dir: str = "/dev/shm"

    # HMAC-SHA256 key of every message; None: read FLOWGRPO_BUS_SECRET, unset means no MAC.
    # Kept out of resolved configs written to the run folder: prefer the environment variable.
    secret: str | None = None

    # The client.
    fetch_timeout_s: float = 60.0  # deadline of one fetch call, all keys together
    max_request_bytes: int = 8 * MiB  # bytes asked for by one request (large tensors are split)
    pipeline_depth: int = 4  # requests in flight per producer
    # Busy-check this long for a reply before sleeping: a thread wake-up costs 50-300 us on
    # virtual machines, so small round trips get faster for at most this much CPU (and GIL)
    # per wait. 0 sleeps at once.
    spin_us: int = 300

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse settings that cannot work, naming the field and the fix."""
        positive = ("max_bytes", "chunk_bytes", "max_header_bytes", "max_request_bytes", "pipeline_depth")
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

    def mac_key(self) -> bytes | None:
        """The HMAC key: ``secret``, else the FLOWGRPO_BUS_SECRET environment variable."""
        secret = self.secret if self.secret is not None else os.environ.get(SECRET_ENV)
        return secret.encode() if secret else None
