"""Typed configs of the gRPC runtime: plain dataclasses of simple types, so the run config's
dotted overrides (``rollout.server.port=50051``) reach every field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from flowgrpo.bus.config import BusConfig
from flowgrpo.fields import knob


@dataclass
class TLSConfig:
    """PEM file paths. Empty paths mean plaintext, which is only for loopback runs.

    Server: TLS when ``cert`` is set; with ``require_client_cert`` it also demands a client
    certificate signed by ``ca`` (mutual TLS). Client: TLS when ``ca`` is set (the server is
    verified with it); ``cert`` and ``key`` add the client certificate that mutual TLS requires.
    """

    cert: str = ""  # this side's certificate chain
    key: str = ""  # this side's private key
    ca: str = ""  # the CA that signs the peer's certificate
    require_client_cert: bool = False  # server only: mutual TLS


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # "0.0.0.0" in containers
    port: int = knob(0, 0, 65_535)  # 0: a free port, reported in the ready file and the logs
    advertise_host: str = ""  # host peers dial; default: host, or the hostname when host is a wildcard
    # calls that carry the token (any call without a token set) served at once, handshakes
    # included; more are refused (RESOURCE_EXHAUSTED). Refused strangers and health probes take none
    concurrency: int = knob(64, 1, 1_000_000)
    # TCP connections held at once (gRPC closes new ones past it): a bound on idle strangers too
    max_connections: int = knob(4096, 1, 1_000_000)
    # HTTP/2 streams one connection may have open, at least `concurrency` (calls past it wait)
    max_streams_per_connection: int = knob(256, 1, 1_000_000)
    # a connection with no call for this long is closed (GOAWAY; a client reconnects on its next call)
    idle_connection_s: float = knob(300.0, 0.1, 86_400.0)
    # a new connection must finish its handshake (TLS, HTTP/2 SETTINGS acknowledged) within this
    handshake_timeout_s: float = knob(10.0, 0.1, 3_600.0)
    # how long in-flight messages may finish after SIGTERM or Drain
    drain_grace_s: float = knob(30.0, 0.0, 86_400.0)
    # control plane only: bulk data goes on the bus
    max_message_bytes: int = knob(16 * 1024 * 1024, 1024, 2**31 - 1)
    # client keepalive pings more frequent than this are refused
    min_ping_interval_s: float = knob(10.0, 0.0, 86_400.0)
    ready_file: str = ""  # JSON {grpc_address, pid, role, replica_id} written once the port is bound
    tls: TLSConfig = field(default_factory=TLSConfig)
    token: str = ""  # shared token callers must send; empty: FLOWGRPO_TOKEN(_FILE), or no check when unset
    # serve beyond loopback with no credential (no token, no mutual TLS): refused unless this is set
    insecure: bool = False


@dataclass
class ClientConfig:
    tls: TLSConfig = field(default_factory=TLSConfig)
    token: str = ""  # shared token sent as "authorization: Bearer ..."; empty: FLOWGRPO_TOKEN
    default_deadline_s: float = knob(60.0, 0.001, 7 * 86_400.0)  # deadline of any call made without one
    # how long wait_ready waits for a READY handshake by default
    connect_timeout_s: float = knob(120.0, 0.001, 7 * 86_400.0)
    # ping an idle connection this often to notice a dead peer
    keepalive_s: float = knob(30.0, 0.001, 86_400.0)
    max_message_bytes: int = knob(16 * 1024 * 1024, 1024, 2**31 - 1)


@dataclass
class ServiceProcessConfig:
    """What every service process has beside its own section (``rollout``, ``trainer``, ...):
    its gRPC server, its data-bus store and client, and how it logs and traces."""

    server: ServerConfig = field(default_factory=ServerConfig)
    bus: BusConfig = field(default_factory=BusConfig)
    replica_id: str = ""  # default: <role>-<random>
    run_dir: str = ""  # trace files go to <run_dir>/traces (beside any OTLP export)
    # host:port of the run's coordinator: register there, send heartbeats, leave on drain
    # (how replicas started by compose or Kubernetes join a run); empty: the coordinator dials us
    coordinator: str = ""
    # > 0: this replica was launched by its coordinator (the local launcher), not deployed: after
    # this long without an answer from the coordinator it drains and exits, so a coordinator that
    # died leaves nothing running. 0 (deployed): it waits for a coordinator however long it takes.
    orphan_after_s: float = knob(0.0, 0.0, 365 * 86_400.0)
    log_format: Literal["json", "text"] = "json"

    def validate(self) -> None:
        if not math.isfinite(self.orphan_after_s) or self.orphan_after_s < 0:
            raise ValueError(f"orphan_after_s={self.orphan_after_s}: give seconds >= 0 (0: never)")
