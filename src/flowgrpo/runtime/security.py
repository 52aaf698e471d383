"""Transport security and the shared token.

TLS authenticates the server (the client verifies it with the CA); mutual TLS also authenticates
the client (the server demands a certificate signed by the CA). The shared token is a second,
independent check for deployments without client certificates: every call but health probes
must carry ``authorization: Bearer <token>``, compared in constant time.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import grpc.aio

from flowgrpo.runtime.config import TLSConfig
from flowgrpo.runtime.interceptors import GuardInterceptor, add_metadata, call_details_interceptors

TOKEN_ENV = "FLOWGRPO_TOKEN"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
_AUTH_KEY = "authorization"


def resolve_token(configured: str) -> str:
    """The configured token, else ``$FLOWGRPO_TOKEN``, else "" (no token)."""
    return configured or os.environ.get(TOKEN_ENV, "")


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


def token_server_interceptor(token: str) -> GuardInterceptor:
    """Refuse with UNAUTHENTICATED any call but a health probe whose bearer token is not ``token``."""
    expected = f"Bearer {token}".encode()

    @asynccontextmanager
    async def check(method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        sent = dict(context.invocation_metadata() or ()).get(_AUTH_KEY, "")
        if not hmac.compare_digest(str(sent).encode(), expected):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"missing or wrong token: send 'authorization: Bearer <token>' with the shared token "
                f"(client config token, or ${TOKEN_ENV})",
            )
        yield

    return GuardInterceptor(check, applies=lambda method: not method.startswith(HEALTH_PREFIX))


def token_client_interceptor(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Send ``token`` as ``authorization: Bearer <token>`` with every call, streamed ones too."""
    return call_details_interceptors(lambda details: add_metadata(details, _AUTH_KEY, f"Bearer {token}"))


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{what}: cannot read {path}: {error.strerror}") from error
