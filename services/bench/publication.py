"""Weight publication figures of the trainer benchmark (``flowgrpo bench trainer``): the gather
alone, then each publication path as the service runs it (``Publisher``: one shared-memory
segment per tensor on the bus, or one CUDA IPC bucket), each published version taken by a
consumer in another process as a rollout would (bus: fetch, then to its GPU; CUDA IPC: open the
bucket, copy device to device onto its GPU). One warm-up publication (and consumption), then
``--publish-reps`` (>= 3) timed ones. Without pyzmq / OpenTelemetry only the gather is timed."""

from __future__ import annotations

import itertools
import json
import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from flowgrpo.services.bench.common import GiB
from flowgrpo.services.bench.stats import Figure, run_timed, timed
from flowgrpo.services.trainer.distributed import Dist
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.v1 import common_pb2

CONSUMER_TIMEOUT_S = 150


def measure_publication(policy: TrainablePolicy, dist: Dist, repeats: int, store_gib: int) -> dict[str, Any]:
    device = next(iter(policy.trainable().values())).device

    def gather() -> None:
        for _, tensor in policy.iter_published():  # a collective under FSDP: every rank iterates
            del tensor

    specs = policy.published_specs()
    out: dict[str, Any] = {"gather_s": timed(gather, repeats=repeats, device=device), "tensors": len(specs)}
    out["bytes_fp32"] = sum(shape.numel() * 4 for _, shape, _ in specs)
    try:
        from flowgrpo.bus import BusConfig, serve_store
    except ImportError as e:
        out["bus"] = f"not measured: the bus needs pyzmq and OpenTelemetry ({e})"
        return out
    config = BusConfig(max_bytes=store_gib * GiB, transport="ipc")
    server = serve_store(config) if dist.rank == 0 else None
    consumer = Consumer(config.transport) if dist.rank == 0 else None
    versions = itertools.count(101)  # fresh versions for every publication
    try:
        for case in _cases(policy, device):
            out |= _publish_case(policy, dist, case, repeats=repeats, versions=versions,
                                 server=server, consumer=consumer)  # fmt: skip
    finally:
        if consumer is not None:
            consumer.close()
        if server is not None:
            server.close()
    return out


def _cases(policy: TrainablePolicy, device: torch.device) -> list[tuple[str, str]]:
    cases = [("bus", "bfloat16")] if policy.kind == "full" else [("bus", ""), ("bus", "bfloat16")]
    if device.type == "cuda":
        cases.append(("cuda_ipc", "bfloat16"))
    return cases


def _publish_case(
    policy: TrainablePolicy,
    dist: Dist,
    case: tuple[str, str],
    *,
    repeats: int,
    versions: Iterator[int],
    server: Any,
    consumer: Consumer | None,
) -> dict[str, Any]:
    """PATH_DTYPE_publish_s: the producer's publish; PATH_DTYPE_consumer: the consumer's figures
    (``case``: the path, bus or cuda_ipc, and the dtype published, '' for the trainer's fp32)."""
    from flowgrpo.services.trainer.publish import Publisher

    path, dtype = case
    key = f"{path}_{dtype or 'fp32'}"
    device = next(iter(policy.trainable().values())).device
    publisher = Publisher(policy, server.store if server is not None else None, dtype,
                          bus=path == "bus", cuda_ipc=path == "cuda_ipc")  # fmt: skip
    taken: list[dict[str, Any]] = []

    def consume(update: common_pb2.WeightUpdate) -> None:
        if consumer is not None:
            taken.append(consumer.take(update))
        if dist.enabled:
            torch.distributed.barrier()  # rank 0's consumer is done before the next gather

    try:
        runs = run_timed(
            lambda: publisher.publish(next(versions)), repeats=repeats, device=device, between=consume
        )
    finally:
        publisher.close()
    out: dict[str, Any] = {f"{key}_publish_s": runs.seconds}
    if consumer is not None:
        out[f"{key}_consumer"] = _consumer_figures(taken[1:])  # the first: the warm-up's
    return out


def _consumer_figures(taken: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [t["error"] for t in taken if "error" in t]
    if errors:
        return {"error": errors[0]}
    out: dict[str, Any] = {k: taken[0][k] for k in ("bytes", "tensors", "device")}
    for name in ("open_s", "fetch_s", "total_s"):
        if name in taken[0]:
            out[name] = Figure.of([t[name] for t in taken])
    return out


class Consumer:
    """The consumer process (services/bench/consumer.py): one update at a time, through a file
    named on its stdin; its answer is one JSON line. Ended by closing its stdin."""

    def __init__(self, transport: str) -> None:
        cmd = [sys.executable, "-m", "flowgrpo.services.bench.consumer", transport]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ))  # fmt: skip
        self.folder = tempfile.TemporaryDirectory(prefix="bench-consumer-")
        self.ready = self._answer()

    def take(self, update: common_pb2.WeightUpdate) -> dict[str, Any]:
        if "error" in self.ready:
            return self.ready
        path = Path(self.folder.name) / "update.pb"
        path.write_bytes(update.SerializeToString())
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        return self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], CONSUMER_TIMEOUT_S)
        if not readable:
            return {"error": f"no answer from the consumer within {CONSUMER_TIMEOUT_S} s"}
        line = self.proc.stdout.readline()
        if not line:
            return {"error": f"the consumer exited with {self.proc.wait(CONSUMER_TIMEOUT_S)}"}
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=CONSUMER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.folder.cleanup()
