"""BusClient: fetch tensors by reference, straight from the stores that produced them.

One DEALER socket per producer endpoint, cached. ``fetch`` groups refs by endpoint, keeps
several requests in flight to each and polls all of them at once, under one deadline. Refs to
a store of this very process are read from it directly, without sockets (the in-process twin
the "inprocess" launcher relies on).

Calls are serialised by a lock: ZMQ sockets belong to one thread at a time. Threads that
fetch in parallel should each use their own client.

With the run's secret every socket is a CURVE client (``flowgrpo.bus.auth``); a store that
refuses the handshake fails the call at once with :class:`Unauthenticated`, naming the fix.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Literal, TypeVar, overload

from flowgrpo.bus import auth, wire
from flowgrpo.bus.config import BusConfig
from flowgrpo.bus.errors import BusError, DataLost, Internal, Unauthenticated, error_for
from flowgrpo.bus.peer import Peer, wait_readable
from flowgrpo.bus.refs import Fetched, TensorRef
from flowgrpo.bus.store import TensorStore, local_store
from flowgrpo.bus.transfer import Slot, Transfer

Errors = Literal["raise", "return"]
R = TypeVar("R", bound=wire.Reply)
_ENVELOPE_BYTES = 1024  # a request header's fields besides its keys, with room to spare


class BusClient:
    """Fetches, releases and inspects data held by producers' stores.

    ``local_stores=False`` sends even refs of this process's stores through sockets (tests).
    The secret is read once, here (a bad secret file raises ValueError now, not mid-fetch).
    """

    def __init__(self, config: BusConfig | None = None, *, local_stores: bool = True) -> None:
        self.config = config or BusConfig()
        self._keys = auth.run_keys(self.config)
        self._local_stores = local_stores
        self._peers: dict[str, Peer] = {}
        self._rids = itertools.count(1)
        self._lock = threading.Lock()

    # --- fetch --------------------------------------------------------------------------------

    @overload
    def fetch(
        self,
        refs: Sequence[TensorRef],
        *,
        timeout_s: float | None = None,
        errors: Literal["raise"] = "raise",
        stall_s: float | None = None,
    ) -> list[Fetched]: ...

    @overload
    def fetch(
        self,
        refs: Sequence[TensorRef],
        *,
        timeout_s: float | None = None,
        errors: Literal["return"],
        stall_s: float | None = None,
    ) -> list[Fetched | BusError]: ...

    def fetch(
        self,
        refs: Sequence[TensorRef],
        *,
        timeout_s: float | None = None,
        errors: Errors = "raise",
        stall_s: float | None = None,
    ) -> list[Fetched] | list[Fetched | BusError]:
        """The tensors of ``refs``, in order, within ``timeout_s`` (default fetch_timeout_s).

        A key that failed raises its :class:`BusError` (NotFound, Released, Evicted, DataLost
        when its producer did not answer ...); with ``errors="return"`` the error takes the
        key's place in the list instead, and the other keys are still delivered. ``stall_s``:
        producers that sent nothing for that long are given up as dead (DataLost) before the
        deadline, so a caller with another copy of the data moves on to it quickly while a long
        transfer that keeps moving is left alone.
        """
        timeout = self.config.fetch_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            results = self._fetch(list(refs), timeout, stall_s)
        if errors == "return":
            return results
        for item in results:
            if isinstance(item, BusError):
                raise item
        return [item for item in results if isinstance(item, Fetched)]

    def _fetch(
        self, refs: list[TensorRef], timeout_s: float, stall_s: float | None = None
    ) -> list[Fetched | BusError]:
        results: list[Fetched | BusError | None] = [None] * len(refs)
        by_endpoint: dict[str, list[Slot]] = {}
        for index, ref in enumerate(refs):
            store = local_store(ref.store_id) if self._local_stores else None
            if store is not None:
                results[index] = _read_local(store, ref)
            else:
                by_endpoint.setdefault(ref.endpoint, []).append(Slot(index, ref, ref.nbytes))
        deadline, endpoints, wave = time.monotonic() + timeout_s, list(by_endpoint), self.config.max_peers
        for start in range(0, len(endpoints), wave):  # at most max_peers sockets open at once
            transfers = [
                Transfer(self._peer(ep), by_endpoint[ep], self._rids)
                for ep in endpoints[start : start + wave]
            ]
            self._drive(transfers, deadline, timeout_s, stall_s)
            for transfer in transfers:
                for slot in transfer.slots:
                    results[slot.index] = slot.result()
        return [item for item in results if item is not None]

    def _drive(
        self, transfers: list[Transfer], deadline: float, timeout_s: float, stall_s: float | None
    ) -> None:
        """Send and receive for every transfer until all are done, the deadline passed, or (with
        ``stall_s``) the producers left sent nothing for ``stall_s``."""
        spin_s = self.config.spin_us / 1e6
        pending = [t for t in transfers if not t.done]
        moved = time.monotonic()
        while pending and time.monotonic() < self._give_up_at(deadline, moved, stall_s):
            for transfer in pending:
                transfer.send()
            ready = wait_readable(
                [t.peer for t in pending], self._give_up_at(deadline, moved, stall_s), spin_s
            )
            if ready:
                moved = time.monotonic()
            for transfer in pending:
                if transfer.peer in ready:
                    transfer.receive()
            pending = [t for t in pending if not t.done]
        waited = min(timeout_s, time.monotonic() - deadline + timeout_s)
        for transfer in pending:
            transfer.time_out(waited)
            self._forget(transfer.peer)  # its late replies must not reach a later call
        for transfer in transfers:
            if transfer.peer.refusal is not None and self._peers.get(transfer.peer.endpoint) is transfer.peer:
                self._forget(transfer.peer)  # the next call starts a fresh handshake

    @staticmethod
    def _give_up_at(deadline: float, moved: float, stall_s: float | None) -> float:
        return deadline if stall_s is None else min(deadline, moved + stall_s)

    # --- release, stat, ping ------------------------------------------------------------------

    def release(
        self,
        endpoint: str,
        keys: Iterable[str] = (),
        *,
        tag: str | None = None,
        prefix: str | None = None,
        timeout_s: float | None = None,
    ) -> int:
        """Release keys (and/or every key with ``tag`` or ``prefix``) at ``endpoint``; returns
        how many the store dropped. Many keys go in several requests (each within
        max_request_header_bytes). An empty tag or prefix is refused (InvalidRequest): releasing
        everything is for the store's owner (``TensorStore.release_all``)."""
        budget = self.config.max_request_header_bytes - _ENVELOPE_BYTES
        released = 0
        for i, batch in enumerate(_batches(list(keys), budget)):
            first = i == 0
            request = wire.ReleaseRequest(
                next(self._rids), batch, tag if first else None, prefix if first else None
            )
            released += self._call(endpoint, request, wire.ReleaseReply, timeout_s).released
        return released

    def stat(self, endpoint: str, *, timeout_s: float | None = None) -> wire.StoreInfo:
        """The store's id, bytes used and capacity, tensor count and shared-memory probe."""
        return self._call(endpoint, wire.StatRequest(next(self._rids)), wire.StatReply, timeout_s).info

    def ping(self, endpoint: str, *, timeout_s: float | None = None) -> float:
        """One PING round trip to ``endpoint``, in seconds."""
        start = time.perf_counter()
        self._call(endpoint, wire.PingRequest(next(self._rids)), wire.PingReply, timeout_s)
        return time.perf_counter() - start

    def _call(self, endpoint: str, request: wire.Request, expect: type[R], timeout_s: float | None) -> R:
        """Send one request and wait for its reply (replies to other ids are discarded)."""
        timeout = self.config.fetch_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        with self._lock:
            peer = self._peer(endpoint)
            if not peer.send(request):
                raise DataLost(
                    f"cannot queue a request to {endpoint}: its send queue is full", endpoint=endpoint
                )
            while wait_readable([peer], deadline, self.config.spin_us / 1e6):
                if peer.refusal is not None:
                    self._forget(peer)
                    raise Unauthenticated(peer.refusal, endpoint=endpoint)
                reply = self._read(peer)
                if reply is not None and reply.rid in (request.rid, -1):  # -1: refused unread
                    return _checked(reply, expect, endpoint)
            self._forget(peer)
        name = wire.TOKEN_NAMES[wire.token_of(request)]
        raise DataLost(
            f"producer {endpoint} did not answer {name} within {timeout:.1f} s: it may be dead",
            endpoint=endpoint,
        )

    @staticmethod
    def _read(peer: Peer) -> wire.Reply | None:
        try:
            reply = peer.read_reply()
        except wire.WireError as exc:
            raise Internal(
                f"producer {peer.endpoint} sent a malformed reply: {exc}", endpoint=peer.endpoint
            ) from None
        peer.drain()
        return reply

    # --- sockets ------------------------------------------------------------------------------

    def _peer(self, endpoint: str) -> Peer:
        peer = self._peers.pop(endpoint, None)  # put back last: the dict is in order of last use
        if peer is not None:
            self._peers[endpoint] = peer
        else:
            if not endpoint:
                raise ValueError(
                    "a ref with no endpoint names a store that is not served; it is readable only "
                    "in the process that holds the store"
                )
            self._trim(self.config.max_peers - 1)
            peer = self._peers[endpoint] = Peer(endpoint, self.config, self._keys)
        return peer

    def _trim(self, most: int) -> None:
        """Close the least recently used sockets until ``most`` are open. A fetch opens at most
        max_peers (a wave), so the sockets closed here are never the current wave's."""
        while len(self._peers) > most:
            self._forget(next(iter(self._peers.values())))

    def _forget(self, peer: Peer) -> None:
        peer.close()
        self._peers.pop(peer.endpoint, None)

    def close(self) -> None:
        with self._lock:
            for peer in list(self._peers.values()):
                self._forget(peer)

    def __enter__(self) -> BusClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _batches(keys: list[str], budget: int) -> list[list[str]]:
    """``keys`` cut into lists whose msgpack encoding stays within ``budget`` bytes; [[]] for
    no keys (one request: the tag or prefix alone)."""
    batches: list[list[str]] = [[]]
    size = 0
    for key in keys:
        cost = len(key.encode()) + 5  # a str header of at most 5 bytes
        if batches[-1] and size + cost > budget:
            batches.append([])
            size = 0
        batches[-1].append(key)
        size += cost
    return batches


def _checked(reply: wire.Reply, expect: type[R], endpoint: str) -> R:
    if isinstance(reply, wire.ErrorReply):
        raise error_for(reply.code, reply.message, endpoint=endpoint)
    if not isinstance(reply, expect):
        raise Internal(f"{endpoint} answered with a {type(reply).__name__}, not a {expect.__name__}")
    return reply


def _read_local(store: TensorStore, ref: TensorRef) -> Fetched | BusError:
    """The in-process twin of a fetch: same checks and errors, a private copy of the bytes."""
    found = store.lookup(ref.key)
    if isinstance(found, wire.ItemError):
        return error_for(found.code, found.message, key=ref.key, endpoint=ref.endpoint)
    if (found.dtype, found.shape) != (ref.dtype, ref.shape):
        return DataLost(
            f"store {store.store_id} holds {found.dtype}{list(found.shape)} under {ref.key!r} but "
            f"the ref says {ref.dtype}{list(ref.shape)}: the key was reused",
            key=ref.key,
        )
    return Fetched(
        ref.key,
        found.column,
        found.dtype,
        found.shape,
        found.view().copy(),
        found.policy_version,
        dict(found.trace),
        "inprocess",
    )
