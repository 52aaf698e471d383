"""The run's replicas as the coordinator drives them.

- Rollout work goes to the least busy healthy replica; a replica that fails (or misses its
  deadline, or is lost by the registry) leaves the pool and the work goes to another one. With
  none left the pool waits ``launch.start_timeout_s`` for one to register again.
- Scoring goes round robin over the reward replicas; scoring holds no state, so a failed one is
  tried again after a back-off (1 s, doubling, at most 60 s) instead of being given up.
- Weight loads go to every healthy rollout, one load at a time (a lock), and the last update is
  kept: a rollout that (re)joins loads it before it takes work, so no replica serves an older
  version than the others. How the bytes travel (a relay tree or a star) is ``relay.py``'s.
- The registry's events (``follow``): lost or departed replicas leave the pool (their calls in
  flight end at once), registered ones (back, or new: scaling up) join it. A trainer is never
  taken from the registry here: when the run's trainer dies, ``revive.py`` brings one back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import grpc.aio

from flowgrpo.bus import StoreInfo
from flowgrpo.bus.relay import version_tag
from flowgrpo.configs.publication import PublicationConfig
from flowgrpo.configs.run import LaunchConfig
from flowgrpo.runtime import open_channel, wait_ready
from flowgrpo.services.coordinator.handles import STUBS, Replica, ReplicaError
from flowgrpo.services.coordinator.registry import CoordinatorService
from flowgrpo.services.coordinator.relay import (
    MAX_SOURCES,
    Member,
    Publication,
    plan_relay,
    plan_star,
    publish,
)
from flowgrpo.v1 import common_pb2, reward_pb2, rollout_pb2

log = logging.getLogger(__name__)

BACKOFF_S, BACKOFF_MAX_S = 1.0, 60.0  # a failed reward replica's first and longest pause


class RunError(RuntimeError):
    """The run cannot go on (no healthy replica left, the trainer failed); it resumes from its
    last checkpoint."""


class TrainerGone(RuntimeError):
    """A weight load failed because the trainer whose store held the weights has died (not
    because of the rollouts, which stay in the pool)."""


class ReplicaPool:
    def __init__(
        self,
        launch: LaunchConfig,
        rollouts: list[Replica],
        rewards: list[Replica],
        trainer: Replica,
        say: Callable[[str], None],
        *,
        publication: PublicationConfig | None = None,
    ) -> None:
        self.launch = launch
        self.publication = publication or PublicationConfig()
        self.rollouts, self.rewards, self.trainer = list(rollouts), list(rewards), trainer
        self.retries = 0  # calls that failed on one replica and went to another (or again later)
        self.rejoins = 0  # replicas that registered again and came back into the pool
        self.current_update: common_pb2.WeightUpdate | None = None  # what a (re)joining rollout loads
        self.samples_served: Counter[str] = Counter()  # rollout replica id -> samples it generated
        self._say = say
        self._weights = asyncio.Lock()
        self._channels: list[grpc.aio.Channel] = []  # to replicas that joined during the run
        self._next_reward = 0
        # weights: the holders of the current version (a joining rollout fetches from the nearest),
        # relays that failed their children (leaves from then on), the publisher's store counters
        self._holders: list[rollout_pb2.WeightSource] = []
        self._failed_relays: set[str] = set()
        self.store_stats: Callable[[str], StoreInfo] | None = None

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    # --- rollouts --------------------------------------------------------------------------------

    def healthy_rollouts(self) -> list[Replica]:
        return [r for r in self.rollouts if r.healthy]

    async def generate(self, request: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:
        """``request`` on the least busy healthy rollout; on a replica failure, on another."""
        while True:
            replica = await self._pick(self.rollouts)
            replica.busy += 1
            try:
                response = await replica.generate(request, self.launch.request_timeout_s)
                self.samples_served[replica.replica_id] += len(response.samples)
                return response
            except ReplicaError as error:
                self._failed(replica, error)
            finally:
                replica.busy -= 1

    async def _pick(self, replicas: list[Replica]) -> Replica:
        """The least busy healthy replica. When none is left, one may still register again (a
        restarted process, a rescheduled pod): wait up to ``launch.start_timeout_s`` for it."""
        wait_s = self.launch.start_timeout_s
        deadline = time.monotonic() + wait_s
        while not (healthy := [r for r in replicas if r.healthy]):
            if time.monotonic() > deadline:
                role = replicas[0].role if replicas else "?"
                raise RunError(
                    f"no healthy {role} replica left ({', '.join(describe(r) for r in replicas)}) and "
                    f"none registered again within launch.start_timeout_s={wait_s:.0f} s; see their logs"
                )
            await asyncio.sleep(0.2)
        return min(healthy, key=lambda r: r.busy)

    def _failed(self, replica: Replica, error: ReplicaError) -> None:
        if not error.retryable:
            raise RunError(str(error)) from error
        if replica.healthy:  # once: its other calls fail with this reason, which must not nest
            replica.lose(f"failed: {error}")
        self.retries += 1
        log.warning("%s; its work goes to another replica", error)

    # --- rewards -----------------------------------------------------------------------------------

    async def score(
        self, requests: list[reward_pb2.ScoreRequest], counted: Callable[[int], None] | None = None
    ) -> list[reward_pb2.ScoreResult]:
        """Score ``requests`` on one reward replica; the call fails the run only when no replica
        has answered for ``launch.request_timeout_s``. ``counted(n)``: n more results are in (n < 0:
        a failed replica's results, counted before, are void: its requests go to another one)."""
        timeout = self.launch.reward_timeout_s * max(1, len(requests))
        give_up = time.monotonic() + self.launch.request_timeout_s
        count = counted or (lambda _: None)
        while True:
            replica = await self._next_reward_replica(give_up)
            got = 0

            def one() -> None:
                nonlocal got
                got += 1
                count(1)

            try:
                results = await replica.score(requests, timeout, one)
            except ReplicaError as error:
                count(-got)
                if not error.retryable:
                    raise RunError(str(error)) from error
                replica.failures += 1
                replica.retry_at = time.monotonic() + min(
                    BACKOFF_MAX_S, BACKOFF_S * 2 ** (replica.failures - 1)
                )
                self.retries += 1
                log.warning("%s; retried on another reward replica (this one again in %.0f s)", error,
                            replica.retry_at - time.monotonic())  # fmt: skip
                continue
            replica.failures = 0
            return results

    async def _next_reward_replica(self, give_up: float) -> Replica:
        while True:
            now = time.monotonic()
            live = [r for r in self.rewards if r.healthy]  # lost or left ones: out until they register
            ready = [r for r in live if r.retry_at <= now]
            if ready:
                replica = ready[self._next_reward % len(ready)]
                self._next_reward += 1
                return replica
            wake = min((r.retry_at for r in live), default=now + 1.0)  # none live: one may register
            if wake > give_up:
                failed = ", ".join(describe(r) for r in self.rewards)
                raise RunError(
                    f"no reward replica answered within launch.request_timeout_s="
                    f"{self.launch.request_timeout_s:.0f} s: {failed}; see their logs"
                )
            log.warning("no reward replica can take work now; looking again in %.1f s", wake - now)
            await asyncio.sleep(wake - now)

    # --- weights -----------------------------------------------------------------------------------

    async def load_weights(
        self,
        update: common_pb2.WeightUpdate,
        publisher_gone: Callable[[], Awaitable[bool]] | None = None,
    ) -> dict[str, float]:
        """``update`` on every healthy rollout that does not hold its version yet, relayed or as
        a star (``publication.mode``); a replica that fails it leaves the pool, unless
        ``publisher_gone`` says the trainer that published it has died (:class:`TrainerGone`:
        the rollouts are not to blame). Returns the ``publication/*`` metrics."""
        async with self._weights:
            self.current_update = update
            replicas = {
                r.replica_id: r
                for r in self.healthy_rollouts()
                if r.policy_version < update.policy_version or update.HasField("base")
            }  # a base: a rollout at the same version maps the (new) trainer's base
            members = [Member(rid, _host(r)) for rid, r in replicas.items()]
            plan = (
                plan_relay(members, self.publication.relay_fanout, frozenset(self._failed_relays))
                if self.publication.mode == "relay"
                else plan_star(members)
            )
            relay = plan.max_depth > 1  # up to fanout replicas: the star (plan_relay), nobody keeps a copy

            async def load(
                rid: str, sources: list[rollout_pb2.WeightSource]
            ) -> rollout_pb2.LoadWeightsResponse:
                return await self._load_into(replicas[rid], update, sources, relay=relay)

            outcome = await publish(plan, load)
            self._holders = outcome.holders()
            if outcome.errors and publisher_gone is not None and await publisher_gone():
                first = next(iter(outcome.errors.values()))
                raise TrainerGone(f"the trainer died while {len(outcome.errors)} rollouts fetched v"
                                  f"{update.policy_version} from it ({first})")  # fmt: skip
        self._account_failures(outcome, replicas)
        return await self._publication_metrics(update, outcome)

    def _account_failures(self, outcome: Publication, replicas: dict[str, Replica]) -> None:
        """Failed replicas leave the pool; relays their children gave up are named and demoted."""
        for rid, error in outcome.errors.items():
            if not isinstance(error, ReplicaError):
                raise error
            self._failed(replicas[rid], error)
        by_endpoint = {
            r.relay.endpoint: r.relay.replica_id for r in outcome.responses.values() if r.HasField("relay")
        }
        for rid, failures in outcome.fallbacks().items():
            for failure in failures:
                holder = by_endpoint.get(failure.split(": ", 1)[0], "")
                if holder:
                    self._failed_relays.add(holder)
                log.warning(
                    "rollout %s gave up weight holder %s (a leaf in the relay plan from now on): %s; "
                    "it fetched from the next holder", rid, holder or "?", failure,
                )  # fmt: skip

    async def _publication_metrics(
        self, update: common_pb2.WeightUpdate, outcome: Publication
    ) -> dict[str, float]:
        publisher = update.tensors[0].ref.endpoint if update.tensors else ""
        metrics = outcome.metrics(publisher)
        if publisher and self.store_stats is not None:
            try:
                info = await asyncio.to_thread(self.store_stats, publisher)
            except Exception as error:  # a metric: the run does not depend on it
                log.warning("could not read the trainer store's counters at %s: %s", publisher, error)
            else:
                metrics["publication/trainer_bytes_sent"] = float(
                    info.served.get(version_tag(update.policy_version), 0)
                )
        return metrics

    async def _load_into(
        self,
        replica: Replica,
        update: common_pb2.WeightUpdate,
        sources: list[rollout_pb2.WeightSource] | None = None,
        *,
        relay: bool = False,
    ) -> rollout_pb2.LoadWeightsResponse:
        request = rollout_pb2.LoadWeightsRequest(
            update=update, sources=sources or [], relay=relay and bool(update.tensors),
            source_stall_s=self.publication.relay_stall_s,
        )  # fmt: skip
        response = await replica.load_weights(request, self.launch.request_timeout_s)
        replica.policy_version = update.policy_version
        return response

    async def trainer_replaced(self, trainer: Replica, update: common_pb2.WeightUpdate) -> None:
        """``trainer`` serves the run from now on; ``update`` (its publication of the version the
        rollouts hold) is what a joining rollout loads. The rollouts load nothing: they hold
        that version already, unless it carries a base (``trainer.share_base``) to map anew."""
        self.trainer = trainer
        async with self._weights:
            self.current_update = update
        if update.HasField("base"):
            await self.load_weights(update)

    async def release(self, tag: str) -> None:
        """Let every rollout drop the data it kept under ``tag``."""
        request = rollout_pb2.ReleaseRequest(tags=[tag])
        for replica in self.healthy_rollouts():
            try:
                await replica.release(request, self.launch.request_timeout_s)
            except ReplicaError as error:
                self._failed(replica, error)

    # --- the registry's events ---------------------------------------------------------------------

    async def follow(self, registry: CoordinatorService) -> None:
        """Apply what the registry sees, until cancelled."""
        while True:
            event = await registry.events.get()
            try:
                if event.kind == "joined":
                    await self._join(event.info)
                elif not _stale_trainer_event(event.info, registry):
                    self._lose(
                        event.info, "stopped sending heartbeats" if event.kind == "lost" else "left the run"
                    )
            except Exception as error:  # one replica's trouble must not stop the others' events
                log.warning("%s %s: could not take it into the run: %s", event.info.role,
                            event.info.replica_id, error)  # fmt: skip

    def _of_role(self, role: str) -> list[Replica]:
        return {"rollout": self.rollouts, "reward": self.rewards, "trainer": [self.trainer]}[role]

    def _lose(self, info: common_pb2.ServiceInfo, reason: str) -> None:
        for replica in self._of_role(info.role):
            if replica.replica_id == info.replica_id and replica.address == info.grpc_address:
                replica.lose(reason)
                log.warning(
                    "%s %s %s; its work goes to the other replicas", info.role, info.replica_id, reason
                )

    async def _join(self, info: common_pb2.ServiceInfo) -> None:
        replicas = self._of_role(info.role)
        known = next((r for r in replicas if r.replica_id == info.replica_id), None)
        if known is not None and known.healthy and known.address == info.grpc_address:
            return  # the launcher connected it already
        if info.role == "trainer":  # taken when the run's trainer has died (revive.py), not here
            log.info("trainer %s registered at %s", info.replica_id, info.grpc_address)
            return
        channel = open_channel(info.grpc_address)
        self._channels.append(channel)
        await wait_ready(info.grpc_address, role=info.role, timeout_s=self.launch.start_timeout_s,
                         channel=channel, client_role="coordinator")  # fmt: skip
        replica = Replica(info.role, info.replica_id, info.grpc_address, STUBS[info.role](channel))
        replica.policy_version = info.policy_version
        if info.role == "rollout":
            await self._catch_up(replica)
        if known is not None:
            known.lose("replaced by its new registration")
            replicas[replicas.index(known)] = replica
            self.rejoins += 1
        else:
            replicas.append(replica)
        self._say(f"  {info.role} {info.replica_id} {'rejoined' if known else 'joined'} the run "
                  f"at {info.grpc_address} (policy version {replica.policy_version})")  # fmt: skip

    async def _catch_up(self, replica: Replica) -> None:
        """Load the current weights into a rollout replica before it takes work."""
        async with self._weights:
            update = self.current_update
            # a (re)started replica mapping the trainer's base needs it even at the same version
            if update is not None and (
                replica.policy_version != update.policy_version or update.HasField("base")
            ):
                await self._load_into(replica, update, self._nearest_holders(replica))

    def _nearest_holders(self, replica: Replica) -> list[rollout_pb2.WeightSource]:
        """The current version's holders for a joining replica: those of its host first."""
        others = [h for h in self._holders if h.replica_id != replica.replica_id]
        here = [h for h in others if _endpoint_host(h.endpoint) == _host(replica)]
        elsewhere = [h for h in others if h not in here]
        return here[: MAX_SOURCES // 2] + elsewhere[: MAX_SOURCES // 2]


def _stale_trainer_event(info: common_pb2.ServiceInfo, registry: CoordinatorService) -> bool:
    """A trainer's loss (or leave) that the registry has seen undone: the trainer registered
    again under its id, at the same address (restarted in place), before the event was read."""
    member = registry.members.get(info.replica_id)
    return info.role == "trainer" and member is not None and member.state == "up"


def _host(replica: Replica) -> str:
    """The host a replica runs on, as its address names it ("inprocess": this process)."""
    return replica.address.rsplit(":", 1)[0].strip("[]")


def _endpoint_host(endpoint: str) -> str:
    return endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")


def describe(replica: Replica) -> str:
    why = replica.lost_reason or ("failed" if not replica.healthy else f"{replica.failures} failures")
    return f"{replica.replica_id} ({why})"
