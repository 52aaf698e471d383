"""Weight publication that does not grow with the replica count: the relay plan and its driver
(docs/ARCHITECTURE.md, "Weight publication relay").

A star (every rollout fetches every byte from the trainer's store) sends N copies through the
trainer's link. The relay sends each rollout its ``LoadWeights`` with the nearest holders of the
version as sources: the trainer's store serves its ``fanout`` children, each of them, once it has
loaded and kept the version, serves its own children, and so on down a tree of depth about
log_fanout(N). Replicas on one host hang under the first one there (the nearest holder: shared
memory, no network link). A node's children start as soon as that node has loaded (waves by
depth, per subtree), and they get its ancestors as fallbacks, so a relay that dies only makes
its children fetch from the next holder up, the trainer last.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from flowgrpo.v1 import rollout_pb2

MAX_SOURCES = 8  # ancestors sent as fallbacks (the rollout's own limit); the trainer is implicit


@dataclass(frozen=True)
class Member:
    """A rollout to plan for: its id and the host it runs on (replicas of one host share memory)."""

    replica_id: str
    host: str


@dataclass
class RelayPlan:
    """Who fetches from whom: ``children[None]`` are the publisher's own."""

    children: dict[str | None, list[str]] = field(default_factory=dict)
    depth: dict[str, int] = field(default_factory=dict)

    def add(self, parent: str | None, child: str) -> None:
        self.children.setdefault(parent, []).append(child)
        self.depth[child] = 1 if parent is None else self.depth[parent] + 1

    @property
    def max_depth(self) -> int:
        return max(self.depth.values(), default=0)


def plan_star(members: Sequence[Member]) -> RelayPlan:
    plan = RelayPlan()
    for member in members:
        plan.add(None, member.replica_id)
    return plan


def plan_relay(members: Sequence[Member], fanout: int, avoid: frozenset[str] = frozenset()) -> RelayPlan:
    """A tree over ``members``: the first replica of each host (one not in ``avoid`` where there is
    one: relays that failed before) in a breadth-first tree of ``fanout`` children per holder
    under the publisher, then each host's others in a tree of their own under it. Replicas in
    ``avoid`` are leaves wherever possible. Up to ``fanout`` members it is the star: nobody
    waits for a holder, and nobody keeps a copy (a 2-replica run on one host stays as it was)."""
    if len(members) <= fanout:
        return plan_star(members)
    hosts: dict[str, list[str]] = {}
    for member in members:
        hosts.setdefault(member.host, []).append(member.replica_id)
    for ids in hosts.values():
        ids.sort(key=lambda rid: rid in avoid)  # stable: a trusted relay leads its host
    plan = RelayPlan()
    _grow(plan, None, [ids[0] for ids in hosts.values()], fanout, avoid)
    for ids in hosts.values():
        _grow(plan, ids[0], ids[1:], fanout, avoid)
    return plan


def _grow(plan: RelayPlan, root: str | None, nodes: list[str], fanout: int, avoid: frozenset[str]) -> None:
    """Hang ``nodes`` under ``root`` breadth first, ``fanout`` per parent; a node in ``avoid``
    parents nobody unless nothing else can (then ``root`` takes the rest)."""
    parents: list[str | None] = [root]
    slots = {root: fanout}
    for node in nodes:
        while parents and slots[parents[0]] == 0:
            parents.pop(0)
        parent = parents[0] if parents else root
        plan.add(parent, node)
        slots[parent] = slots.get(parent, 0) - 1
        if node not in avoid:
            parents.append(node)
            slots[node] = fanout


Load = Callable[[str, list[rollout_pb2.WeightSource]], Awaitable[rollout_pb2.LoadWeightsResponse]]


@dataclass
class Publication:
    """What one publication did: each replica's answer or error, and how long it took."""

    responses: dict[str, rollout_pb2.LoadWeightsResponse] = field(default_factory=dict)
    errors: dict[str, BaseException] = field(default_factory=dict)
    seconds: float = 0.0
    depth: int = 0

    def holders(self) -> list[rollout_pb2.WeightSource]:
        return [r.relay for r in self.responses.values() if r.HasField("relay")]

    def fallbacks(self) -> dict[str, list[str]]:
        """Replica -> the holders it gave up ("endpoint: why")."""
        return {rid: list(r.failed_sources) for rid, r in self.responses.items() if r.failed_sources}

    def bytes_from(self, endpoints: set[str]) -> int:
        return sum(n for r in self.responses.values() for e, n in r.fetched_bytes.items() if e in endpoints)

    def metrics(self, publisher_endpoint: str) -> dict[str, float]:
        fetched = sum(n for r in self.responses.values() for n in r.fetched_bytes.values())
        from_publisher = self.bytes_from({publisher_endpoint})
        return {
            "publication/time_to_all_s": self.seconds,
            "publication/depth": float(self.depth),
            "publication/replicas": float(len(self.responses)),
            "publication/failed_replicas": float(len(self.errors)),
            "publication/fallbacks": float(sum(len(f) for f in self.fallbacks().values())),
            "publication/fetched_bytes": float(fetched),
            "publication/relayed_bytes": float(fetched - from_publisher),
        }


async def publish(plan: RelayPlan, load: Load) -> Publication:
    """Run ``plan``: a replica's children load once it has, with its source first among theirs."""
    outcome = Publication(depth=plan.max_depth)
    started = time.perf_counter()

    async def visit(node: str, sources: list[rollout_pb2.WeightSource]) -> None:
        try:
            response = await load(node, sources)
        except Exception as error:  # the pool decides (a lost replica, or the run's failure)
            outcome.errors[node] = error
            inherited = sources  # its children skip it: their nearest holder is its parent
        else:
            outcome.responses[node] = response
            inherited = ([response.relay] if response.HasField("relay") else []) + sources
        await asyncio.gather(
            *(visit(child, inherited[:MAX_SOURCES]) for child in plan.children.get(node, []))
        )

    await asyncio.gather(*(visit(child, []) for child in plan.children.get(None, [])))
    outcome.seconds = time.perf_counter() - started
    return outcome
