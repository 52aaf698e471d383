"""One fetch call's work for one producer: plan requests, keep them in flight, land replies.

A :class:`Transfer` first learns (once per peer, by STAT) whether this process shares the
producer's /dev/shm. It then plans requests of at most ``max_request_bytes``: small keys are
batched (while the request header stays within ``max_request_header_bytes``), a large tensor
is split into byte ranges, a tensor in shared memory is one handle.
Up to ``pipeline_depth`` requests are in flight, so the producer sends the next range while
this process copies the last one out of ZMQ. Each data frame is received straight into its
slice of the preallocated tensor (no reassembly copy). Replies match requests by id; a reply to
a request of an earlier, timed-out call is discarded.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from flowgrpo.bus import dtypes, shm, wire
from flowgrpo.bus.errors import (
    BusError,
    DataLost,
    Internal,
    InvalidRequest,
    Released,
    Unauthenticated,
    error_for,
)
from flowgrpo.bus.peer import Peer
from flowgrpo.bus.refs import Fetched, TensorRef, Via
from flowgrpo.bus.wire import ItemMeta, KeyRange

log = logging.getLogger(__name__)

MAX_KEYS_PER_REQUEST = 1024  # keeps reply headers far below max_header_bytes
_ENVELOPE_BYTES = 1024  # a FETCH header's fields besides its items, with room to spare
_ITEM_BYTES = 24  # an item's msgpack overhead besides its key: [str header, offset, length]


@dataclass
class Slot:
    """One wanted tensor: where its bytes land and how many are still missing."""

    index: int  # position in the caller's list of refs
    ref: TensorRef
    missing: int
    data: npt.NDArray[np.uint8] | None = None
    meta: ItemMeta | None = None
    via: Via = "socket"
    error: BusError | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or (self.meta is not None and self.missing == 0)

    def fail(self, error: BusError) -> None:
        if self.error is None:
            self.error = error

    def result(self) -> Fetched | BusError:
        if self.error is not None:
            return self.error
        assert self.meta is not None, "result() of an unfinished slot"
        data = self.data if self.data is not None else np.empty(0, np.uint8)
        array = data.view(dtypes.storage_dtype(self.ref.dtype)).reshape(self.ref.shape)
        meta = self.meta
        return Fetched(
            self.ref.key,
            meta.column,
            meta.dtype,
            self.ref.shape,
            array,
            meta.policy_version,
            meta.trace,
            self.via,
        )


@dataclass
class _Request:
    msg: wire.FetchRequest | wire.StatRequest
    parts: list[tuple[Slot, KeyRange]] = field(default_factory=list)


class Transfer:
    """Fetches ``slots`` from ``peer``; drive it with :meth:`send` and :meth:`receive`."""

    def __init__(self, peer: Peer, slots: list[Slot], rids: Iterator[int]) -> None:
        self.peer = peer
        self.slots = slots
        self._rids = rids
        self._cfg = peer.config
        self._queue: deque[_Request] | None = None  # planned once the probe answered
        self._inflight: dict[int, _Request] = {}
        self._probing = False

    @property
    def done(self) -> bool:
        return all(slot.done for slot in self.slots)

    # --- sending ------------------------------------------------------------------------------

    def send(self) -> None:
        """Send requests until ``pipeline_depth`` are in flight (or the socket queue is full)."""
        if self.peer.shm is None:
            self._send_probe()
            return
        if self._queue is None:
            self._queue = deque(self._plan())
        while self._queue and len(self._inflight) < self._cfg.pipeline_depth:
            request = self._queue[0]
            if not self.peer.send(request.msg):
                return
            self._inflight[request.msg.rid] = self._queue.popleft()

    def _send_probe(self) -> None:
        if not self._probing:
            request = _Request(wire.StatRequest(next(self._rids)))
            if self.peer.send(request.msg):
                self._inflight[request.msg.rid] = request
                self._probing = True

    def _plan(self) -> Iterator[_Request]:
        """Requests of at most max_request_bytes, MAX_KEYS_PER_REQUEST keys of one store and
        max_request_header_bytes of header."""
        parts: list[tuple[Slot, KeyRange]] = []
        size = header = 0
        budget = self._cfg.max_request_header_bytes - _ENVELOPE_BYTES
        for slot, wanted in self._pieces():
            length = 0 if wanted.length < 0 else wanted.length
            cost = len(wanted.key.encode()) + _ITEM_BYTES
            full = (
                size + length > self._cfg.max_request_bytes
                or len(parts) >= MAX_KEYS_PER_REQUEST
                or header + cost > budget
            )
            if parts and (full or slot.ref.store_id != parts[0][0].ref.store_id):
                yield self._request(parts)
                parts, size, header = [], 0, 0
            parts.append((slot, wanted))
            size += length
            header += cost
        if parts:
            yield self._request(parts)

    def _pieces(self) -> Iterator[tuple[Slot, KeyRange]]:
        """Whole keys where shared memory will answer, byte ranges of max_request_bytes else."""
        step = self._cfg.max_request_bytes
        longest = self._cfg.max_request_header_bytes - _ENVELOPE_BYTES - _ITEM_BYTES
        for slot in self.slots:
            key = slot.ref.key
            if len(key.encode()) > longest:
                limit = self._cfg.max_request_header_bytes
                message = f"a key of {len(key)} characters does not fit a request header"
                slot.fail(InvalidRequest(f"{message} (bus.max_request_header_bytes={limit})", key=key))
                continue
            nbytes = slot.ref.nbytes
            if self.peer.shm and nbytes >= max(1, self.peer.shm_min_bytes):
                yield slot, KeyRange(slot.ref.key, 0, -1)
                continue
            for offset in range(0, max(nbytes, 1), step):
                yield slot, KeyRange(slot.ref.key, offset, min(step, nbytes - offset))

    def _request(self, parts: list[tuple[Slot, KeyRange]]) -> _Request:
        store_id = parts[0][0].ref.store_id
        items = [wanted for _, wanted in parts]
        msg = wire.FetchRequest(next(self._rids), store_id, items, shm=bool(self.peer.shm))
        return _Request(msg, parts)

    # --- receiving ----------------------------------------------------------------------------

    def receive(self) -> None:
        """Handle every reply that is waiting on the socket (or the store's refusal)."""
        if self.peer.refusal is not None:
            self._fail_all(Unauthenticated(self.peer.refusal, endpoint=self.peer.endpoint))
            return
        while True:
            try:
                reply = self.peer.read_reply()
            except wire.WireError as exc:
                self._fail_all(Internal(f"producer {self.peer.endpoint} sent a malformed reply: {exc}"))
                continue
            if reply is None:
                return
            self._on_reply(reply)
            leftover = self.peer.drain()
            if leftover:
                log.warning(
                    "reply from %s had %d frames more than its header lists", self.peer.endpoint, leftover
                )

    def _on_reply(self, reply: wire.Reply) -> None:
        if isinstance(reply, wire.ErrorReply) and reply.rid == -1:
            self._fail_all(error_for(reply.code, reply.message, endpoint=self.peer.endpoint))
            return
        request = self._inflight.pop(reply.rid, None)
        if request is None:
            log.debug("discarded a stale reply %d from %s", reply.rid, self.peer.endpoint)
        elif isinstance(reply, wire.ErrorReply):
            self._fail(request, error_for(reply.code, reply.message, endpoint=self.peer.endpoint))
        elif isinstance(reply, wire.StatReply) and isinstance(request.msg, wire.StatRequest):
            self._on_probe(reply.info)
        elif isinstance(reply, wire.FetchReply) and len(reply.items) == len(request.parts):
            for (slot, wanted), item in zip(request.parts, reply.items, strict=True):
                self._land(slot, wanted, item)
        else:
            self._fail(
                request,
                Internal(
                    f"producer {self.peer.endpoint} answered request {reply.rid} with "
                    f"a {type(reply).__name__} that does not fit it"
                ),
            )

    def _on_probe(self, info: wire.StoreInfo) -> None:
        probe = info.shm_probe
        self.peer.shm = probe is not None and shm.probe_matches(self._cfg.shm_dir, *probe)
        self.peer.shm_min_bytes = info.shm_min_bytes
        log.debug("bus peer %s: shared memory %s", self.peer.endpoint, "yes" if self.peer.shm else "no")

    def _land(self, slot: Slot, wanted: KeyRange, item: ItemMeta | wire.ItemError) -> None:
        """Put one reply item's bytes where they belong (or record its error)."""
        endpoint = self.peer.endpoint
        if isinstance(item, wire.ItemError):
            slot.fail(error_for(item.code, item.message, key=slot.ref.key, endpoint=endpoint))
            return
        problem = slot.error or _mismatch(slot.ref, wanted, item, endpoint)
        if problem is not None:
            slot.fail(problem)
            self.peer.skip(len(item.chunks))
        elif item.shm is not None:
            self._map(slot, item)
        else:
            self._copy_in(slot, item)

    def _map(self, slot: Slot, item: ItemMeta) -> None:
        assert item.shm is not None
        try:
            slot.data = shm.open_private(self._cfg.shm_dir, item.shm, slot.ref.nbytes)
        except FileNotFoundError:
            slot.fail(
                Released(
                    f"key {slot.ref.key!r} was released by {self.peer.endpoint} before this "
                    "process mapped its shared memory",
                    key=slot.ref.key,
                    endpoint=self.peer.endpoint,
                )
            )
            return
        except (OSError, ValueError) as exc:
            slot.fail(Internal(f"cannot map {item.shm} for {slot.ref.key!r}: {exc}", key=slot.ref.key))
            return
        slot.meta, slot.missing, slot.via = item, 0, "shm"

    def _copy_in(self, slot: Slot, item: ItemMeta) -> None:
        if slot.data is None:
            slot.data = np.empty(slot.ref.nbytes, np.uint8)
        offset = item.offset
        for i, size in enumerate(item.chunks):
            try:
                self.peer.recv_into(slot.data[offset : offset + size])
            except wire.WireError as exc:
                slot.fail(Internal(f"{self.peer.endpoint} broke the protocol for {slot.ref.key!r}: {exc}"))
                self.peer.skip(len(item.chunks) - i - 1)
                return
            offset += size
        slot.meta = item
        slot.missing -= offset - item.offset

    # --- failing ------------------------------------------------------------------------------

    def _fail(self, request: _Request, error: BusError) -> None:
        if isinstance(request.msg, wire.StatRequest):  # the probe: nothing can be fetched
            self._fail_all(error)
        for slot, _ in request.parts:
            slot.fail(_for_key(error, slot.ref.key))

    def _fail_all(self, error: BusError) -> None:
        for slot in self.slots:
            slot.fail(_for_key(error, slot.ref.key))
        self._inflight.clear()
        self._queue = deque()

    def time_out(self, waited_s: float) -> None:
        """Fail every unfinished key: the producer did not answer within the deadline."""
        late = [slot for slot in self.slots if not slot.done]
        if not late:
            return
        names = ", ".join(repr(s.ref.key) for s in late[:3]) + (
            f" and {len(late) - 3} more" if len(late) > 3 else ""
        )
        message = (
            f"producer {self.peer.endpoint} did not answer {len(late)} keys within {waited_s:.1f} s "
            f"({names}): it may be dead; the data must be re-produced"
        )
        for slot in late:
            slot.fail(DataLost(message, key=slot.ref.key, endpoint=self.peer.endpoint))


def _for_key(error: BusError, key: str) -> BusError:
    return error_for(error.code, error.message, key=key, endpoint=error.endpoint)


def _mismatch(ref: TensorRef, wanted: KeyRange, item: ItemMeta, endpoint: str) -> BusError | None:
    """Why ``item`` cannot be the answer to ``wanted`` of ``ref``; None when it fits."""
    if (item.dtype, tuple(item.shape), item.nbytes) != (ref.dtype, ref.shape, ref.nbytes):
        return DataLost(
            f"{endpoint} holds {item.dtype}{item.shape} under {ref.key!r} but the ref says "
            f"{ref.dtype}{list(ref.shape)}: the key was reused, the ref's data is gone",
            key=ref.key,
            endpoint=endpoint,
        )
    length = ref.nbytes - wanted.offset if wanted.length < 0 else wanted.length
    sent = ref.nbytes if item.shm is not None else sum(item.chunks)
    if item.key != wanted.key or item.offset != wanted.offset or sent != length:
        return Internal(
            f"{endpoint} answered {item.key!r} [{item.offset}, +{sent}) for "
            f"{wanted.key!r} [{wanted.offset}, +{length})",
            key=ref.key,
            endpoint=endpoint,
        )
    return None
