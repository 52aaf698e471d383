"""Who may talk to a store: CURVE keys derived from the run's secret, checked at the handshake.

With a secret (``BusConfig.resolve_secret``), every store socket is a CURVE server and every
client socket a CURVE client. Both keypairs are derived from the secret (HKDF-SHA256, one label
each), so one shared per-run secret, distributed like a token, is all a deployment sets up:

- the store's secret key -> its public key, which every client pins as the server key;
- the clients' secret key -> one public key, the only one the store's ZAP handler admits.

libzmq checks all of it during the handshake, before any request frame is decoded: a peer
without CURVE (raw ZMTP, the NULL mechanism) fails on the mechanism, a peer with other keys
fails to open the HELLO box or is refused by ZAP; all are disconnected having buffered nothing
but handshake commands (bounded by MAXMSGSIZE). After the handshake every frame is encrypted and
authenticated (crypto_box) with strictly increasing nonces, so frames cannot be read, altered,
reordered or replayed on the path.

Without a secret nothing is authenticated: a store then binds only loopback addresses or ipc
(other users of the host can still connect to loopback), unless ``insecure=true`` says loudly
that anyone reaching the port may read every tensor. Limits on what an authenticated or local
peer can make the store buffer: ``flowgrpo.bus.guard``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import itertools
import logging
import threading
from dataclasses import dataclass
from functools import lru_cache

import zmq
import zmq.utils.z85

from flowgrpo.bus.config import SECRET_ENV, SECRET_FILE_ENV, BusConfig

log = logging.getLogger(__name__)

_SALT = b"flowgrpo-bus-curve-v1"
_SERVER_LABEL, _CLIENT_LABEL = b"store secret key", b"client secret key"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27 (ZAP)
_POLL_MS = 100
WEAK_SECRET_BYTES = 16  # shorter secrets can be guessed offline from one recorded handshake
_domains = itertools.count()


class InsecureBusError(ValueError):
    """A store would listen beyond loopback with no secret."""


@dataclass(frozen=True)
class Keys:
    """The run's CURVE keys, Z85-encoded as libzmq takes them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def hkdf_sha256(secret: bytes, label: bytes, length: int = 32, salt: bytes = _SALT) -> bytes:
    """RFC 5869 HKDF with SHA-256: extract with ``salt``, expand with ``label``."""
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    out, block = b"", b""
    for counter in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + label + bytes([counter]), hashlib.sha256).digest()
        out += block
    return out[:length]


@lru_cache(maxsize=8)
def derive_keys(secret: bytes) -> Keys:
    """Both keypairs of a run, the same in every process that holds ``secret``."""
    server = zmq.utils.z85.encode(hkdf_sha256(secret, _SERVER_LABEL))
    client = zmq.utils.z85.encode(hkdf_sha256(secret, _CLIENT_LABEL))
    return Keys(zmq.curve_public(server), server, zmq.curve_public(client), client)


def run_keys(config: BusConfig) -> Keys | None:
    """The keys of ``config``'s secret, None without one (raises ValueError on a bad file)."""
    secret = config.resolve_secret()
    if secret is None:
        return None
    if len(secret) < WEAK_SECRET_BYTES:
        log.warning(
            "the bus secret has %d bytes: one recorded handshake lets an eavesdropper try guesses "
            "offline; use 32 random bytes, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'",
            len(secret),
        )
    return derive_keys(secret)


# --- the store side -------------------------------------------------------------------------------


def is_local(config: BusConfig) -> bool:
    """True for ipc and loopback binds (localhost, 127.0.0.0/8, ::1): only this host connects."""
    host = config.host.strip("[]")
    if config.transport == "ipc" or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a wildcard or a host name: reachable from wherever the network says


def check_exposure(config: BusConfig, keys: Keys | None) -> None:
    """Refuse a bind beyond loopback without a secret, unless ``insecure`` (then warn)."""
    if keys is not None or is_local(config):
        return
    where = f"tcp://{config.host}:{config.port or '*'}"
    if config.insecure:
        log.warning(
            "INSECURE: a bus store listens on %s with no secret (bus.insecure=true): anyone who "
            "reaches the port can read and release every tensor it holds; set %s",
            where,
            SECRET_ENV,
        )
        return
    raise InsecureBusError(
        f"a bus store would listen on {where}, reachable from the network, with no secret: set "
        f"{SECRET_ENV} (or {SECRET_FILE_ENV}, bus.secret_file, bus.secret) to the same value in every "
        "process of the run; bus.insecure=true serves without one (anyone who reaches the port reads "
        "every tensor), and a loopback bus.host needs none"
    )


def serve_curve(sock: zmq.Socket[bytes], keys: Keys) -> str:
    """Make ``sock`` (not bound yet) a CURVE server that admits only the run's client key.

    Returns the ZAP domain to pass to :func:`release_domain` once the socket is closed.
    """
    domain = f"flowgrpo-bus-{next(_domains)}"
    _handler.admit(domain, zmq.utils.z85.decode(keys.client_public))
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler answering: refuse, never admit
    return domain


def release_domain(domain: str) -> None:
    _handler.forget(domain)


def connect_curve(sock: zmq.Socket[bytes], keys: Keys) -> None:
    """Make ``sock`` (not connected yet) a CURVE client of the run's stores."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


class ZapHandler:
    """The process's ZAP handler (RFC 27): answers libzmq's handshake checks from a thread.

    One per ZMQ context (the endpoint is fixed); it runs while some store has a domain in it
    and stops with the last. A request is admitted when its mechanism is CURVE and its client
    key is the one admitted for its domain; everything else is answered 400.
    """

    def __init__(self) -> None:
        self._allowed: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def admit(self, domain: str, client_key: bytes) -> None:
        with self._lock:
            self._allowed[domain] = client_key
            if self._thread is None or not self._thread.is_alive():  # first, or its context ended
                sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REP)
                sock.setsockopt(zmq.LINGER, 0)
                try:
                    sock.bind(_ZAP_ENDPOINT)
                except zmq.ZMQError as exc:
                    sock.close()
                    del self._allowed[domain]
                    raise RuntimeError(
                        f"cannot serve ZAP at {_ZAP_ENDPOINT} ({exc}): another authenticator of this "
                        "process holds it (zmq.auth?); bus stores need it for their CURVE keys"
                    ) from None
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, args=(sock,), name="bus-zap", daemon=True)
                self._thread.start()

    def forget(self, domain: str) -> None:
        with self._lock:
            self._allowed.pop(domain, None)
            if self._allowed or self._thread is None:
                return
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self, sock: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if sock.poll(_POLL_MS):
                    sock.send_multipart(self._answer(sock.recv_multipart()))
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:  # not from libzmq: refuse in the reply's shape
            request_id = request[1] if len(request) > 1 else b""
            return [b"1.0", request_id, b"400", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism, *credentials = request
        allowed = self._allowed.get(domain.decode(errors="replace"))
        ok = (
            mechanism == b"CURVE"
            and allowed is not None
            and len(credentials) == 1
            and hmac.compare_digest(credentials[0], allowed)
        )
        if not ok:
            log.info("bus: refused a %r peer from %r at the handshake", mechanism, address)
            return [version, request_id, b"400", b"not a peer of this run", b"", b""]
        return [version, request_id, b"200", b"OK", b"", b""]


_handler = ZapHandler()
