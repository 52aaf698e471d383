"""TensorStore: the bounded, thread-safe store of one producing process.

The producer puts tensors (from its own thread) and hands out :class:`TensorRef`s; a
:class:`~flowgrpo.bus.server.BusServer` thread serves fetches from the same store. Every put
is checked against the column schema first, so a wrong tensor fails at its producer, not
minutes later at a consumer.

The store owns its bytes: ``put`` copies the tensor once, into a shared-memory segment when it
is large enough (consumers on this host then map it without a copy) or into private memory.
``allocate`` + ``commit`` let a producer write straight into that memory instead (no copy at
all). Stored bytes are never written again by the store, so the server sends them zero-copy.

Capacity: ``max_bytes`` bounds what is held (pending allocations included). When a put does
not fit, it waits for releases up to ``put_timeout_s`` (``when_full="wait"``), or evicts the
oldest tensors (``"evict_oldest"``). Released and evicted keys leave tombstones (a bounded
number) so a late fetch learns *why* the data is gone.
"""

from __future__ import annotations

import difflib
import itertools
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from opentelemetry import propagate

from flowgrpo.bus import dtypes, shm
from flowgrpo.bus.config import BusConfig
from flowgrpo.bus.errors import ErrorCode, InvalidRequest, Released, StoreFull
from flowgrpo.bus.refs import TensorBytes, TensorRef
from flowgrpo.bus.wire import ItemError, StoreInfo
from flowgrpo.columns import COLUMNS, ColumnRegistry

log = logging.getLogger(__name__)

_LOCAL: weakref.WeakValueDictionary[str, TensorStore] = weakref.WeakValueDictionary()
_SUGGEST_FROM = 1000  # NOT_FOUND suggestions look at this many recent keys (difflib is O(n))


def local_store(store_id: str) -> TensorStore | None:
    """The open store of this process with ``store_id``, if any (the in-process twin)."""
    return _LOCAL.get(store_id)


@dataclass
class StoredTensor:
    """One held tensor. ``data`` is its bytes (flat uint8), never written after commit."""

    key: str
    column: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    policy_version: int
    tag: str | None
    trace: dict[str, str]
    data: npt.NDArray[np.uint8] = field(default_factory=lambda: np.empty(0, np.uint8))
    segment: str | None = None  # shared-memory file name, None for private memory

    def view(self) -> npt.NDArray[Any]:
        """The bytes as an array of the storage dtype and the tensor's shape (no copy)."""
        return self.data.view(dtypes.storage_dtype(self.dtype)).reshape(self.shape)


