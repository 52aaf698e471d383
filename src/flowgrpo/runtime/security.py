"""Transport security, the shared token, and who may serve without them.

TLS authenticates the server (the client verifies it with the CA); mutual TLS also authenticates
the client (the server demands a certificate signed by the CA). The shared token is a second,
independent check for deployments without client certificates: every call but health probes
must carry ``authorization: Bearer <token>``, compared in constant time. The token is checked
when the call arrives, from its metadata, before a handler exists (``admission.py``: a refused call
takes no slot of ``server.concurrency`` and no request of it is parsed).

A server bound to anything but loopback must have a credential (mutual TLS, or the token:
TLS beside it keeps the token from travelling in clear) or refuses to start, unless
``server.insecure=true`` says, loudly, that anyone who reaches the port may drive it. Loopback
needs nothing; the ``local`` launcher still gives its run a token of its own.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path

import grpc
import grpc.aio

from flowgrpo.runtime.admission import AUTH_KEY
from flowgrpo.runtime.config import ServerConfig, TLSConfig
from flowgrpo.runtime.interceptors import add_metadata, call_details_interceptors

log = logging.getLogger(__name__)

TOKEN_ENV = "FLOWGRPO_TOKEN"
TOKEN_FILE_ENV = "FLOWGRPO_TOKEN_FILE"  # a file holding the token (a mounted Kubernetes secret)


class InsecureBindError(ValueError):
    """A server would listen beyond loopback with no credential."""


def resolve_token(configured: str) -> str:
    """The configured token, else ``$FLOWGRPO_TOKEN``, else the contents of the file named by
    ``$FLOWGRPO_TOKEN_FILE`` (stripped), else "" (no token)."""
    if configured or os.environ.get(TOKEN_ENV):
        return configured or os.environ[TOKEN_ENV]
    path = os.environ.get(TOKEN_FILE_ENV, "")
    if not path:
        return ""
    try:
        return Path(path).read_text().strip()
    except OSError as error:
        raise ValueError(f"${TOKEN_FILE_ENV}={path}: cannot read the token: {error.strerror}") from None


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 and ::1: only this machine can connect."""
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it resolves to whatever the network says


def check_bind_credentials(config: ServerConfig, what: str) -> None:
    """Refuse to serve beyond loopback without a credential (see the module docstring)."""
    if is_loopback(config.host):
        return
    mutual_tls = bool(config.tls.cert and config.tls.require_client_cert)
    token = bool(resolve_token(config.token))
    if mutual_tls or token:
        if token and not config.tls.cert:
            log.warning("%s listens on %s with a token but no TLS: the token travels in clear on that "
                        "network; set server.tls.cert/key (docs/security.md)", what, config.host)  # fmt: skip
        return
    if config.insecure:
        log.warning("INSECURE: %s listens on %s with no credential (server.insecure=true): anyone who "
                    "reaches the port can register, drain or drive it", what, config.host)  # fmt: skip
        return
    raise InsecureBindError(
        f"{what}: server.host={config.host} is reachable from the network but no credential is set: set "
        f"${TOKEN_ENV} (or ${TOKEN_FILE_ENV}, or server.token) on every service and the coordinator, or "
        "mutual TLS (server.tls.cert/key/ca with require_client_cert=true); server.insecure=true serves "
        "without one (anyone who reaches the port can drive the service)"
    )


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials | None:
    """Server TLS credentials, or None for plaintext (no ``cert``)."""
    if not tls.cert:
        if tls.key or tls.require_client_cert:
            raise ValueError("server tls: key or require_client_cert is set but cert is empty; set tls.cert")
        return None
    if not tls.key:
        raise ValueError(f"server tls: cert {tls.cert} has no key; set tls.key")
    if tls.require_client_cert and not tls.ca:
        raise ValueError(
            "server tls: require_client_cert needs tls.ca, the CA that signs client certificates"
        )
    return grpc.ssl_server_credentials(
        [(_read(tls.key, "tls.key"), _read(tls.cert, "tls.cert"))],
        root_certificates=_read(tls.ca, "tls.ca") if tls.ca else None,
        require_client_auth=tls.require_client_cert,
    )


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials | None:
    """Client TLS credentials, or None for plaintext (no ``ca``)."""
    if not tls.ca:
        if tls.cert or tls.key:
            raise ValueError("client tls: a client certificate is set but tls.ca is empty; set tls.ca")
        return None
    if bool(tls.cert) != bool(tls.key):
        raise ValueError("client tls: set both tls.cert and tls.key (mutual TLS), or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca, "tls.ca"),
        private_key=_read(tls.key, "tls.key") if tls.key else None,
        certificate_chain=_read(tls.cert, "tls.cert") if tls.cert else None,
    )


UNAUTHENTICATED = (
    f"missing or wrong token: send 'authorization: Bearer <token>' with the shared token "
    f"(client config token, ${TOKEN_ENV} or ${TOKEN_FILE_ENV})"
)


def token_client_interceptor(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Send ``token`` as ``authorization: Bearer <token>`` with every call, streamed ones too."""
    return call_details_interceptors(lambda details: add_metadata(details, AUTH_KEY, f"Bearer {token}"))


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{what}: cannot read {path}: {error.strerror}") from error
