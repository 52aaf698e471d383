"""BusServer: serves one TensorStore on a ZMQ ROUTER socket from a background thread.

The thread answers FETCH, RELEASE, STAT and PING requests one at a time. Large tensor frames
are handed to ZMQ zero-copy, straight from the store's memory; a tensor in shared memory is
answered with its segment name when the client proved it shares /dev/shm.

Bad input never stops the thread: a malformed request gets an ERROR reply naming what was
wrong, a failed key gets a typed per-key error, an unexpected exception is logged with its
traceback and answered INTERNAL; then the next request is served.

Who may connect is settled before any of that (``flowgrpo.bus.auth``): with the run's secret the
socket is a CURVE server admitting only the run's client key; without one it binds loopback or
ipc only (ipc in a folder only its user can enter), unless ``insecure``. What a connection may
make the socket buffer is bounded by MAXMSGSIZE (a frame), RCVHWM (whole requests queued) and,
for a request that never ends, the :class:`~flowgrpo.bus.guard.ConnectionGuard` (TCP).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import threading

import zmq

from flowgrpo.bus import auth, shm, wire
from flowgrpo.bus.config import BusConfig
from flowgrpo.bus.errors import BusError, ErrorCode
from flowgrpo.bus.guard import ConnectionGuard, frame_wire_bytes
from flowgrpo.bus.store import StoredTensor, TensorStore
from flowgrpo.bus.wire import ItemError, ItemMeta, KeyRange, WireError
from flowgrpo.logs import Throttled

log = logging.getLogger(__name__)

_POLL_MS = 100  # how often the thread checks for close()
_SEND_TIMEOUT_MS = 10_000  # a client that stops reading loses its reply after this, others go on
_MAX_FRAMES = 2  # a request is (type, header)
# Queue limits in messages (a reply is one, whatever its size). A client keeps pipeline_depth
# requests in flight, so only a flood or a client that stopped reading reaches them; a full
# receive queue makes libzmq stop reading that connection (TCP pushes back on the client).
_SNDHWM = 1000
_RCVHWM = 16  # whole requests queued per connection: 16 x max_request_header_bytes at most
_HANDSHAKE_MS = 5000  # a peer that has not finished its handshake by then is dropped


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
        keys = auth.run_keys(self.config)
        auth.check_exposure(self.config, keys)
        self.authenticated = keys is not None
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._zap_domain = auth.serve_curve(self._sock, keys) if keys is not None else None
        self._guard: ConnectionGuard | None = None
        self._refusals = Throttled(log, logging.INFO)  # what a stranger sends must not grow the log
        self._ipc_dir: str | None = None
        try:
            if self.config.transport == "tcp":
                self._guard = ConnectionGuard(
                    self._sock,
                    curve=keys is not None,
                    per_connection=self.config.max_connection_bytes,
                    total=self.config.max_buffered_bytes,
                    name=store.store_id,
                )
            self.endpoint, self._ipc_dir = self._bind()
        except BaseException:
            self._sock.close(linger=0)
            self._release_resources()
            raise
        if self._guard is not None:
            self._guard.start(int(self.endpoint.rsplit(":", 1)[1]))
        store.endpoint = self.endpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"bus-server-{store.store_id}", daemon=True)
        self._thread.start()

    def _bind(self) -> tuple[str, str | None]:
        cfg, sock = self.config, self._sock
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _SNDHWM)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full client pipe raises instead of dropping
        sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        sock.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_MS)
        # A larger frame makes libzmq drop the connection; up to it, a too-large header is refused
        # with an ERROR reply that names the limit.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * cfg.max_request_header_bytes)
        if cfg.socket_buffer_bytes > 0:
            sock.setsockopt(zmq.SNDBUF, cfg.socket_buffer_bytes)
            sock.setsockopt(zmq.RCVBUF, cfg.socket_buffer_bytes)
        if cfg.transport == "ipc":  # in a folder of mode 0700: other users cannot connect
            parent = cfg.ipc_dir or tempfile.gettempdir()
            shm.remove_stale(parent)  # the folders of killed servers
            folder = os.path.join(parent, shm.new_name())
            os.mkdir(folder, 0o700)
            path = os.path.join(folder, shm.IPC_SOCKET)
            try:
                sock.bind(f"ipc://{path}")
            except zmq.ZMQError:
                os.rmdir(folder)
                raise
            return f"ipc://{path}", folder
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
            route = self._sock.recv(wire.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        frames, extra, wire_bytes = self._recv_rest()
        if self._guard is not None:
            self._guard.credit(route.get(zmq.SRCFD), wire_bytes)
        reply, data = self._answer(frames, extra)
        try:
            wire.send(self._sock, reply, data, route=route.bytes)
        except zmq.Again:
            log.warning(
                "bus %s: a client did not read for %d ms; dropped its reply", self.endpoint, _SEND_TIMEOUT_MS
            )
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client went away
            log.info("bus %s: reply to a departed client dropped (%s)", self.endpoint, exc)
        return True

    def _recv_rest(self) -> tuple[list[bytes], int, int]:
        """The frames after the routing id: at most _MAX_FRAMES kept, the others counted; and
        the bytes all of them took on the wire."""
        frames: list[bytes] = []
        extra = wire_bytes = 0
        curve = self.authenticated
        while self._sock.getsockopt(wire.RCVMORE):
            frame = self._sock.recv(copy=False)
            wire_bytes += frame_wire_bytes(len(frame), curve)
            if len(frames) < _MAX_FRAMES:
                frames.append(frame.bytes)
            else:
                extra += 1
        return frames, extra, wire_bytes

    # --- answering ----------------------------------------------------------------------------

    def _answer(self, frames: list[bytes], extra: int) -> tuple[wire.Reply, list[memoryview]]:
        try:
            return self._dispatch(self._parse(frames, extra))
        except BusError as exc:  # a request the store refuses (RELEASE of everything)
            return self._refuse(frames, exc.code, exc.message)
        except WireError as exc:
            return self._refuse(frames, ErrorCode.INVALID_ARGUMENT, f"malformed request: {exc}")
        except Exception as exc:
            log.exception("bus %s: request failed", self.endpoint)
            return self._refuse(
                frames, ErrorCode.INTERNAL, f"internal error ({type(exc).__name__}: {exc}); logged"
            )

    def _parse(self, frames: list[bytes], extra: int) -> wire.Request:
        if len(frames) != _MAX_FRAMES or extra:
            raise WireError(f"a request has 2 frames (type, header), got {len(frames) + extra}")
        token, header = frames
        if token not in wire.TOKEN_NAMES or token == wire.ERROR:
            raise WireError(
                f"unknown message type {token[:8]!r}; known: F, R, S, P (FETCH, RELEASE, STAT, PING)"
            )
        limit = self.config.max_request_header_bytes
        if len(header) > limit:
            raise WireError(f"request header of {len(header)} bytes exceeds max_request_header_bytes={limit}")
        return wire.decode_request(token, wire.unpack(header, limit))

    def _refuse(
        self, frames: list[bytes], code: ErrorCode, message: str
    ) -> tuple[wire.Reply, list[memoryview]]:
        self._refusals("bus %s refused a request: %s", self.endpoint, message)
        rid = wire.peek_rid(frames[1:2], self.config.max_request_header_bytes)
        return wire.ErrorReply(rid, code, message), []

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
        self.store.count_served(entry.tag, end - wanted.offset)
        self.store.served_total += end - wanted.offset  # this thread alone writes it
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
        self._release_resources()
        if self._owns_store:
            self.store.close()

    def _release_resources(self) -> None:
        """What the socket leaves behind once closed: its guard, ZAP domain and ipc folder."""
        if self._guard is not None:
            self._guard.close()
        if self._zap_domain is not None:
            auth.release_domain(self._zap_domain)
        if self._ipc_dir:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._ipc_dir, shm.IPC_SOCKET))
            with contextlib.suppress(OSError):
                os.rmdir(self._ipc_dir)

    def __enter__(self) -> BusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_store(config: BusConfig | None = None) -> BusServer:
    """A new store served on a new socket; closing the server closes the store."""
    store = TensorStore(config)
    return BusServer(store, owns_store=True)
