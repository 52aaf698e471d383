"""The rollout's side of the weight publication relay (docs/ARCHITECTURE.md, "Weight publication
relay"): the relay fields of a LoadWeights request checked, the update's tensors fetched from the
nearest holder the coordinator named (the publisher last), and kept for the replicas after this one.

Torch-free: the relay benchmark's simulated replicas run this same code without a model.

What a caller can make a replica do with the relay fields, beyond what the update's own refs
already allow: connect to at most ``MAX_SOURCES`` more bus endpoints (well-formed, neither its
own store nor the publisher's), each given up after ``stall_s`` without a byte; whatever they
answer is checked against the update's dtypes, shapes and sizes (the update's refs, which all
name one store, the publisher's), and the bus admits only stores holding the run's secret.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from flowgrpo.bus import BusClient, TensorRef
from flowgrpo.bus.refs import endpoint_problem
from flowgrpo.bus.relay import Keeper, RelayedFetch, Source, fetch_nearest
from flowgrpo.configs.publication import MAX_STALL_S, MIN_STALL_S
from flowgrpo.fields import FieldError, check_id
from flowgrpo.v1 import common_pb2, rollout_pb2

MAX_SOURCES = 8  # holders one request may name (the coordinator sends the nearest ancestors)
DEFAULT_STALL_S = 10.0  # a holder that sends nothing for this long is given up


def publisher_of(update: common_pb2.WeightUpdate) -> Source | None:
    """The one store every bus tensor of ``update`` names (None: no bus tensors)."""
    stores = {(t.ref.endpoint, t.ref.store_id) for t in update.tensors}
    if len(stores) > 1:
        named = ", ".join(sorted(f"{e} ({s})" for e, s in stores)[:3])
        raise FieldError(
            f"WeightUpdate.tensors name {len(stores)} stores ({named}): an update comes from one "
            "publisher's store; relays are named in LoadWeightsRequest.sources"
        )
    return Source(*next(iter(stores))) if stores else None


def check_sources(request: rollout_pb2.LoadWeightsRequest, own: Source | None) -> tuple[list[Source], float]:
    """The holders to fetch from, nearest first, and the stall limit (FieldError naming the field)."""
    publisher = publisher_of(request.update)
    if len(request.sources) > MAX_SOURCES:
        raise FieldError(f"LoadWeightsRequest.sources: {len(request.sources)} sources; at most {MAX_SOURCES}")
    if request.sources and publisher is None:
        raise FieldError("LoadWeightsRequest.sources: set, but the update has no bus tensors to relay")
    sources: list[Source] = []
    for i, msg in enumerate(request.sources):
        where = f"LoadWeightsRequest.sources[{i}]"
        problem = endpoint_problem(msg.endpoint)
        if problem is not None:
            raise FieldError(f"{where}.endpoint={msg.endpoint[:80]!r}: {problem}")
        check_id(f"{where}.store_id", msg.store_id)
        if msg.replica_id:
            check_id(f"{where}.replica_id", msg.replica_id)
        source = Source(msg.endpoint, msg.store_id, msg.replica_id)
        for other, what in ((own, "this replica's own store"), (publisher, "the publisher's store")):
            if other is not None and (source.endpoint, source.store_id) == (other.endpoint, other.store_id):
                raise FieldError(f"{where}: names {what}; list only other holders (the publisher comes last)")
        if any(source.endpoint == s.endpoint for s in sources):
            raise FieldError(f"{where}.endpoint={msg.endpoint!r}: listed twice")
        sources.append(source)
    return sources, _stall_s(request.source_stall_s)


def _stall_s(value: float) -> float:
    if value == 0:
        return DEFAULT_STALL_S
    if not (math.isfinite(value) and MIN_STALL_S <= value <= MAX_STALL_S):
        raise FieldError(
            f"LoadWeightsRequest.source_stall_s={value!r}: need 0 (default {DEFAULT_STALL_S:g} s) or "
            f"{MIN_STALL_S:g}..{MAX_STALL_S:g} s"
        )
    return value


def fetch_and_keep(
    client: BusClient,
    keeper: Keeper | None,
    version: int,
    refs: Sequence[TensorRef],
    *,
    sources: Sequence[Source],
    stall_s: float,
) -> tuple[RelayedFetch, Source | None]:
    """The update's tensors from the nearest holder; kept for others when ``keeper`` is given."""
    relayed = fetch_nearest(client, refs, sources, stall_s=stall_s)
    held = keeper.keep(version, refs, relayed.fetched) if keeper is not None else None
    return relayed, held


def report(
    response: rollout_pb2.LoadWeightsResponse, relayed: RelayedFetch | None, held: Source | None
) -> None:
    """What the coordinator learns of one load: who sent what, who failed, where it is relayed."""
    if relayed is not None:
        response.fetched_bytes.update(relayed.bytes_by_endpoint)
        response.failed_sources.extend(f[:1000] for f in relayed.failures)
    if held is not None:
        response.relay.CopyFrom(
            rollout_pb2.WeightSource(endpoint=held.endpoint, store_id=held.store_id, replica_id=held.name)
        )
