"""BusServer: serves one TensorStore on a ZMQ ROUTER socket from a background thread.

The thread answers FETCH, RELEASE, STAT and PING requests one at a time. Large tensor frames
are handed to ZMQ zero-copy, straight from the store's memory; a tensor in shared memory is
answered with its segment name when the client proved it shares /dev/shm.

Bad input never stops the thread: a malformed or unauthenticated request gets an ERROR reply
naming what was wrong, a failed key gets a typed per-key error, an unexpected exception is
logged with its traceback and answered INTERNAL; then the next request is served.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import tempfile
import threading

import zmq

from flowgrpo.bus import wire
from flowgrpo.bus.config import BusConfig
from flowgrpo.bus.errors import ErrorCode
from flowgrpo.bus.store import StoredTensor, TensorStore
from flowgrpo.bus.wire import AuthError, ItemError, ItemMeta, KeyRange, WireError

log = logging.getLogger(__name__)

_POLL_MS = 100  # how often the thread checks for close()
_SEND_TIMEOUT_MS = 10_000  # a client that stops reading loses its reply after this, others go on
_MAX_FRAMES = 3  # a request is (type, header, MAC)
# Queue limits in messages (a reply is one, whatever its size). A client keeps pipeline_depth
# requests in flight, so only a flood or a client that stopped reading reaches them.
_HWM = 1000


class BusServer:
    """Binds a ROUTER socket for ``store`` and serves it until :meth:`close`.

    ``endpoint`` is the address consumers connect to (the real port when ``port`` was 0); it is
    also written into the store, so the refs it hands out point here.
    """

    def __init__(
        self, store: TensorStore, config: BusConfig | None = None, *, owns_store: bool = False
    ) -> None:
        if store.endpoint:
            raise ValueError(f"store {store.store_id} is already served at {store.endpoint}")
        self.store = store
        self.config = config or store.config
        self._owns_store = owns_store
        self._key = self.config.mac_key()
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.endpoint, self._ipc_path = self._bind()
        store.endpoint = self.endpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"bus-server-{store.store_id}", daemon=True)
        self._thread.start()

    def _bind(self) -> tuple[str, str | None]:
        cfg, sock = self.config, self._sock
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _HWM)
        sock.setsockopt(zmq.RCVHWM, _HWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full client pipe raises instead of dropping
        sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * cfg.max_header_bytes)  # DoS cap; requests are headers
        if cfg.socket_buffer_bytes > 0:
            sock.setsockopt(zmq.SNDBUF, cfg.socket_buffer_bytes)
            sock.setsockopt(zmq.RCVBUF, cfg.socket_buffer_bytes)
        if cfg.transport == "ipc":
            path = os.path.join(
                cfg.ipc_dir or tempfile.gettempdir(),
                f"flowgrpo-bus-{os.getpid()}-{secrets.token_hex(6)}.sock",
            )
            sock.bind(f"ipc://{path}")
            return f"ipc://{path}", path
        sock.bind(f"tcp://{cfg.host}:{cfg.port or '*'}")
        port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        return f"tcp://{self._advertised_host()}:{port}", None

    def _advertised_host(self) -> str:
        if self.config.advertise_host:
            return self.config.advertise_host
        if self.config.host in ("0.0.0.0", "*", "::", ""):
            return socket.gethostname()
        return self.config.host

    # --- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(_POLL_MS):
                    self._serve_waiting()
        except zmq.ContextTerminated:
            log.info("bus server %s stopped: the ZMQ context was terminated", self.endpoint)
        finally:
            self._sock.close(linger=0)

    def _serve_waiting(self) -> None:
        """Answer requests until none is waiting; a failure costs one reply, never the thread."""
        while True:
            try:
                if not self._serve_one():
                    return
            except zmq.ContextTerminated:
                raise
            except Exception:
                log.exception("bus %s: a request could not be answered; serving on", self.endpoint)

    def _serve_one(self) -> bool:
        """Answer one waiting request; False when none is waiting."""
        try:
            route = self._sock.recv(wire.NOBLOCK)
        except zmq.Again:
            return False
        frames, extra = self._recv_rest()
        reply, data = self._answer(frames, extra)
        try:
            wire.send(self._sock, reply, self._key, data, route=route)
        except zmq.Again:
            log.warning(
                "bus %s: a client did not read for %d ms; dropped its reply", self.endpoint, _SEND_TIMEOUT_MS
            )
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client went away
            log.info("bus %s: reply to a departed client dropped (%s)", self.endpoint, exc)
        return True

    def _recv_rest(self) -> tuple[list[bytes], int]:
        """The frames after the routing id: at most _MAX_FRAMES kept, the others counted."""
        frames: list[bytes] = []
        extra = 0
        while self._sock.getsockopt(wire.RCVMORE):
            frame = self._sock.recv(copy=False)
            if len(frames) < _MAX_FRAMES:
                frames.append(frame.bytes)
            else:
                extra += 1
        return frames, extra

    # --- answering ----------------------------------------------------------------------------

    def _answer(self, frames: list[bytes], extra: int) -> tuple[wire.Reply, list[memoryview]]:
        try:
            return self._dispatch(self._parse(frames, extra))
        except AuthError as exc:
            return self._refuse(frames, ErrorCode.UNAUTHENTICATED, f"unauthenticated request: {exc}")
        except WireError as exc:
            return self._refuse(frames, ErrorCode.INVALID_ARGUMENT, f"malformed request: {exc}")
        except Exception as exc:
            log.exception("bus %s: request failed", self.endpoint)
            return self._refuse(
                frames, ErrorCode.INTERNAL, f"internal error ({type(exc).__name__}: {exc}); logged"
            )

    def _parse(self, frames: list[bytes], extra: int) -> wire.Request:
        if len(frames) != _MAX_FRAMES or extra:
            raise WireError(f"a request has 3 frames (type, header, MAC), got {len(frames) + extra}")
        token, header, mac = frames
        if token not in wire.TOKEN_NAMES or token == wire.ERROR:
            raise WireError(
                f"unknown message type {token[:8]!r}; known: F, R, S, P (FETCH, RELEASE, STAT, PING)"
            )
        if len(header) > self.config.max_header_bytes:  # refused before hashing it for the MAC
            raise WireError(
                f"header of {len(header)} bytes exceeds max_header_bytes={self.config.max_header_bytes}"
            )
        wire.check_mac(self._key, token, header, [], mac)
        return wire.decode_request(token, wire.unpack(header, self.config.max_header_bytes))

    def _refuse(
        self, frames: list[bytes], code: ErrorCode, message: str
    ) -> tuple[wire.Reply, list[memoryview]]:
        log.info("bus %s refused a request: %s", self.endpoint, message)
        return wire.ErrorReply(wire.peek_rid(frames[1:2], self.config.max_header_bytes), code, message), []

    def _dispatch(self, request: wire.Request) -> tuple[wire.Reply, list[memoryview]]:
        if isinstance(request, wire.FetchRequest):
            return self._fetch(request)
        if isinstance(request, wire.ReleaseRequest):
            released = self.store.release(request.keys, tag=request.tag, prefix=request.prefix)
            return wire.ReleaseReply(request.rid, released), []
        if isinstance(request, wire.StatRequest):
            return wire.StatReply(request.rid, self.store.info()), []
        return wire.PingReply(request.rid), []

    def _fetch(self, request: wire.FetchRequest) -> tuple[wire.Reply, list[memoryview]]:
        items: list[ItemMeta | ItemError] = []
        frames: list[memoryview] = []
        for wanted in request.items:
            if request.store_id and request.store_id != self.store.store_id:
                items.append(ItemError(wanted.key, ErrorCode.DATA_LOST, self._restarted(request.store_id)))
                continue
            found = self.store.lookup(wanted.key)
            if isinstance(found, ItemError):
                items.append(found)
            else:
                items.append(self._item(found, wanted, request.shm, frames))
        return wire.FetchReply(request.rid, items), frames

    def _restarted(self, store_id: str) -> str:
        return (
            f"the ref points to store {store_id} but {self.endpoint} now serves store {self.store.store_id}: "
            "the producer restarted and the data must be re-produced"
        )

    def _item(
        self, entry: StoredTensor, wanted: KeyRange, shm: bool, frames: list[memoryview]
    ) -> ItemMeta | ItemError:
        """Describe ``entry`` (or the requested range of it) and append its data frames."""
        end = entry.nbytes if wanted.length < 0 else wanted.offset + wanted.length
        if end > entry.nbytes or wanted.offset > end:
            message = f"range [{wanted.offset}, {end}) lies outside {wanted.key!r} of {entry.nbytes} bytes"
            return ItemError(wanted.key, ErrorCode.INVALID_ARGUMENT, message)
        meta = ItemMeta(
            wanted.key,
            entry.column,
            entry.dtype,
            list(entry.shape),
            entry.nbytes,
            entry.policy_version,
            entry.trace,
            offset=wanted.offset,
        )
        if shm and entry.segment is not None and wanted.offset == 0 and end == entry.nbytes:
            meta.shm = entry.segment
            return meta
        data = entry.data.data
        step = self.config.chunk_bytes
        for start in range(wanted.offset, end, step):
            frames.append(data[start : min(start + step, end)])
            meta.chunks.append(min(step, end - start))
        return meta

    # --- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving (in-flight replies are dropped), then close the store if owned."""
        self._stop.set()
        self._thread.join(timeout=10)
        if self._ipc_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ipc_path)
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> BusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_store(config: BusConfig | None = None) -> BusServer:
    """A new store served on a new socket; closing the server closes the store."""
    store = TensorStore(config)
    return BusServer(store, owns_store=True)
