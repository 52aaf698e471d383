"""The gRPC runtime every service shares: an actor behind a grpc.aio server (health, READY
handshake, drain, deadlines, TLS, token, tracing) and the client side that talks to it."""

from flowgrpo.runtime.actor import Actor, message
from flowgrpo.runtime.client import default_deadline, open_channel, wait_ready
from flowgrpo.runtime.config import ClientConfig, ServerConfig, TLSConfig
from flowgrpo.runtime.errors import (
    Abandoned,
    HandshakeError,
    InvalidArgument,
    NotReadyError,
    ServiceError,
    Unavailable,
)
from flowgrpo.runtime.mailbox import raise_if_abandoned
from flowgrpo.runtime.server import Service, ServiceServer, serve

__all__ = [
    "Abandoned",
    "Actor",
    "ClientConfig",
    "HandshakeError",
    "InvalidArgument",
    "NotReadyError",
    "ServerConfig",
    "Service",
    "ServiceError",
    "ServiceServer",
    "TLSConfig",
    "Unavailable",
    "default_deadline",
    "message",
    "open_channel",
    "raise_if_abandoned",
    "serve",
    "wait_ready",
]
