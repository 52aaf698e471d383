"""The bus side of the weight relay: fetch from the nearest holder with fallbacks, keep fetched
versions for others (two, like the publisher), and stores counting the bytes they serve per tag."""

from __future__ import annotations

import time

import numpy as np
import pytest

from flowgrpo.bus import BusClient, BusConfig, Released, TensorBytes, TensorStore, serve_store
from flowgrpo.bus.refs import TensorRef
from flowgrpo.bus.relay import Keeper, Source, fetch_nearest, version_tag

CONFIG = BusConfig(shm=False)


def put_version(store: TensorStore, version: int, sizes: tuple[int, ...] = (1000, 3000)) -> list[TensorRef]:
    tag = version_tag(version)
    return [
        store.put(
            f"{tag}/t{i}",
            "weights",
            np.full(n, version + i / 10, np.float32),
            policy_version=version,
            tag=tag,
        )
        for i, n in enumerate(sizes)
    ]


def test_fetch_nearest_takes_what_each_holder_has_and_names_the_ones_given_up() -> None:
    with (
        serve_store(CONFIG) as publisher,
        serve_store(CONFIG) as partial,
        BusClient(CONFIG, local_stores=False) as client,
    ):
        refs = put_version(publisher.store, 1)
        partial.store.put(refs[0].key, "weights", np.full(1000, 1.0, np.float32), tag=version_tag(1))
        dead = Source("tcp://127.0.0.1:9", "0123456789abcdef")
        holder = Source(partial.endpoint, partial.store.store_id)
        started = time.monotonic()
        got = fetch_nearest(client, refs, [dead, holder], stall_s=0.3)
        assert time.monotonic() - started < 5  # the dead one cost its stall, not the 60 s deadline
        assert [f.array.tobytes() for f in got.fetched] == [
            np.full(1000, 1.0, np.float32).tobytes(),  # from the holder
            np.full(3000, 1.1, np.float32).tobytes(),  # it has no t1: from the publisher
        ]
        assert got.bytes_by_endpoint == {partial.endpoint: 4000, publisher.endpoint: 12000}
        assert [f.split(": ")[0] for f in got.failures] == [dead.endpoint, partial.endpoint]
        assert "did not answer" in got.failures[0] and "no key" in got.failures[1]
        assert partial.store.served_bytes(version_tag(1)) == 4000
        assert publisher.store.served_bytes(version_tag(1)) == 12000
        publisher.store.release(tag=version_tag(1))
        with pytest.raises(Released, match="every holder tried failed"):  # the publisher's verdict
            fetch_nearest(client, [refs[1]], [holder], stall_s=0.3)
        assert publisher.store.served_bytes(version_tag(1)) == 0  # the counter went with its tag


def test_a_keeper_serves_two_versions_and_declines_what_does_not_fit() -> None:
    with serve_store(CONFIG) as publisher, serve_store(BusConfig(shm=False, max_bytes=40_000)) as relay:
        keeper = Keeper(relay.store, "r0")
        with BusClient(CONFIG, local_stores=False) as client:
            published = {}
            for version in (1, 2, 3):
                refs = published[version] = put_version(publisher.store, version)
                fetched = client.fetch(refs)
                held = keeper.keep(version, refs, fetched)
                assert held == Source(relay.endpoint, relay.store.store_id, "r0")
                again = client.fetch([held.rewrite(r) for r in refs])
                assert [a.array.tobytes() for a in again] == [f.array.tobytes() for f in fetched]
            assert keeper.versions == [2, 3] and relay.store.info().count == 4
            with pytest.raises(Released):  # gone from the relay: v1 is more than two versions old
                client.fetch([held.rewrite(published[1][0])])
            big = put_version(publisher.store, 4, (20_000,))
            assert keeper.keep(4, big, client.fetch(big)) is None  # 80 kB > the 40 kB store: not relayed
            keeper.drop(3)
            assert keeper.versions == [] and relay.store.info().count == 0


def test_bytes_tensorbytes_roundtrip_of_bfloat16_bits() -> None:
    """What a relay re-puts is the fetched bytes, whatever the dtype (bfloat16 travels as uint16)."""
    with serve_store(CONFIG) as publisher, serve_store(CONFIG) as relay:
        bits = np.arange(64, dtype=np.uint16)
        ref = publisher.store.put(
            "weights/v1/b", "weights", TensorBytes(bits, "bfloat16", (8, 8)), tag="weights/v1"
        )
        with BusClient(CONFIG, local_stores=False) as client:
            fetched = client.fetch([ref])
            held = Keeper(relay.store).keep(1, [ref], fetched)
            assert held is not None
            [again] = client.fetch([held.rewrite(ref)])
        assert again.dtype == "bfloat16" and again.shape == (8, 8) and again.array.tobytes() == bits.tobytes()
