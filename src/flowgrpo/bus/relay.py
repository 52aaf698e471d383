"""The relay: a consumer fetches data from the nearest of several stores that hold the same keys,
and keeps what it fetched in its own store for the consumers after it.

Weight publication uses it (docs/ARCHITECTURE.md, "Weight publication relay"): the trainer puts a
version under ``weights/v<N>``; each rollout that loaded it keeps the same keys, with the same
bytes, in its own store, and the coordinator points the next rollouts at those holders. A ref
rewritten to another holder keeps its dtype, shape and size, and the fetch checks every reply
against them, so a holder that answers with other bytes' shape is refused like a reused key.

Failures cost time, never correctness: a holder that is gone, frozen or does not hold the keys
is given up (after ``stall_s`` without a byte, or at once for a typed error) and the keys it did
not deliver are asked of the next holder; the original refs (the publisher's store) come last.
Torch-free, so simulated replicas run the same code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from flowgrpo.bus.client import BusClient
from flowgrpo.bus.errors import BusError, StoreFull
from flowgrpo.bus.refs import Fetched, TensorBytes, TensorRef
from flowgrpo.bus.store import TensorStore

log = logging.getLogger(__name__)

WEIGHTS_COLUMN = "weights"
KEEP_VERSIONS = 2  # the version being published and the one before (replicas still fetching it)


def version_tag(version: int) -> str:
    """The store tag of one published weight version, at the publisher and at every relay."""
    return f"weights/v{version}"


@dataclass(frozen=True)
class Source:
    """A store that holds the refs' keys: where a fetch may go instead of the ref's own store."""

    endpoint: str
    store_id: str
    name: str = ""  # who holds it (a replica id), for reports

    def rewrite(self, ref: TensorRef) -> TensorRef:
        return replace(ref, endpoint=self.endpoint, store_id=self.store_id)


@dataclass
class RelayedFetch:
    """What :func:`fetch_nearest` got: the tensors in ref order, the bytes each store sent, and
    each store given up with why."""

    fetched: list[Fetched]
    bytes_by_endpoint: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def fetch_nearest(
    client: BusClient,
    refs: Sequence[TensorRef],
    sources: Sequence[Source],
    *,
    stall_s: float,
    timeout_s: float | None = None,
) -> RelayedFetch:
    """``refs`` from ``sources`` in order, then from the refs' own stores.

    Each source is asked only for what the ones before it did not deliver. A source that sends
    nothing for ``stall_s`` is given up; the refs' own stores get the whole ``timeout_s``
    (default ``fetch_timeout_s``): they are the last resort. Raises the last store's
    :class:`BusError` when a key could be fetched from none (every failure in its message).
    """
    results: list[Fetched | None] = [None] * len(refs)
    report = RelayedFetch([])
    last: BusError | None = None
    for source in [*sources, None]:
        missing = [i for i, got in enumerate(results) if got is None]
        if not missing:
            break
        wanted = [refs[i] if source is None else source.rewrite(refs[i]) for i in missing]
        stall = None if source is None else stall_s
        items = client.fetch(wanted, timeout_s=timeout_s, errors="return", stall_s=stall)
        errors: list[BusError] = []
        for index, ref, item in zip(missing, wanted, items, strict=True):
            if isinstance(item, BusError):
                errors.append(item)
                continue
            results[index] = item
            report.bytes_by_endpoint[ref.endpoint] = (
                report.bytes_by_endpoint.get(ref.endpoint, 0) + ref.nbytes
            )
        if errors:
            last = errors[0]
            where = source.endpoint if source is not None else "the publisher"
            more = f" (and {len(errors) - 1} more keys)" if len(errors) > 1 else ""
            report.failures.append(f"{where}: {errors[0]}{more}")
            log.warning(
                "weights from %s: %d keys failed (%s); trying the next holder", where, len(errors), last
            )
    if any(got is None for got in results):
        assert last is not None
        raise type(last)(
            f"{last.message}; every holder tried failed: {'; '.join(report.failures)}",
            key=last.key,
            endpoint=last.endpoint,
        )
    report.fetched = [got for got in results if got is not None]
    return report


class Keeper:
    """Keeps fetched versions in this process's store for others to fetch (two versions, like
    the publisher), under the publisher's keys and tags."""

    def __init__(self, store: TensorStore, name: str = "") -> None:
        self.store = store
        self.name = name
        self.versions: list[int] = []
        self._warned = False

    def keep(self, version: int, refs: Sequence[TensorRef], fetched: Sequence[Fetched]) -> Source | None:
        """Put ``fetched`` under ``refs``' keys as ``version``; the source that now holds it, or
        None when the store has no room for it (this replica then loads but does not relay)."""
        self._release(lambda v: v == version or v <= version - KEEP_VERSIONS)
        tag = version_tag(version)
        self.store.release(tag=tag)  # a version kept before (a re-publication): replaced
        need = sum(ref.nbytes for ref in refs)
        info = self.store.info()
        if info.capacity_bytes - info.used_bytes < need:
            say = log.info if self._warned else log.warning  # once loud, then quiet
            self._warned = True
            say(
                "weights v%d (%d bytes) do not fit this replica's bus store (%d of %d bytes free): it "
                "loads them but does not relay them; raise bus.max_bytes to relay",
                version, need, info.capacity_bytes - info.used_bytes, info.capacity_bytes,
            )  # fmt: skip
            return None
        try:
            for ref, item in zip(refs, fetched, strict=True):
                data = TensorBytes(item.array.reshape(-1).view("uint8"), ref.dtype, ref.shape)
                self.store.put(ref.key, WEIGHTS_COLUMN, data, policy_version=version, tag=tag)
        except (StoreFull, ValueError) as error:  # the samples took the room meanwhile; a key held
            self.store.release(tag=tag)
            log.warning("weights v%d not relayed: %s", version, error)
            return None
        self.versions.append(version)
        return Source(self.store.endpoint, self.store.store_id, self.name)

    def drop(self, version: int) -> None:
        """Stop serving ``version`` (its load failed after it was kept)."""
        self._release(lambda v: v == version)

    def _release(self, chosen: Callable[[int], bool]) -> None:
        for version in [v for v in self.versions if chosen(v)]:
            self.store.release(tag=version_tag(version))
            self.versions.remove(version)
