"""The weight publication relay with real parts: seven rollout processes (the load-test engine, which
checks every update against the checkpoint's shapes), the coordinator's pool driving them over gRPC,
the trainer's store in this process, every byte over bus sockets. After a publication each replica
holds the version and serves it from its own store, and those bytes are compared with the
trainer's, bitwise; the trainer's own store counts what it sent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import grpc
import grpc.aio
import pytest
import torch

from flowgrpo.bus import BusClient, BusConfig, BusServer, StoreInfo, TensorRef, serve_store
from flowgrpo.bus.relay import version_tag
from flowgrpo.bus.torch_tensors import put_tensor
from flowgrpo.configs.publication import PublicationConfig
from flowgrpo.configs.run import LaunchConfig
from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.runtime import open_channel
from flowgrpo.services.coordinator.handles import Replica
from flowgrpo.services.coordinator.pool import ReplicaPool
from flowgrpo.services.coordinator.relay import Member, plan_relay
from flowgrpo.services.rollout.synthetic import SyntheticEngine
from flowgrpo.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from tests.services.launch import kill_service, spawn_service

REPLICAS, FANOUT, RANK = 7, 2, 1024
# sockets only (no shared memory), in small requests one at a time: a transfer lasts long enough
# to be cut in the middle, as a transfer between hosts would be
BUS = BusConfig(shm=False, max_request_bytes=64 << 10, pipeline_depth=1)
CHECK = BusConfig(shm=False)  # this test's own reads: whole requests
T = TypeVar("T")


@dataclass
class Fleet:
    checkpoint: Path
    procs: list[subprocess.Popen[str]]
    addresses: list[str]
    trainer: BusServer


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("relay")
    checkpoint = make_tiny_bagel(root / "tiny", seed=0)
    overrides = [
        f"rollout.checkpoint={checkpoint}",
        "rollout.engine=synthetic",
        "bus.shm=false",
        f"bus.max_request_bytes={BUS.max_request_bytes}",
        f"bus.pipeline_depth={BUS.pipeline_depth}",
    ]

    def spawn(i: int) -> tuple[subprocess.Popen[str], str]:
        # each on a loopback address of its own: seven hosts to the plan (127.0.0.0/8 is all lo)
        host = [f"replica_id=r{i}", f"server.host=127.0.0.{i + 2}", f"bus.host=127.0.0.{i + 2}"]
        return spawn_service("rollout", [*overrides, *host], root / f"ready{i}.json")

    procs: list[subprocess.Popen[str]] = []
    addresses: list[str] = []
    try:
        with ThreadPoolExecutor(REPLICAS) as pool:
            for proc, address in pool.map(spawn, range(REPLICAS)):
                procs.append(proc)
                addresses.append(address)
        with serve_store(BUS) as trainer:
            yield Fleet(checkpoint, procs, addresses, trainer)
    finally:
        for proc in procs:
            kill_service(proc)


def lora(checkpoint: Path, version: int) -> dict[str, torch.Tensor]:
    """A LoRA pair per gen-path linear of the tiny checkpoint, random per version (~10 MB)."""
    shapes = SyntheticEngine.from_checkpoint(checkpoint, step_delay_s=0, max_batch_samples=1).shapes
    g = torch.Generator().manual_seed(version)
    out = {}
    for name, shape in shapes.items():
        if name.endswith(".weight") and ("_moe_gen." in name or "mlp_moe_gen" in name) and len(shape) == 2:
            module = name.removesuffix(".weight")
            out[f"{module}.lora_A.weight"] = torch.randn(RANK, shape[1], generator=g)
            out[f"{module}.lora_B.weight"] = torch.randn(shape[0], RANK, generator=g)
    return out


def publish(fleet: Fleet, version: int) -> tuple[common_pb2.WeightUpdate, dict[str, bytes]]:
    """What the trainer's Publisher does: the tensors under weights/v<N>, and the update naming them."""
    tag, store = version_tag(version), fleet.trainer.store
    update = common_pb2.WeightUpdate(
        policy_version=version, kind="lora", lora=common_pb2.LoraSpec(rank=RANK, alpha=RANK)
    )
    truth = {}
    for name, tensor in lora(fleet.checkpoint, version).items():
        ref = put_tensor(store, f"{tag}/{name}", "weights", tensor, policy_version=version, tag=tag)
        update.tensors.append(common_pb2.NamedTensor(name=name, ref=ref.to_proto()))
        truth[name] = tensor.numpy().tobytes()
    return update, truth


