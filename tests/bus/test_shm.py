"""The shared-memory path: segments under /dev/shm, the same-host probe, cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flowgrpo.bus import BusClient, BusConfig, TensorStore

from .conftest import Producer
from .patterns import pattern

MiB = 1 << 20
SHM = "/dev/shm"


def _files_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(SHM) if n.startswith("flowgrpo-bus-") and f"-{pid}-" in n)


def test_segments_are_removed_on_release_and_close(start_producer: Any) -> None:
    producer: Producer = start_producer()
    ref = producer.put("big", dtype="uint8", shape=[2 * MiB])
    producer.put("small", dtype="uint8", shape=[1000])  # below shm_min_bytes: no file
    files = _files_of(producer.pid)
    assert len(files) == 2 and sum(f.endswith(".probe") for f in files) == 1
    assert all(os.stat(f"{SHM}/{f}").st_mode & 0o777 == 0o600 for f in files)
    with BusClient(BusConfig()) as client:
        assert client.release(producer.endpoint, [ref.key]) == 1
    assert [f for f in _files_of(producer.pid) if not f.endswith(".probe")] == []
    producer.put("again", dtype="uint8", shape=[2 * MiB])
    producer.close()
    assert _files_of(producer.pid) == []


def test_consumer_view_outlives_release_and_is_private(start_producer: Any) -> None:
    producer: Producer = start_producer()
    ref = producer.put("k", dtype="uint16", shape=[MiB], seed=5)
    want = pattern("uint16", [MiB], 5).data.view(np.uint16)
    with BusClient(BusConfig()) as client:
        [first] = client.fetch([ref])
        first.array[:10] = 7  # copy-on-write: neither the producer nor other fetches see it
        [second] = client.fetch([ref])
        assert first.via == second.via == "shm"
        assert np.array_equal(second.array, want) and (first.array[:10] == 7).all()
        producer.command(op="release", keys=["k"])
        assert _files_of(producer.pid) == [f for f in _files_of(producer.pid) if f.endswith(".probe")]
        assert np.array_equal(second.array, want)  # the mapping stays valid after the unlink
        second.array += 1  # and writable


def test_client_falls_back_to_the_socket_when_the_probe_is_unreadable(
    start_producer: Any, tmp_path: Path
) -> None:
    producer: Producer = start_producer()
    ref = producer.put("k", dtype="uint8", shape=[2 * MiB], seed=2)
    want = pattern("uint8", [2 * MiB], 2).data
    with BusClient(BusConfig(shm_dir=str(tmp_path))) as elsewhere:  # another /dev/shm: no probe file
        [got] = elsewhere.fetch([ref])
    assert got.via == "socket" and np.array_equal(got.array, want)
    with BusClient(BusConfig()) as client:
        probe_name, _token = client.stat(producer.endpoint).shm_probe  # type: ignore[misc]
        Path(SHM, probe_name).write_text("another-token")  # same name, another namespace's content
        [got] = client.fetch([ref])
    assert got.via == "socket" and np.array_equal(got.array, want)


def test_a_new_store_removes_segments_of_a_crashed_producer(start_producer: Any) -> None:
    producer: Producer = start_producer()
    producer.put("k", dtype="uint8", shape=[2 * MiB])
    producer.kill()  # SIGKILL: no cleanup ran
    assert len(_files_of(producer.pid)) == 2
    with TensorStore(BusConfig()):
        assert _files_of(producer.pid) == []


@pytest.mark.parametrize("shm_in_store", [True, False])
def test_shm_is_used_only_when_both_sides_allow_it(start_producer: Any, shm_in_store: bool) -> None:
    producer: Producer = start_producer(shm=shm_in_store)
    ref = producer.put("k", dtype="uint8", shape=[2 * MiB])
    with BusClient(BusConfig(shm=True)) as on, BusClient(BusConfig(shm=False)) as off:
        assert on.fetch([ref])[0].via == ("shm" if shm_in_store else "socket")
        assert off.fetch([ref])[0].via == "socket"


def test_segments_are_removed_when_a_producer_exits_without_closing() -> None:
    code = (
        "import os, numpy as np\n"
        "from flowgrpo.bus import BusConfig, TensorStore\n"
        "store = TensorStore(BusConfig())\n"
        "store.put('k', 'weights', np.zeros(2 << 20, np.uint8))\n"
        "print(os.getpid(), len([n for n in os.listdir('/dev/shm') if f'-{os.getpid()}-' in n]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    pid, held = map(int, out.stdout.split())
    assert held == 2 and _files_of(pid) == []
