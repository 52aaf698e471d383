"""Peer: a client's DEALER socket to one producer, and the framing of its replies."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import cast

import numpy as np
import numpy.typing as npt
import zmq

from flowgrpo.bus import wire
from flowgrpo.bus.config import BusConfig

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class Peer:
    """The connection to the store at ``endpoint`` and what its shared-memory probe found.

    ``shm`` is None until a STAT answered; then True when this process can read the store's
    probe file (same host and /dev/shm), so fetches ask for segment handles instead of bytes.
    """

    def __init__(self, endpoint: str, config: BusConfig) -> None:
        self.endpoint = endpoint
        self.config = config
        self.key = config.mac_key()
        self.shm: bool | None = None if config.shm else False
        self.shm_min_bytes = 0
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if config.socket_buffer_bytes > 0:
            self.sock.setsockopt(zmq.SNDBUF, config.socket_buffer_bytes)
            self.sock.setsockopt(zmq.RCVBUF, config.socket_buffer_bytes)
        self.sock.connect(endpoint)

    def send(self, msg: wire.Request) -> bool:
        """Queue ``msg`` without blocking; False when the socket's queue is full."""
        try:
            wire.send(self.sock, msg, self.key, flags=wire.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def has_reply(self) -> bool:
        return bool(cast(int, self.sock.getsockopt(_EVENTS)) & _POLLIN)

    def read_reply(self) -> wire.Reply | None:
        """The next waiting reply (header checked, MAC verified), None when none is waiting.

        The reply's data frames (if any) are left to :meth:`recv_into`; a reply that fails a
        check is drained and raises WireError / AuthError.
        """
        if not self.has_reply():
            return None
        token = self.sock.recv()
        try:
            header, mac = self._next(), self._next()
            reply = wire.decode_reply(token, wire.unpack(header, self.config.max_header_bytes))
            sizes = reply.frame_sizes() if isinstance(reply, wire.FetchReply) else []
            wire.check_mac(self.key, token, header, sizes, mac)
        except wire.WireError:
            self.drain()
            raise
        return reply

    def _next(self) -> bytes:
        if not self.sock.getsockopt(wire.RCVMORE):
            raise wire.WireError("reply ended early: a reply has a type, a header and a MAC frame")
        frame: bytes = self.sock.recv()
        return frame

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
        self.sock.close(linger=0)


def wait_readable(peers: Sequence[Peer], deadline: float, spin_s: float) -> list[Peer]:
    """The peers with a reply waiting, or [] at the deadline (``time.monotonic()``).

    It busy-checks for ``spin_s`` before sleeping in poll: waking a sleeping thread costs
    50-300 us on virtual machines, more than a small request's whole round trip.
    """
    spin_end = min(deadline, time.monotonic() + spin_s)
    while True:
        ready = [p for p in peers if p.has_reply()]
        if ready or time.monotonic() >= spin_end:
            break
    left_ms = math.ceil((deadline - time.monotonic()) * 1000)
    if ready or left_ms <= 0:
        return ready
    readable = {sock for sock, _ in zmq.zmq_poll([(p.sock, _POLLIN) for p in peers], left_ms)}
    return [p for p in peers if p.sock in readable]