def run_with_pool(
    fleet: Fleet, publication: PublicationConfig, body: Callable[[ReplicaPool], Awaitable[T]]
) -> T:
    """``body`` with a coordinator pool over the live replicas (channels opened in this loop)."""

    async def main() -> T:
        channels = [open_channel(a) for a in fleet.addresses]
        rollouts = [
            Replica("rollout", f"r{i}", a, rollout_pb2_grpc.RolloutStub(c))
            for i, (a, c) in enumerate(zip(fleet.addresses, channels, strict=True))
        ]
        pool = ReplicaPool(LaunchConfig(request_timeout_s=60), rollouts, [], rollouts[0], lambda _: None,
                           publication=publication)  # fmt: skip
        pool.store_stats = stat
        try:
            return await body(pool)
        finally:
            for channel in channels:
                await channel.close()

    return asyncio.run(main())


def stat(endpoint: str) -> StoreInfo:
    with BusClient(CHECK) as client:
        return client.stat(endpoint)


def held_bytes(update: common_pb2.WeightUpdate, source: rollout_pb2.WeightSource) -> dict[str, bytes]:
    """The bytes a replica serves as its copy of ``update`` (what it fetched and applied)."""
    refs = [TensorRef.from_proto(t.ref) for t in update.tensors]
    with BusClient(CHECK, local_stores=False) as client:
        fetched = client.fetch([replace(r, endpoint=source.endpoint, store_id=source.store_id) for r in refs])
    return {t.name: f.array.tobytes() for t, f in zip(update.tensors, fetched, strict=True)}


async def load_and_report(
    pool: ReplicaPool, update: common_pb2.WeightUpdate
) -> tuple[dict[str, float], dict[str, rollout_pb2.WeightSource]]:
    metrics = await pool.load_weights(update)
    return metrics, {h.replica_id: h for h in pool._holders}


def total_bytes(truth: dict[str, bytes]) -> int:
    return sum(len(b) for b in truth.values())


# --- the plan --------------------------------------------------------------------------------------


def test_the_plan_bounds_the_fanout_prefers_the_same_host_and_keeps_failed_relays_as_leaves() -> None:
    members = [Member(f"r{i}", f"h{i % 3}") for i in range(30)]
    plan = plan_relay(members, fanout=2)
    assert sorted(plan.depth) == sorted(m.replica_id for m in members)  # everyone, once
    assert len(plan.children[None]) == 2  # the trainer sends each byte twice, whatever N
    hosts = {m.replica_id: m.host for m in members}
    leaders = {"r0", "r1", "r2"}  # the first replica of each host
    for parent, children in plan.children.items():
        same = [c for c in children if parent is not None and hosts[c] == hosts[parent]]
        assert len(children) - len(same) <= 2 and len(same) <= 2  # k across hosts, k within one
        for child in children:  # only a host's first replica fetches from another host
            assert parent is None or hosts[child] == hosts[parent] or child in leaders
    star_sized = plan_relay([Member(f"r{i}", f"h{i}") for i in range(64)], fanout=4)
    assert star_sized.max_depth == 3 and len(star_sized.children[None]) == 4
    demoted = plan_relay([Member(f"r{i}", f"h{i}") for i in range(7)], fanout=2, avoid=frozenset({"r0"}))
    assert "r0" not in demoted.children and demoted.max_depth == 3
    for n in (1, 2, 4):  # up to fanout replicas, on one host or several: the star, nobody waits
        assert plan_relay([Member(f"r{i}", "h0") for i in range(n)], fanout=4).max_depth == 1
    assert plan_relay([Member(f"r{i}", "h0") for i in range(5)], fanout=4).max_depth == 2


