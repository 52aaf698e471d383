"""TensorStore on its own: schema checks, capacity (wait or evict), tombstones, shm files."""

from __future__ import annotations

import os
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flowgrpo.bus import BusConfig, BusServer, ErrorCode, StoreFull, TensorBytes, TensorStore
from flowgrpo.bus.errors import Released
from flowgrpo.bus.wire import ItemError
from flowgrpo.columns import SchemaViolation

KiB, MiB = 1 << 10, 1 << 20


def _store(tmp_path: Path, **fields: object) -> TensorStore:
    return TensorStore(BusConfig(shm_dir=str(tmp_path), **fields))  # type: ignore[arg-type]


def test_put_checks_the_column_schema(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        with pytest.raises(SchemaViolation, match=r"column 'latents' \(k1\): dtype float64 does not match"):
            store.put("k1", "latents", np.zeros((2, 3, 64)))
        with pytest.raises(SchemaViolation, match=r"dimension 2 must be 64, got 63"):
            store.put("k2", "latents", np.zeros((2, 3, 63), np.float32))
        with pytest.raises(SchemaViolation, match=r"unknown column 'latent'; did you mean 'latents'"):
            store.put("k3", "latent", np.zeros((2, 3, 64), np.float32))
        ref = store.put("k4", "latents", np.ones((2, 3, 64), np.float32), policy_version=5)
        want = ("latents", "float32", (2, 3, 64), 2 * 3 * 64 * 4, 5)
        assert (ref.column, ref.dtype, ref.shape, ref.nbytes, ref.policy_version) == want
        assert store.info().count == 1 and store.info().used_bytes == ref.nbytes


def test_put_refuses_dtypes_that_cannot_travel(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        with pytest.raises(ValueError, match="cannot travel on the bus"):
            store.put("o", "weights", np.array([object()]))
        with pytest.raises(ValueError, match="native-endian"):
            store.put("b", "weights", np.zeros(3, ">f4"))
        with pytest.raises(ValueError, match="TensorBytes holds 3 bytes but bfloat16\\[2\\] needs 4"):
            TensorBytes(np.zeros(3, np.uint8), "bfloat16", (2,))


def test_keys_are_unique_while_held(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        store.put("k", "weights", np.zeros(3))
        with pytest.raises(ValueError, match="already held"):
            store.put("k", "weights", np.zeros(3))
        store.release(["k"])
        assert store.put("k", "weights", np.ones(2)).shape == (2,)  # a released key may be reused


def test_lookup_tells_released_evicted_and_unknown_apart(tmp_path: Path) -> None:
    with _store(tmp_path, max_bytes=3 * KiB, when_full="evict_oldest") as store:
        for i in range(3):
            store.put(f"step1/sample{i}", "weights", np.zeros(KiB // 4, np.float32))
        store.release(["step1/sample0"])
        store.put("step1/sample3", "weights", np.zeros(KiB // 2, np.float32))  # 2 KiB: evicts sample1
        codes = {k: store.lookup(k) for k in ("step1/sample0", "step1/sample1", "step1/sample9")}
        assert (
            isinstance(codes["step1/sample0"], ItemError)
            and codes["step1/sample0"].code is ErrorCode.RELEASED
        )
        assert (
            isinstance(codes["step1/sample1"], ItemError) and codes["step1/sample1"].code is ErrorCode.EVICTED
        )
        unknown = codes["step1/sample9"]
        assert isinstance(unknown, ItemError) and unknown.code is ErrorCode.NOT_FOUND
        assert "did you mean 'step1/sample2'" in unknown.message or "'step1/sample3'" in unknown.message
        assert not isinstance(store.lookup("step1/sample2"), ItemError)


def test_tombstones_are_bounded(tmp_path: Path) -> None:
    with _store(tmp_path, max_tombstones=2) as store:
        for i in range(4):
            store.put(f"k{i}", "weights", np.zeros(1))
            store.release([f"k{i}"])
        codes = [getattr(store.lookup(f"k{i}"), "code", None) for i in range(4)]
        assert codes == [ErrorCode.NOT_FOUND, ErrorCode.NOT_FOUND, ErrorCode.RELEASED, ErrorCode.RELEASED]


def test_release_by_tag_and_prefix(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        store.put("s1/a", "weights", np.zeros(1), tag="step1")
        store.put("s1/b", "weights", np.zeros(1), tag="step1")
        store.put("s2/a", "weights", np.zeros(1), tag="step2")
        store.put("s2/b", "weights", np.zeros(1))
        assert store.release(tag="step1") == 2
        assert store.release(prefix="s2/") == 2
        assert store.release(["nothing"]) == 0
        assert store.info().count == 0 and store.info().used_bytes == 0


def test_full_store_waits_for_a_release(tmp_path: Path) -> None:
    with _store(tmp_path, max_bytes=2 * KiB, put_timeout_s=10) as store:
        store.put("old", "weights", np.zeros(KiB, np.uint8))
        store.put("older", "weights", np.zeros(KiB, np.uint8))
        threading.Timer(0.2, store.release, args=(["old"],)).start()
        start = time.monotonic()
        store.put("new", "weights", np.zeros(KiB, np.uint8))
        assert 0.15 < time.monotonic() - start < 5


def test_full_store_fails_naming_capacity_and_oldest_keys(tmp_path: Path) -> None:
    with _store(tmp_path, max_bytes=2 * KiB, put_timeout_s=0.2) as store:
        store.put("step1/a", "weights", np.zeros(KiB, np.uint8))
        store.put("step1/b", "weights", np.zeros(KiB, np.uint8))
        start = time.monotonic()
        with pytest.raises(StoreFull) as info:
            store.put("step2/a", "weights", np.zeros(KiB, np.uint8))
        assert time.monotonic() - start >= 0.2
        message = str(info.value)
        for fragment in (
            "capacity 2.0 KiB",
            "2.0 KiB used by 2 tensors",
            "'step1/a', 'step1/b'",
            "waiting 0.2 s",
        ):
            assert fragment in message
        assert info.value.code is ErrorCode.UNAVAILABLE
        with pytest.raises(StoreFull, match="more than the store's capacity"):
            store.put("huge", "weights", np.zeros(3 * KiB, np.uint8))


def test_allocate_then_commit_writes_in_place(tmp_path: Path) -> None:
    with _store(tmp_path, shm_min_bytes=MiB) as store:
        view = store.allocate("bf", "weights", "bfloat16", (MiB,))
        assert view.dtype == np.uint16 and view.shape == (MiB,) and view.flags.writeable
        assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".probe")]  # in shared memory
        assert getattr(store.lookup("bf"), "code", None) is ErrorCode.NOT_FOUND  # invisible until committed
        view[:] = 0x3F80  # bfloat16 1.0
        ref = store.commit("bf")
        found = store.lookup("bf")
        assert not isinstance(found, ItemError) and (found.view() == 0x3F80).all() and ref.dtype == "bfloat16"
        store.allocate("gone", "weights", "float32", (4,))
        store.release(["gone"])
        with pytest.raises(Released):
            store.commit("gone")


def test_shm_files_are_private_removed_on_release_and_close(tmp_path: Path) -> None:
    store = _store(tmp_path, shm_min_bytes=MiB)
    store.put("big", "weights", np.zeros(MiB, np.uint8))
    store.put("small", "weights", np.zeros(MiB - 1, np.uint8))
    files = sorted(tmp_path.iterdir())
    assert len(files) == 2 and any(f.name.endswith(".probe") for f in files)  # probe + the big one only
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    store.release(["big"])
    assert [f.name for f in tmp_path.iterdir()] == [store.info().shm_probe[0]]  # type: ignore[index]
    store.put("big2", "weights", np.zeros(MiB, np.uint8))
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_stale_files_of_dead_processes_are_removed(tmp_path: Path) -> None:
    from flowgrpo.bus import shm

    ns = shm.new_name().split("-")[2]
    dead = tmp_path / f"flowgrpo-bus-{ns}-999999999-abcd"
    alive = tmp_path / f"flowgrpo-bus-{ns}-{os.getpid()}-abcd"
    other_namespace = tmp_path / "flowgrpo-bus-1-999999999-abcd"
    for path in (dead, alive, other_namespace):
        path.write_bytes(b"x")
    with _store(tmp_path):
        assert not dead.exists() and alive.exists() and other_namespace.exists()


def test_the_ipc_folder_of_a_killed_server_is_removed_by_the_next_one(start_producer: Any) -> None:
    """A SIGKILLed server cannot clean up: the next server in the same folder removes what it
    left (the socket and its folder), and leaves a live server's and an unrelated folder alone."""
    with tempfile.TemporaryDirectory() as short:  # pytest's tmp_path is too long for a socket path
        folder = Path(short)
        killed, live = (start_producer(transport="ipc", shm=False, ipc_dir=short) for _ in range(2))
        folder_of = {p: Path(p.endpoint.removeprefix("ipc://")).parent for p in (killed, live)}
        killed.kill()
        assert (folder_of[killed] / "store.sock").exists()  # what a killed server leaves
        unrelated = folder / "flowgrpo-bus-notes"
        unrelated.mkdir()
        with (
            TensorStore(BusConfig(transport="ipc", shm=False, ipc_dir=short)) as store,
            BusServer(store) as server,
        ):
            assert not folder_of[killed].exists() and folder_of[live].exists() and unrelated.exists()
            own = Path(server.endpoint.removeprefix("ipc://")).parent
            assert stat.S_IMODE(own.stat().st_mode) == 0o700
        assert sorted(folder.iterdir()) == sorted([folder_of[live], unrelated])


def test_store_without_shm_folder_falls_back_to_private_memory(tmp_path: Path) -> None:
    with _store(tmp_path / "missing", shm_min_bytes=1) as store:
        ref = store.put("k", "weights", np.arange(10))
        found = store.lookup("k")
        assert not isinstance(found, ItemError) and found.segment is None and store.info().shm_probe is None
        assert ref.nbytes == 80
