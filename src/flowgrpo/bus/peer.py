"""Peer: a client's DEALER socket to one producer, and the framing of its replies.

With the run's keys the socket is a CURVE client pinned to the stores' public key. A socket
monitor reports the handshake's outcome, so a store that refuses this process (another secret,
or one of the two without a secret) is named as such at once instead of timing out.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Sequence
from typing import cast

import numpy as np
import numpy.typing as npt
import zmq
from zmq.utils.monitor import parse_monitor_message

from flowgrpo.bus import auth, wire
from flowgrpo.bus.config import SECRET_ENV, BusConfig

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
}
_MONITORED = int(zmq.EVENT_HANDSHAKE_SUCCEEDED) | sum(int(e) for e in _FAILED)
_MECHANISM_MISMATCH = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
_ids = itertools.count()
# A handshake that broke without a reason is a refusal only the third time in a row: a store with
# another secret fails every one (within ~0.3 s, libzmq reconnecting every 0.1 s), while a store
# that a thousand rollouts reach at once (the coordinator's prompts at a step's start) dropped
# some handshakes it could not finish within its handshake interval (docs/scaling.md).
_BELIEVE = 3


class Peer:
    """The connection to the store at ``endpoint`` and what its shared-memory probe found.

    ``shm`` is None until a STAT answered; then True when this process can read the store's
    probe file (same host and /dev/shm), so fetches ask for segment handles instead of bytes.
    """

    def __init__(self, endpoint: str, config: BusConfig, keys: auth.Keys | None) -> None:
        self.endpoint = endpoint
        self.config = config
        self.keys = keys
        self.shm: bool | None = None if config.shm else False
        self.shm_min_bytes = 0
        self.refusal: str | None = None  # why the store refused the last handshake, if it did
        self._failed = 0  # handshakes failed in a row
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if config.socket_buffer_bytes > 0:
            self.sock.setsockopt(zmq.SNDBUF, config.socket_buffer_bytes)
            self.sock.setsockopt(zmq.RCVBUF, config.socket_buffer_bytes)
        if keys is not None:
            auth.connect_curve(self.sock, keys)
        address = f"inproc://flowgrpo-bus-peer-{os.getpid()}-{next(_ids)}"
        self.sock.monitor(address, _MONITORED)
        self.events: zmq.Socket[bytes] = context.socket(zmq.PAIR)
        self.events.connect(address)
        self.sock.connect(endpoint)

    def send(self, msg: wire.Request) -> bool:
        """Queue ``msg`` without blocking; False when the socket's queue is full."""
        try:
            wire.send(self.sock, msg, flags=wire.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def refused(self) -> bool:
        """Read the handshake events that arrived; True when the latest was a refusal."""
        while cast(int, self.events.getsockopt(_EVENTS)) & _POLLIN:
            event = parse_monitor_message(self.events.recv_multipart())
            kind = event["event"]
            self._failed = 0 if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED else self._failed + 1
            if (
                kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                and self.keys is not None
                and self._failed < _BELIEVE
            ):
                continue  # maybe a store too busy to finish the handshake in time: libzmq tries again
            self.refusal = None if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED else self._why(kind, event["value"])
        return self.refusal is not None

    def _why(self, kind: int, value: int) -> str:
        where = f"the store at {self.endpoint}"
        fix = f"set the same {SECRET_ENV} (or FLOWGRPO_BUS_SECRET_FILE) in every process of the run"
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return f"{where} refused this process's key at the handshake (ZAP {value}): another secret; {fix}"
        failed = f"the handshake with {where} failed"
        if self.keys is None:  # the store dropped a peer without CURVE (or it is no bus store)
            return f"{failed}: it requires the run's bus secret and this process has none; {fix}"
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MECHANISM_MISMATCH:
            return f"{failed}: it has no bus secret and this process has one; {fix}"
        return f"{failed} (event {kind:#x}, {value}): it holds another bus secret, or none; {fix}"

    def has_reply(self) -> bool:
        return bool(cast(int, self.sock.getsockopt(_EVENTS)) & _POLLIN)

    def read_reply(self) -> wire.Reply | None:
        """The next waiting reply (header checked), None when none is waiting.

        The reply's data frames (if any) are left to :meth:`recv_into`; a reply that fails a
        check is drained and raises WireError.
        """
        if not self.has_reply():
            return None
        token = self.sock.recv()
        try:
            if not self.sock.getsockopt(wire.RCVMORE):
                raise wire.WireError("reply ended early: a reply has a type and a header frame")
            header: bytes = self.sock.recv()
            reply = wire.decode_reply(token, wire.unpack(header, self.config.max_header_bytes))
        except wire.WireError:
            self.drain()
            raise
        return reply

    def recv_into(self, target: npt.NDArray[np.uint8]) -> None:
        """Receive the next data frame straight into ``target``, which it must fill exactly."""
        if not self.sock.getsockopt(wire.RCVMORE):
            raise wire.WireError("reply has fewer data frames than its header lists")
        got: int = self.sock.recv_into(target.data)
        if got != target.nbytes:
            raise wire.WireError(f"data frame of {got} bytes where the header lists {target.nbytes}")

    def skip(self, frames: int) -> None:
        """Discard the next ``frames`` data frames (of a key that failed)."""
        for _ in range(frames):
            if not self.sock.getsockopt(wire.RCVMORE):
                return
            self.sock.recv(copy=False)

    def drain(self) -> int:
        """Discard what is left of the current message; returns how many frames that was."""
        left = 0
        while self.sock.getsockopt(wire.RCVMORE):
            self.sock.recv(copy=False)
            left += 1
        return left

    def close(self) -> None:
        self.sock.disable_monitor()
        self.events.close(linger=0)
        self.sock.close(linger=0)


def wait_readable(peers: Sequence[Peer], deadline: float, spin_s: float) -> list[Peer]:
    """The peers with a reply waiting or refused at the handshake (:attr:`Peer.refusal`), or
    [] at the deadline (``time.monotonic()``).

    It busy-checks for ``spin_s`` before sleeping in poll: waking a sleeping thread costs
    50-300 us on virtual machines, more than a small request's whole round trip.
    """
    refused = [p for p in peers if p.refused()]
    if refused:
        return refused
    spin_end = min(deadline, time.monotonic() + spin_s)
    while True:
        ready = [p for p in peers if p.has_reply()]
        if ready or time.monotonic() >= spin_end:
            break
    while not ready:
        left_ms = math.ceil((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            return []
        items = [(p.sock, _POLLIN) for p in peers] + [(p.events, _POLLIN) for p in peers]
        readable = {sock for sock, _ in zmq.zmq_poll(items, left_ms)}
        ready = [p for p in peers if p.sock in readable or (p.events in readable and p.refused())]
    return ready