# --- real replicas -----------------------------------------------------------------------------------


def test_seven_replicas_end_bitwise_equal_and_the_trainer_sends_each_byte_at_most_fanout_times(
    fleet: Fleet,
) -> None:
    update, truth = publish(fleet, 1)
    metrics, holders = run_with_pool(
        fleet, PublicationConfig(relay_fanout=FANOUT), lambda p: load_and_report(p, update)
    )
    assert sorted(holders) == [f"r{i}" for i in range(REPLICAS)]
    for rid, source in holders.items():
        assert held_bytes(update, source) == truth, rid  # bitwise, every tensor, every replica
    sent = fleet.trainer.store.served_bytes(version_tag(1))
    assert sent == FANOUT * total_bytes(truth)
    assert metrics["publication/trainer_bytes_sent"] == sent
    assert metrics["publication/relayed_bytes"] == (REPLICAS - FANOUT) * total_bytes(truth)
    assert metrics["publication/depth"] == 3 and metrics["publication/fallbacks"] == 0

    update, truth = publish(fleet, 2)  # the star, for contrast: N copies
    metrics, holders = run_with_pool(
        fleet, PublicationConfig(mode="star"), lambda p: load_and_report(p, update)
    )
    assert holders == {} and metrics["publication/depth"] == 1
    assert fleet.trainer.store.served_bytes(version_tag(2)) == REPLICAS * total_bytes(truth)
    assert fleet.trainer.store.served_bytes(version_tag(0)) == 0  # released: counters go with their tag


