"""The bus imports and moves numpy data in a process where torch cannot be imported."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["torch"] = None  # any import of torch now fails
import numpy as np
from flowgrpo.bus import BusClient, BusConfig, TensorBytes, serve_store

with serve_store(BusConfig(shm_min_bytes=1024)) as server:
    big = np.arange(300_000, dtype=np.float32)
    bf16 = TensorBytes(np.array([0x3F80, 0x4000], np.uint16), "bfloat16", (2,))
    refs = [server.store.put("big", "weights", big), server.store.put("bf16", "weights", bf16)]
    with BusClient(BusConfig(), local_stores=False) as client:
        got_big, got_bf16 = client.fetch(refs)
    assert got_big.via == "shm" and np.array_equal(got_big.array, big)
    assert got_bf16.array.dtype == np.uint16 and got_bf16.array.tolist() == [0x3F80, 0x4000]
    with BusClient(BusConfig(shm=False), local_stores=False) as client:
        assert np.array_equal(client.fetch(refs[:1])[0].array, big)
assert sys.modules["torch"] is None
print("ok")
"""


def test_bus_round_trips_numpy_without_torch() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
