"""ConnectionGuard: cuts the TCP connections that make a store's socket buffer too much.

libzmq bounds one frame (MAXMSGSIZE) and a queue of whole messages (RCVHWM), not a message in
progress: the frames of a multipart message pile up in the connection's pipe until its last
frame arrives, and a message that never ends is never delivered to be refused. Measured on a
NULL-mechanism socket with RCVHWM 16 and MAXMSGSIZE 4 MiB: a raw peer that sends 300 frames of
1 MiB and no last one grows the process by 300 MiB; 3 million empty frames (6 MB on the wire)
by 185 MiB (a 64-byte ``msg_t`` each), and 130 MiB of that stays after the peer left (heap
fragmentation). CURVE keeps strangers out at the handshake, not a peer that holds the secret,
nor local processes when there is no secret.

Bytes are not the whole cost: libzmq receives into 8 KiB buffers and a frame of 33 bytes or
more (every CURVE frame) keeps its buffer alive while it waits in the pipe. Measured: 20,000
empty CURVE frames sent one TCP segment each (700 KB on the wire) cost the store 131 MiB, 6.9 KB
a frame; the same frames sent back to back cost 3 MiB (157 bytes a frame).

So the guard watches each TCP connection the socket accepts (its socket monitor names the fd):
what libzmq has read from the connection (``tcpi_bytes_received`` less what still waits in the
kernel's queue) minus what the server thread took out of it as whole requests (credited per
connection, in wire bytes, from the source fd of each message) is what that connection holds
inside libzmq; each TCP segment with data (``tcpi_data_segs_in``: not the ACKs of a long
reply) received since the server last took a request from it counts 8 KiB more (a buffer it
may pin). A connection costing more than ``max_connection_bytes``, or
the costliest ones while all together cost more than ``max_buffered_bytes``, is reset: ``connect(AF_UNSPEC)``
disconnects the TCP socket under libzmq's fd, discarding what waits in the kernel's queue
(``shutdown`` would not: Linux still delivers queued and later data, and 4 MiB of empty frames
decode to 128 MiB), and sends an RST; libzmq's next read fails, it drops the pipe and frees the
unfinished message. The check runs every 10 ms on its own thread, so a server
thread stuck in a slow send does not suspend it; between two checks a peer adds what it sends
in 10 ms. Linux TCP only (``TCP_INFO`` of Linux 4.6 or later); an ipc socket file is private to the
store's user.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import logging
import os
import socket
import struct
import termios
import threading
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

TICK_S = 0.01
_TCP_INFO_BYTES = 232
_BYTES_RECEIVED_AT = 128  # offset of tcpi_bytes_received in struct tcp_info (Linux >= 4.1)
_DATA_SEGS_IN_AT = 152  # offset of tcpi_data_segs_in (Linux >= 4.6)
SEGMENT_COST = 8 << 10  # what one received segment may pin: a libzmq receive buffer
_IDLE_BYTES = 4 << 10  # held by every connection for good: its handshake (567 bytes with CURVE)
_CURVE_OVERHEAD = 33  # "\x07MESSAGE", an 8-byte nonce, the 16-byte box MAC, 1 flags byte
_UNSPEC = struct.pack("=H14x", socket.AF_UNSPEC)  # a struct sockaddr of family AF_UNSPEC
_libc = ctypes.CDLL(None, use_errno=True)
_ids = itertools.count()


def frame_wire_bytes(size: int, curve: bool) -> int:
    """Bytes a frame of ``size`` takes on the wire (ZMTP 3 framing, CURVE box included)."""
    body = size + (_CURVE_OVERHEAD if curve else 0)
    return body + (2 if body <= 255 else 9)


@dataclass
class _Conn:
    sock: socket.socket  # a dup of libzmq's fd: the same connection even if the fd is reused
    inode: int
    peer: str
    credited: int = 0  # wire bytes taken out as requests, at the last check
    segments: int = 0  # segments received at the last check where it made progress


class ConnectionGuard:
    """Enforces the limits on what the connections of ``zsock`` (bound at ``port``) hold.

    Create it before ``zsock`` binds (so no accept goes unseen) and :meth:`close` it after the
    socket closed. The server thread calls :meth:`credit` for every request it reads.
    """

    def __init__(
        self, zsock: zmq.Socket[bytes], *, curve: bool, per_connection: int, total: int, name: str
    ) -> None:
        self.curve = curve
        self.port = 0  # set once the socket is bound
        self._per_connection, self._total, self._name = per_connection, total, name
        self._credits: dict[int, int] = {}  # socket inode -> wire bytes read as requests
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}  # libzmq's fd -> connection (guard thread only)
        self._stop = threading.Event()
        address = f"inproc://flowgrpo-bus-guard-{os.getpid()}-{next(_ids)}"
        zsock.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._events: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
        self._events.connect(address)
        self._thread = threading.Thread(target=self._run, name=f"bus-guard-{name}", daemon=True)

    def start(self, port: int) -> None:
        self.port = port
        self._thread.start()

    def credit(self, fd: int, nbytes: int) -> None:
        """Count ``nbytes`` (wire bytes) the server thread read as a request from ``fd``."""
        try:
            inode = os.fstat(fd).st_ino
        except OSError:
            return
        with self._lock:
            self._credits[inode] = self._credits.get(inode, 0) + nbytes

    # --- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._events.poll(int(TICK_S * 1000)):
                    self._take_events()
                self._check()
        except zmq.ContextTerminated:
            pass
        finally:
            self._events.close(linger=0)
            for conn in self._conns.values():
                conn.sock.close()
            self._conns.clear()

    def _take_events(self) -> None:
        while self._events.poll(0):
            event = parse_monitor_message(self._events.recv_multipart())
            fd = int(event["value"])
            old = self._conns.pop(fd, None)
            if old is not None:
                self._forget(old)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._watch(fd)

    def _watch(self, fd: int) -> None:
        try:
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:
            return  # already closed
        try:
            ours = dup.type == socket.SOCK_STREAM and dup.getsockname()[1] == self.port
            host, port = dup.getpeername()[:2]
            peer = f"{host}:{port}"
            inode = os.fstat(dup.fileno()).st_ino
        except (OSError, IndexError, TypeError):
            ours = False
        if not ours:  # closed and reused by something else before we looked
            dup.close()
            return
        self._conns[fd] = _Conn(dup, inode, peer)

    def _forget(self, conn: _Conn) -> None:
        conn.sock.close()
        with self._lock:
            self._credits.pop(conn.inode, None)

    def _check(self) -> None:
        held: dict[int, int] = {}
        for fd, conn in list(self._conns.items()):
            got = self._held(fd, conn)
            if got is None:
                self._forget(self._conns.pop(fd))
            else:
                held[fd] = got
        for fd in [fd for fd, n in held.items() if n > self._per_connection]:
            self._cut(fd, held.pop(fd), "max_connection_bytes", self._per_connection)
        total = sum(held.values())
        while total > self._total:
            fd = max(held, key=lambda f: held[f])
            total -= held[fd]
            self._cut(fd, held.pop(fd), "max_buffered_bytes", self._total)

    def _held(self, fd: int, conn: _Conn) -> int | None:
        """What ``conn`` costs inside libzmq (bytes held, plus SEGMENT_COST per segment since it
        last made progress); None once libzmq closed it."""
        try:
            if os.fstat(fd).st_ino != conn.inode:
                return None
            info = conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
            waiting: int = struct.unpack("i", fcntl.ioctl(conn.sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
        except OSError:
            return None
        if len(info) < _DATA_SEGS_IN_AT + 4:
            return 0  # a kernel older than 4.6: nothing to enforce with
        received: int = struct.unpack_from("=Q", info, _BYTES_RECEIVED_AT)[0]
        segments: int = struct.unpack_from("=I", info, _DATA_SEGS_IN_AT)[0]
        with self._lock:
            credited = self._credits.get(conn.inode, 0)
        held = max(0, received - waiting - credited)
        if credited != conn.credited or held <= _IDLE_BYTES:  # progress, or nothing but a handshake
            conn.credited, conn.segments = credited, segments
        return held + ((segments - conn.segments) % (1 << 32)) * SEGMENT_COST

    def _cut(self, fd: int, held: int, limit: str, value: int) -> None:
        conn = self._conns.pop(fd)
        log.warning(
            "bus %s: cut the connection from %s: what it sent and the store holds as no whole "
            "request costs %d bytes (bus.%s=%d)",
            self._name,
            conn.peer,
            held,
            limit,
            value,
        )
        _reset(conn.sock)
        self._forget(conn)

    def close(self) -> None:
        """Stop watching (after the watched socket closed)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        else:
            self._events.close(linger=0)


def _reset(sock: socket.socket) -> None:
    """Disconnect ``sock``'s TCP connection now: drop its queues, send an RST (Linux)."""
    if _libc.connect(sock.fileno(), _UNSPEC, len(_UNSPEC)) != 0:
        with contextlib.suppress(OSError):  # not Linux: at least stop both directions
            sock.shutdown(socket.SHUT_RDWR)