def test_a_hostile_load_weights_is_refused_or_gets_only_the_updates_bytes(
    fleet: Fleet, tmp_path: Path
) -> None:
    update, truth = publish(fleet, 3)
    target = fleet.addresses[REPLICAS - 1]

    def call(request: rollout_pb2.LoadWeightsRequest) -> rollout_pb2.LoadWeightsResponse:
        async def go() -> rollout_pb2.LoadWeightsResponse:
            async with open_channel(target) as channel:
                return await rollout_pb2_grpc.RolloutStub(channel).LoadWeights(request, timeout=60)

        return asyncio.run(go())

    two_stores = common_pb2.WeightUpdate()
    two_stores.CopyFrom(update)
    two_stores.tensors[1].ref.endpoint = "tcp://127.0.0.1:1"

    def source(endpoint: str, store_id: str = "a") -> rollout_pb2.WeightSource:
        return rollout_pb2.WeightSource(endpoint=endpoint, store_id=store_id)

    def request(*sources: rollout_pb2.WeightSource, stall: float = 0.0) -> rollout_pb2.LoadWeightsRequest:
        return rollout_pb2.LoadWeightsRequest(update=update, sources=sources, source_stall_s=stall)

    bad = [
        (rollout_pb2.LoadWeightsRequest(update=two_stores), "one publisher's store"),
        (request(source("http://x")), "endpoint"),
        (request(source(fleet.trainer.endpoint, fleet.trainer.store.store_id)), "publisher's store"),
        (request(*(source(f"tcp://127.0.0.1:{p}") for p in range(1, 11))), "at most 8"),
        (request(stall=float("nan")), "source_stall_s"),
    ]
    for request, says in bad:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            call(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in (
            refused.value.details() or ""
        )

    # a "holder" with the same keys but other shapes and dtypes, and one nobody serves: both are given
    # up, the update's own bytes come from the publisher, the replica says which holders failed
    with serve_store(BUS) as liar:
        for t in update.tensors:
            # as many bytes as the real tensor, another dtype and shape: only the check of each
            # reply against the update's refs tells them apart
            put_tensor(liar.store, t.ref.key, "weights", torch.zeros(t.ref.nbytes // 2, dtype=torch.float16))
        request = rollout_pb2.LoadWeightsRequest(
            update=update, relay=True, source_stall_s=0.5,
            sources=[rollout_pb2.WeightSource(endpoint=liar.endpoint, store_id=liar.store.store_id),
                     rollout_pb2.WeightSource(endpoint="tcp://127.0.0.1:9", store_id="0123456789abcdef")],
        )  # fmt: skip
        response = call(request)
    assert response.policy_version == 3
    assert [f.split(": ")[0] for f in response.failed_sources] == [liar.endpoint, "tcp://127.0.0.1:9"]
    assert "float16" in response.failed_sources[0] and "the ref says float32" in response.failed_sources[0]
    assert dict(response.fetched_bytes) == {fleet.trainer.endpoint: total_bytes(truth)}
    assert held_bytes(update, response.relay) == truth


def test_a_relay_killed_mid_transfer_only_moves_its_children_to_the_next_holder(fleet: Fleet) -> None:
    """r0 (a child of the trainer) is SIGKILLed once it has sent its children part of the bytes;
    they give it up after relay_stall_s and fetch the rest from the trainer; the coordinator names
    it, plans it as a leaf, and drops it from the pool at the next publication."""
    update, truth = publish(fleet, 4)
    publication = PublicationConfig(relay_fanout=FANOUT, relay_stall_s=1.0)
    killed_after: list[int] = []
    errors: list[BaseException] = []
    r0 = fleet.procs[0].pid

    def kill_r0_mid_transfer(source: rollout_pb2.WeightSource, client: BusClient) -> None:
        # r0 was stopped before its children were told to fetch from it, and this client was made
        # then: from SIGCONT on, nothing but r0's serving stands between a poll and the kill
        try:
            tag, deadline = version_tag(4), time.monotonic() + 30
            os.killpg(r0, signal.SIGCONT)
            while time.monotonic() < deadline:
                served = client.stat(source.endpoint, timeout_s=5).served.get(tag, 0)
                if served > 0:
                    os.killpg(r0, signal.SIGKILL)
                    killed_after.append(served)
                    return
        except BaseException as e:  # reported by the test, not lost with the thread
            errors.append(e)
        finally:
            client.close()

    async def body(pool: ReplicaPool) -> tuple[dict[str, float], dict[str, rollout_pb2.WeightSource]]:
        load_into = pool._load_into

        async def watched(
            replica: Replica, *args: object, **kwargs: object
        ) -> rollout_pb2.LoadWeightsResponse:
            response = await load_into(replica, *args, **kwargs)  # type: ignore[arg-type]
            if replica.replica_id == "r0":  # its children start now: kill it while they fetch
                os.killpg(r0, signal.SIGSTOP)
                client = BusClient(CHECK, local_stores=False)
                args = (response.relay, client)
                threading.Thread(target=kill_r0_mid_transfer, args=args, daemon=True).start()
            return response

        pool._load_into = watched  # type: ignore[method-assign]
        reported = await load_and_report(pool, update)
        assert not errors, f"the kill thread failed: {errors[0]!r}"
        assert killed_after and 0 < killed_after[0] < FANOUT * total_bytes(truth), (
            f"r0 was not killed mid-transfer (it had served {killed_after})"
        )
        assert pool._failed_relays == {"r0"}  # named (a warning) and a leaf in later plans
        return reported

    metrics, holders = run_with_pool(fleet, publication, body)
    fleet.procs[0].wait()
    assert metrics["publication/fallbacks"] >= 1 and metrics["publication/failed_replicas"] == 0
    for rid in [f"r{i}" for i in range(1, REPLICAS)]:  # every survivor on v4, bitwise the trainer's
        assert held_bytes(update, holders[rid]) == truth, rid
    sent = fleet.trainer.store.served_bytes(version_tag(4))
    assert sent <= 2 * FANOUT * total_bytes(truth)  # r0's children took from the trainer: at most 2k copies

    update, truth = publish(fleet, 5)  # the next publication: r0 fails its load and leaves the pool

    async def next_one(pool: ReplicaPool) -> list[str]:
        await pool.load_weights(update)
        return [r.replica_id for r in pool.healthy_rollouts()]

    assert run_with_pool(fleet, publication, next_one) == [f"r{i}" for i in range(1, REPLICAS)]