class TensorStore:
    """A bounded store of tensors, keyed by unique strings; see the module docstring.

    ``endpoint`` is set by the BusServer that serves the store; refs made before (or by a store
    that is never served) carry "" and can only be read in-process.
    """

    def __init__(self, config: BusConfig | None = None, *, columns: ColumnRegistry = COLUMNS) -> None:
        self.config = config or BusConfig()
        self.columns = columns
        self.store_id = secrets.token_hex(8)
        self.endpoint = ""
        self._cond = threading.Condition()
        self._entries: OrderedDict[str, StoredTensor] = OrderedDict()  # committed, oldest first
        self._pending: dict[str, StoredTensor] = {}
        self._tombstones: OrderedDict[str, ErrorCode] = OrderedDict()
        self._used = 0
        self._served: dict[str, int] = {}  # tag -> bytes sent by the server (tags held only)
        self.served_total = 0  # tensor bytes answered to fetches, all tags (what publication costs)
        self._closed = False
        self._shm_warned = False
        self._segments: set[str] = set()  # live segment files (and the probe), for cleanup
        self._probe = self._start_shm() if self.config.shm else None
        # Runs on close(), garbage collection or interpreter exit, whichever comes first.
        self._cleanup = weakref.finalize(self, _unlink_all, self.config.shm_dir, self._segments, os.getpid())
        _LOCAL[self.store_id] = self

    def _start_shm(self) -> tuple[str, str] | None:
        shm.remove_stale(self.config.shm_dir)
        try:
            probe = shm.write_probe(self.config.shm_dir)
        except OSError as exc:
            log.warning(
                "no shared memory for store %s: %s cannot hold a probe file (%s)",
                self.store_id,
                self.config.shm_dir,
                exc,
            )
            return None
        self._segments.add(probe[0])
        return probe

    # --- producing ----------------------------------------------------------------------------

    def put(
        self,
        key: str,
        column: str,
        data: npt.NDArray[Any] | TensorBytes,
        *,
        policy_version: int = -1,
        tag: str | None = None,
        trace: dict[str, str] | None = None,
    ) -> TensorRef:
        """Copy ``data`` into the store under ``key`` and return its reference.

        Raises SchemaViolation when it does not match ``column``, StoreFull when no room
        frees up in time, ValueError for a key already held. The caller may reuse ``data``.
        """
        dtype = data.dtype if isinstance(data, TensorBytes) else dtypes.name_of(data.dtype)
        target = self.allocate(
            key, column, dtype, data.shape, policy_version=policy_version, tag=tag, trace=trace
        )
        try:
            if isinstance(data, TensorBytes):
                np.copyto(target.reshape(-1).view(np.uint8), data.flat_bytes())
            else:
                np.copyto(target, data)
        except BaseException:
            self.abort(key)
            raise
        return self.commit(key)

    def allocate(
        self,
        key: str,
        column: str,
        dtype: str,
        shape: Iterable[int],
        *,
        policy_version: int = -1,
        tag: str | None = None,
        trace: dict[str, str] | None = None,
    ) -> npt.NDArray[Any]:
        """Reserve room for a tensor and return a writable array to fill, then :meth:`commit`.

        The array has the storage dtype (``dtypes.storage_dtype``: bfloat16 is uint16) and
        lies in shared memory when the tensor is large enough, so the producer's one write is
        the only copy. The key is invisible to fetches until committed; :meth:`abort` gives it up.
        """
        shape = tuple(int(d) for d in shape)
        self.columns.check(column, dtype, shape, where=key)
        if trace is None:
            trace = {}
            propagate.inject(trace)
        entry = StoredTensor(
            key, column, dtype, shape, dtypes.nbytes_of(dtype, shape), policy_version, tag, trace
        )
        with self._cond:
            self._check_new_key(key)
            self._reserve(key, entry.nbytes)
            self._pending[key] = entry
        try:
            entry.data, entry.segment = self._new_buffer(entry.nbytes)
        except BaseException:
            self.abort(key)
            raise
        with self._cond:
            if entry.segment is not None:
                self._segments.add(entry.segment)
            if self._pending.get(key) is not entry:  # released while the buffer was made
                self._forget_segment(entry)
        return entry.view()

    def commit(self, key: str) -> TensorRef:
        """Make an allocated tensor visible to fetches; returns its reference."""
        with self._cond:
            entry = self._pending.pop(key, None)
            if entry is None:
                raise self._commit_error(key)
            self._entries[key] = entry
            self._tombstones.pop(key, None)
        return TensorRef(
            self.endpoint,
            key,
            entry.column,
            entry.dtype,
            entry.shape,
            entry.nbytes,
            self.store_id,
            entry.policy_version,
        )

    def _commit_error(self, key: str) -> Exception:
        if self._tombstones.get(key) is not None:
            return Released(f"key {key!r} was released before it was committed", key=key)
        return KeyError(f"commit({key!r}): no pending allocation of that key (allocate it first)")

    def _check_new_key(self, key: str) -> None:
        if self._closed:
            raise RuntimeError(f"store {self.store_id} is closed")
        if key in self._entries or key in self._pending:
            raise ValueError(f"key {key!r} is already held by store {self.store_id}; keys must be unique")

    def _new_buffer(self, nbytes: int) -> tuple[npt.NDArray[np.uint8], str | None]:
        if self._probe is not None and nbytes >= max(1, self.config.shm_min_bytes):
            try:
                name, data = shm.create(self.config.shm_dir, nbytes)
                return data, name
            except OSError as exc:
                self._warn_no_shm(exc)
        return np.empty(nbytes, np.uint8), None

    def _warn_no_shm(self, exc: OSError) -> None:
        if not self._shm_warned:
            self._shm_warned = True
            log.warning(
                "store %s: shared memory in %s refused a segment (%s); large tensors go to private "
                "memory and travel over the socket (raise shm_size / free /dev/shm)",
                self.store_id,
                self.config.shm_dir,
                exc,
            )

    # --- capacity -----------------------------------------------------------------------------

    def _reserve(self, key: str, nbytes: int) -> None:
        """Account ``nbytes`` for ``key``, waiting or evicting per ``when_full`` (lock held)."""
        capacity = self.config.max_bytes
        if nbytes > capacity:
            raise StoreFull(
                f"{key!r} needs {_size(nbytes)}, more than the store's capacity {_size(capacity)} "
                "(raise bus.max_bytes)",
                key=key,
            )
        if self.config.when_full == "evict_oldest":
            while self._used + nbytes > capacity and self._entries:
                self._drop(next(iter(self._entries.values())), ErrorCode.EVICTED)
        deadline = time.monotonic() + self.config.put_timeout_s
        while self._used + nbytes > capacity:
            left = deadline - time.monotonic()
            if left <= 0 or self.config.when_full == "evict_oldest":
                raise StoreFull(self._full_message(key, nbytes), key=key)
            self._cond.wait(left)
            self._check_new_key(key)
        self._used += nbytes

    def _full_message(self, key: str, nbytes: int) -> str:
        oldest = ", ".join(repr(k) for k in itertools.islice(self._entries, 5)) or "none (all pending)"
        waited = (
            ""
            if self.config.when_full == "evict_oldest"
            else f" after waiting {self.config.put_timeout_s:g} s"
        )
        return (
            f"store {self.store_id} is full{waited}: capacity {_size(self.config.max_bytes)}, "
            f"{_size(self._used)} used by {len(self._entries)} tensors and {len(self._pending)} pending "
            f"allocations; {key!r} needs {_size(nbytes)}. Oldest keys still held: {oldest}. Release "
            "consumed data, raise bus.max_bytes, or set bus.when_full='evict_oldest'"
        )

    # --- releasing ----------------------------------------------------------------------------

    def release(self, keys: Iterable[str] = (), *, tag: str | None = None, prefix: str | None = None) -> int:
        """Drop the named keys, every key put with ``tag``, and every key starting with
        ``prefix`` (pending allocations too); returns how many were dropped. A later fetch
        of a dropped key answers RELEASED. Consumers' shared-memory views stay valid.

        An empty ``prefix`` or ``tag`` raises InvalidRequest: it would match every key (or
        every untagged one), which a RELEASE from the wire must never do by accident; the owner
        empties its store with :meth:`release_all`."""
        for name, value in (("prefix", prefix), ("tag", tag)):
            if value == "":
                raise InvalidRequest(
                    f"release with an empty {name} refused: it would drop every key of store "
                    f"{self.store_id}; name the keys, a tag or a non-empty prefix (the owner of the "
                    "store calls TensorStore.release_all())"
                )
        return self._release(keys, tag, prefix)

    def release_all(self) -> int:
        """Drop every key (pending allocations too): the owner's reset; returns how many."""
        with self._cond:  # re-entrant: _release takes it again
            return self._release([*self._entries, *self._pending], None, None)

    def _release(self, keys: Iterable[str], tag: str | None, prefix: str | None) -> int:
        with self._cond:
            chosen = {k for k in keys if k in self._entries or k in self._pending}
            if tag is not None or prefix is not None:
                for entry in itertools.chain(self._entries.values(), self._pending.values()):
                    if (tag is not None and entry.tag == tag) or (
                        prefix is not None and entry.key.startswith(prefix)
                    ):
                        chosen.add(entry.key)
            for key in chosen:
                self._drop(self._entries.get(key) or self._pending[key], ErrorCode.RELEASED)
            if tag is not None and tag in self._served and not self._holds_tag(tag):
                del self._served[tag]  # bounded: counters live as long as their tag
            return len(chosen)

    def _holds_tag(self, tag: str) -> bool:
        return any(e.tag == tag for e in itertools.chain(self._entries.values(), self._pending.values()))

    def _drop(self, entry: StoredTensor, why: ErrorCode) -> None:
        """Forget ``entry`` (lock held): free its bytes, unlink its segment, leave a tombstone."""
        if self._entries.pop(entry.key, None) is None:
            del self._pending[entry.key]
        self._used -= entry.nbytes
        self._forget_segment(entry)
        self._tombstones[entry.key] = why
        self._tombstones.move_to_end(entry.key)
        while len(self._tombstones) > self.config.max_tombstones:
            self._tombstones.popitem(last=False)
        self._cond.notify_all()

    def abort(self, key: str) -> None:
        """Give up an allocation that was not committed: no tombstone, the key never existed."""
        with self._cond:
            entry = self._pending.pop(key, None)
            if entry is not None:
                self._used -= entry.nbytes
                self._forget_segment(entry)
                self._cond.notify_all()

    def _forget_segment(self, entry: StoredTensor) -> None:
        if entry.segment is not None:
            shm.unlink(self.config.shm_dir, entry.segment)
            self._segments.discard(entry.segment)

    # --- serving ------------------------------------------------------------------------------

    def lookup(self, key: str) -> StoredTensor | ItemError:
        """The committed tensor under ``key``, or the typed error a fetch of it answers."""
        with self._cond:
            entry = self._entries.get(key)
            if entry is not None:
                return entry
            why = self._tombstones.get(key)
            if why is ErrorCode.EVICTED:
                return ItemError(
                    key,
                    why,
                    f"key {key!r} was evicted from store {self.store_id} to make room "
                    "(when_full='evict_oldest'); fetch sooner or raise bus.max_bytes",
                )
            if why is ErrorCode.RELEASED:
                return ItemError(key, why, f"key {key!r} was released from store {self.store_id}")
            return ItemError(key, ErrorCode.NOT_FOUND, self._not_found_message(key))

    def count_served(self, tag: str | None, nbytes: int) -> None:
        """The server sent ``nbytes`` of a tensor put with ``tag`` (untagged ones are not counted)."""
        if tag is not None:
            with self._cond:
                self._served[tag] = self._served.get(tag, 0) + nbytes

    def served_bytes(self, tag: str) -> int:
        """Bytes sent so far of the tensors put with ``tag`` (0 once the tag is released)."""
        with self._cond:
            return self._served.get(tag, 0)

    def _not_found_message(self, key: str) -> str:
        pending = " (allocated but not committed yet)" if key in self._pending else ""
        recent = list(itertools.islice(reversed(self._entries), _SUGGEST_FROM))
        close = difflib.get_close_matches(key, recent, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        return f"store {self.store_id} holds no key {key!r}{pending}{hint}"

    def info(self) -> StoreInfo:
        with self._cond:
            return StoreInfo(
                store_id=self.store_id,
                used_bytes=self._used,
                capacity_bytes=self.config.max_bytes,
                count=len(self._entries),
                pending=len(self._pending),
                shm_probe=self._probe,
                shm_min_bytes=self.config.shm_min_bytes,
                pid=os.getpid(),
                hostname=socket.gethostname(),
                served=dict(self._served),
                served_bytes=self.served_total,
            )

    # --- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Drop everything and remove this store's shared-memory files (mappings stay valid)."""
        with self._cond:
            self._closed = True
            self._entries.clear()
            self._pending.clear()
            self._served.clear()
            self._used = 0
            self._cond.notify_all()
        _LOCAL.pop(self.store_id, None)
        self._cleanup()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unlink_all(folder: str, names: set[str], owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a forked child exiting must not remove its parent's segments
        return
    for name in list(names):
        shm.unlink(folder, name)
    names.clear()


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
